"""The prompt cache's stats and flush, per tenant (the admin sees and flushes everyone's)."""

from __future__ import annotations

from starlette.requests import Request

from ..auth import authorize, require_admin
from ..context import ServerContext
from ..http_app import App
from ..stats import cache_stats_json, store_stats


def register(app: App, ctx: ServerContext) -> None:
    engine, config, worker, cache_enabled = ctx.engine, ctx.config, ctx.worker, ctx.cache_enabled

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        who = authorize(request, config.keys)
        owner = None if who.admin else who.tenant
        return cache_stats_json(engine, store_stats(engine, owner), cache_enabled, global_view=who.admin,
                                worker=worker)

    @app.delete("/v1/cache")
    async def flush_cache(request: Request):
        """A tenant flushes its own entries; the admin everyone's (or one tenant's: ?tenant=NAME)."""
        who = authorize(request, config.keys)
        owner = who.tenant
        if who.admin:
            owner = request.query_params.get("tenant")
        elif request.query_params.get("tenant") not in (None, who.tenant):
            require_admin(who, "flushing another tenant's entries")
        removed = freed = 0
        if engine.prompt_cache is not None:
            # the store has its own lock: no need to wait behind queued generations, and a
            # generation running now just finds nothing to reuse on its next lookup
            removed, freed = engine.prompt_cache.clear(owner)
        view = None if who.admin else who.tenant
        return {"flushed": True, "entries_removed": removed, "bytes_freed": freed,
                "stats": cache_stats_json(engine, store_stats(engine, view), cache_enabled, global_view=who.admin,
                                          worker=worker)}
