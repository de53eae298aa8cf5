"""The HTTP app: Starlette, with the few ways of adding endpoints the routes use (``get``,
``post``, ``delete``, ``add_api_route``).

Every endpoint is an ``async def`` that takes the ``Request`` (a parameter named ``request``)
and the path's parameters by name (``/web/{name}`` -> ``name: str``), parses its own body
(server/requests.py) and returns a ``Response`` or a JSON-able body, sent as a 200
``JSONResponse``. That is all turnkv used of FastAPI, whose import (its OpenAPI models, ~0.1-0.15 s
of pydantic class building on a 2-core Zen 2) and route analysis held the GIL during every
start-up for no use: the app has no OpenAPI schema, docs pages or typed parameters."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Endpoint = Callable[..., Any]


def _handler(endpoint: Endpoint) -> Callable[[Request], Any]:
    """The Starlette endpoint for ``endpoint``: its arguments from the request, its body as JSON."""
    if not inspect.iscoroutinefunction(endpoint):
        raise TypeError(f"{endpoint.__name__}: an endpoint must be an async def")
    names = list(inspect.signature(endpoint).parameters)

    async def handle(request: Request) -> Response:
        args = {name: request if name == "request" else request.path_params[name] for name in names}
        body = await endpoint(**args)
        return body if isinstance(body, Response) else JSONResponse(body)

    handle.__name__ = endpoint.__name__
    return handle


class App(Starlette):
    def add_api_route(self, path: str, endpoint: Endpoint, methods: list[str]) -> None:
        route = Route(path, _handler(endpoint), methods=methods)
        if "HEAD" not in methods:      # Starlette adds HEAD to a GET route; the API has none
            route.methods.discard("HEAD")
        self.router.routes.append(route)

    def _route(self, path: str, method: str) -> Callable[[Endpoint], Endpoint]:
        def register(endpoint: Endpoint) -> Endpoint:
            self.add_api_route(path, endpoint, [method])
            return endpoint
        return register

    def get(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._route(path, "GET")

    def post(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._route(path, "POST")

    def delete(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._route(path, "DELETE")
