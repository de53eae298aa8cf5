"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API; the translation to
and from the chat path is server/anthropic_api.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import anthropic_api as api
from .. import chat_extras, schemas
from ..auth import authorize
from ..context import ServerContext
from ..generation import ended, event_stream, submit
from ..http_app import App
from ..requests import chat_generation, parse, read_json
from ..schemas import ChatCompletionRequest


def register(app: App, ctx: ServerContext) -> None:
    engine, config = ctx.engine, ctx.config

    async def chat_request(request: Request, model: type[api.CountTokensRequest]):
        """The request's chat-completions twin and the GenerationRequest it makes."""
        who = authorize(request, config.keys)
        req = parse(model, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        chat = parse(ChatCompletionRequest, api.chat_body(req))
        return chat, await chat_generation(ctx, who, chat)

    @app.post(api.MESSAGES)
    async def messages(request: Request):
        chat, gen = await chat_request(request, api.MessagesRequest)
        tool_format = chat_extras.tool_format(engine, chat)
        rid = schemas.new_id("msg").replace("-", "_")
        job = submit(ctx, gen, api.MESSAGES, chat.stream)
        if chat.stream:
            forced = chat_extras.forced_names(chat)
            return event_stream(api.stream_message(job, rid, engine.name, tool_format, forced, config.request_timeout_s))
        end = await ended(ctx, request, job, api.error_json)
        if isinstance(end, Response):
            return end
        return api.message(rid, engine.name, end.result, tool_format)

    @app.post(api.COUNT_TOKENS)
    async def count_tokens(request: Request):
        """The prompt's tokens exactly as /v1/messages would render them (tools included)."""
        _, gen = await chat_request(request, api.CountTokensRequest)
        return {"input_tokens": len(gen.prompt_ids)}
