"""OpenAI-compatible HTTP API over one Engine (Starlette + uvicorn; http_app.py).

The HTTP side validates and tokenizes (off the event loop; requests.py), then hands a
GenerationRequest to the single engine worker (worker.py) and relays what comes back: one JSON
body, or SSE chunks while streaming (generation.py, streaming.py). Every refusal is an
OpenAI-style error body ``{"error": {message, type, param, code}}`` (Anthropic's
``{"type": "error", "error": {type, message}}`` under /v1/messages) with a 4xx status. The endpoints live in routes/, one module per API.

Isolation: the prompt cache namespaces snapshots by ``GenerationRequest.tenant``; the server sets
it to a hash of the tenant the request's API key maps to (tenants.py) and its ``cache_salt``, so
one tenant never reuses (or can time) another's prefix; ``GenerationRequest.owner`` (the tenant)
scopes its budget share, flushes and stats.

Hardening: a request's body is read under a deadline and parsed off the event loop; chat
requests are bounded (message count, text size) before any template work; uvicorn limits
connections and the time a client may take to send its headers (``GuardedH11``); every client
mistake is a 4xx, every internal fault a logged 500 whose body says nothing of the internals.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import anthropic_api
from . import logprobs as lp_format
from . import schemas
from .context import ServerConfig, ServerContext
from .http_app import App
from .metrics import ServerMetrics
from .routes import register_all
from .schemas import NOT_FOUND, SERVER_ERROR, RequestError
from ..engine.threads import threads_dict
from .stats import gateway_load, memory_stats, store_stats
from .streaming import CHAT, COMPLETIONS, RESPONSES
from .worker import EngineWorker

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("turnkv.server")


def create_app(engine, config: ServerConfig | None = None, engine_thread: bool = True) -> App:
    """``engine_thread=False``: the caller runs the engine loop itself (``app.state.worker.run``),
    as ``serve`` does on the main thread. The default starts the loop on a thread of its own,
    which is slower wherever another thread has run OpenMP work (loading the model does): libgomp
    then manages more threads than cores and stops spinning between parallel regions, and a
    decode step took 2.5-3x as long (SmolLM2, 2 cores, in-process; see ``serve``)."""
    config = config or ServerConfig()
    config.defaults.validate()
    if config.max_n < 1:
        raise ValueError(f"--max-n must be at least 1, got {config.max_n}")
    cache_enabled = engine.prompt_cache is not None and bool(engine.prompt_cache.enabled)
    metrics = ServerMetrics(engine.name, cache_enabled)
    worker = EngineWorker(engine, on_done=metrics.observe, own_thread=engine_thread)
    metrics.bind(worker.pending, lambda: store_stats(engine),
                 lambda: memory_stats(engine, store_stats(engine).get("bytes", 0)), lambda: worker.restarts,
                 lambda: gateway_load(engine), threads=lambda: threads_dict(engine.threads)["current"])
    ctx = ServerContext(engine, config, worker, metrics, cache_enabled, started=int(time.time()),
                        token_names=lp_format.TokenText(engine.tokenizer))

    @asynccontextmanager
    async def lifespan(app: App):
        worker.start()
        yield
        worker.stop()

    app = App(lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    install_error_handlers(app, metrics)
    register_all(app, ctx)
    return app


def install_error_handlers(app: App, metrics: ServerMetrics) -> None:
    """Every error in its API's shape (OpenAI's; Anthropic's under /v1/messages); a refused
    generation request counted per endpoint."""

    def respond(request: Request, err: RequestError) -> JSONResponse:
        body = anthropic_api.error_json(err) if anthropic_api.is_messages_path(request.url.path) else err.body()
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    async def _request_error(request: Request, err: RequestError):
        if request.url.path in (CHAT, COMPLETIONS, RESPONSES, anthropic_api.MESSAGES):
            metrics.rejected(request.url.path)
        return respond(request, err)

    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = NOT_FOUND if err.status_code == 404 else schemas.INVALID_REQUEST
        message = f"{request.method} {request.url.path}: {err.detail}"
        return respond(request, RequestError(message, status=err.status_code, type=kind, headers=err.headers))

    async def _server_error(request: Request, err: Exception):
        # an internal fault: the log has the traceback, the client a message that leaks nothing
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=err)
        return respond(request, RequestError("internal error (see the server log)", status=500, type=SERVER_ERROR))

    for kind, handler in ((RequestError, _request_error), (StarletteHTTPException, _http_error),
                          (Exception, _server_error)):
        app.add_exception_handler(kind, handler)
