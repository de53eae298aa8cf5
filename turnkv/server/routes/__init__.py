"""The server's routes, one module per API: each has ``register(app, ctx)``, which adds its
endpoints to the app (http_app.py) with the shared ``ServerContext``. A new API is a new module here,
listed in ``ROUTES``."""

from __future__ import annotations

from ..context import ServerContext
from ..http_app import App
from . import cache, completions, messages, responses, status, tokenize, web, worker_info

ROUTES = (completions, responses, messages, tokenize, status, cache, worker_info, web)


def register_all(app: App, ctx: ServerContext) -> None:
    for module in ROUTES:
        module.register(app, ctx)
