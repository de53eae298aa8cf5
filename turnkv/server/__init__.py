"""OpenAI-compatible HTTP server: app.py (builds the Starlette app), routes/ (one module per API),
requests.py (body reading, validation, request building), generation.py and streaming.py (the
answer: one JSON body or SSE chunks), schemas.py (request validation, response shapes), worker.py
(the single engine thread), stats.py and metrics.py (cache stats, Prometheus), serve.py
(``turnkv serve``)."""
