"""POST /v1/chat/completions and /v1/completions (OpenAI's shapes, streaming or not)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .. import chat_extras
from ..auth import authorize
from ..context import ServerContext
from ..generation import generate, wants_usage
from ..http_app import App
from ..requests import build_completion_request, chat_generation, parse, read_json, sampling_params
from ..schemas import ChatCompletionRequest, CompletionRequest
from ..streaming import CHAT, COMPLETIONS
from ..tenants import tenant_key


def register(app: App, ctx: ServerContext) -> None:
    engine, config = ctx.engine, ctx.config

    @app.post(CHAT)
    async def chat_completions(request: Request):
        who = authorize(request, config.keys)
        req = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        gen = await chat_generation(ctx, who, req)
        return await generate(ctx, request, CHAT, gen, req.stream, wants_usage(req),
                              chat_extras.tool_format(engine, req), chat_extras.forced_names(req))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        who = authorize(request, config.keys)
        req = parse(CompletionRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        params = sampling_params(req, config.defaults, engine.max_context, config.max_n)
        gen = await run_in_threadpool(build_completion_request, engine, req, params,
                                      tenant_key(who.tenant, req.cache_salt), who.tenant)
        return await generate(ctx, request, COMPLETIONS, gen, req.stream, wants_usage(req))
