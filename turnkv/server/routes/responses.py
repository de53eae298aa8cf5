"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request is translated into a chat completions request (responses_input.py) and generated on the
chat path; its answer is shaped by responses_output.py. ``store`` keeps the conversation per tenant
(response_store.py) so ``previous_response_id`` continues it: the next prompt renders the stored
conversation plus the new input, which extends the previous prompt and reply, and the prompt cache
restores all of that instead of computing it again."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import chat_extras
from ..auth import authorize
from ..context import ServerContext
from ..generation import ended, event_stream, submit
from ..http_app import App
from ..requests import chat_generation, parse, read_json
from ..response_store import ResponseStore
from ..responses_input import ResponsesRequest, chat_request, input_messages, named_for_responses
from ..responses_output import Turn, new_id, stream_response
from ..schemas import RequestError, now
from ..streaming import RESPONSES


def not_found(rid: str, param: str | None = None) -> RequestError:
    return RequestError(f"No response found with id {rid!r}.", status=404, param=param,
                        code="previous_response_not_found" if param else "not_found")


def register(app: App, ctx: ServerContext) -> None:
    engine, config = ctx.engine, ctx.config
    store = ResponseStore()

    @app.post(RESPONSES)
    async def create_response(request: Request):
        who = authorize(request, config.keys)
        req = parse(ResponsesRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        req.refuse_unsupported()
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = store.get(who.tenant, req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = list(previous.messages)
        conversation = history + input_messages(req.input)
        chat = chat_request(req, conversation)
        with named_for_responses():
            gen = await chat_generation(ctx, who, chat)
        turn = Turn(new_id("resp"), now(), engine.name, req, gen.params, chat_extras.tool_format(engine, chat),
                    chat_extras.forced_names(chat), conversation, store if req.store else None, who.tenant,
                    config.request_timeout_s)
        with named_for_responses():
            job = submit(ctx, gen, RESPONSES, req.stream)
        if req.stream:
            return event_stream(stream_response(job, turn))
        end = await ended(ctx, request, job)
        if isinstance(end, Response):
            return end
        return JSONResponse(turn.complete(*turn.split(end.result.text), end.result))

    @app.get(RESPONSES + "/{rid}")
    async def get_response(rid: str, request: Request):
        who = authorize(request, config.keys)
        stored = store.get(who.tenant, rid)
        if stored is None:
            raise not_found(rid)
        return stored.response

    @app.delete(RESPONSES + "/{rid}")
    async def delete_response(rid: str, request: Request):
        who = authorize(request, config.keys)
        if not store.delete(who.tenant, rid):
            raise not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}
