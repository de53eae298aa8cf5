"""The built-in web page and its assets (turnkv/web/)."""

from __future__ import annotations

from starlette.responses import Response

from ... import web
from ..context import ServerContext
from ..http_app import App
from ..schemas import NOT_FOUND, RequestError


def register(app: App, ctx: ServerContext) -> None:
    @app.get("/")
    async def web_page():
        return await web_asset("index.html")

    @app.get("/web/{name}")
    async def web_asset(name: str):
        found = web.asset(name)
        if found is None:
            raise RequestError(f"GET /web/{name}: no such file", status=404, type=NOT_FOUND, code="not_found")
        return Response(found[0], media_type=found[1], headers={"Cache-Control": "no-cache"})
