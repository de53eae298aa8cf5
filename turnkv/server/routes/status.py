"""The model list, health and Prometheus metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..auth import authorize, require_admin
from ..context import ServerContext
from ..http_app import App
from ..metrics import CONTENT_TYPE_LATEST
from ..schemas import SERVER_ERROR, error_body


def register(app: App, ctx: ServerContext) -> None:
    engine, config, worker, metrics, started = ctx.engine, ctx.config, ctx.worker, ctx.metrics, ctx.started

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request, config.keys)
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": started,
                                            "owned_by": "turnkv", "max_model_len": engine.max_context}]}

    @app.get("/health")
    async def health():
        # unauthenticated (load balancers probe it), so it says nothing of the traffic when the
        # server has keys: the load is for the admin (/v1/cache/stats, /metrics)
        if not worker.alive:
            why = "the engine is down (it failed repeatedly)" if worker.dead else "the engine is not running"
            return JSONResponse(error_body(why, type=SERVER_ERROR), status_code=503)
        body = {"status": "ok", "model": engine.name}
        if not config.keys.configured:
            body["pending"] = worker.pending()
        return body

    @app.get("/metrics")
    async def prometheus(request: Request):
        if config.keys.configured:
            require_admin(authorize(request, config.keys), "/metrics on a server with API keys")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
