"""OpenAI-compatible HTTP server: app.py (routes), schemas.py (request validation, response shapes),
worker.py (the single engine thread), metrics.py (Prometheus)."""
