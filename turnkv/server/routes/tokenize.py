"""POST /tokenize and /detokenize, as llama-server and vLLM offer them (clients count tokens with
them). /tokenize takes llama-server's ``{"content", "add_special", "with_pieces"}``, vLLM's
``{"prompt", "add_special_tokens"}`` or vLLM's chat form ``{"messages", "add_generation_prompt",
"tools", "chat_template_kwargs"}`` (rendered by the chat template exactly as /v1/chat/completions
renders it) and answers ``{"tokens", "count", "max_model_len"}`` (llama-server's clients read
``tokens``); /detokenize answers both llama-server's ``content`` and vLLM's ``prompt``."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .. import chat_extras
from ..auth import authorize
from ..context import ServerContext
from ..http_app import App
from ..requests import check_text_size, parse, read_json
from ..schemas import ChatCompletionRequest, RequestError, _Strict, content_chars


class TokenizeRequest(_Strict):
    content: StrictStr | None = None               # llama-server
    add_special: StrictBool = False                # llama-server: BOS and the like
    with_pieces: StrictBool = False                # llama-server: [{"id", "piece"}] instead of ids
    prompt: StrictStr | None = None                # vLLM
    add_special_tokens: StrictBool | None = None   # vLLM: default true for a prompt, false for messages
    return_token_strs: StrictBool = False          # vLLM
    messages: list[Any] | None = None              # vLLM's chat form
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    tokens: list[StrictInt] = Field(...)


def token_ids(engine, req: TokenizeRequest, max_messages: int) -> list[int]:
    given = [name for name in ("content", "prompt", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise RequestError("send exactly one of content (llama-server), prompt or messages (vLLM)",
                           code="invalid_value")
    tok = engine.tokenizer
    if tok is None:
        raise RequestError(f"model {engine.name} has no tokenizer", code="invalid_value")
    if req.messages is None:
        text = req.content if req.content is not None else req.prompt
        check_text_size(engine, len(text), given[0])
        special = req.add_special if req.content is not None else req.add_special_tokens is not False
        return tok.encode(text, add_special_tokens=special)
    if req.add_special_tokens:
        raise RequestError("add_special_tokens with messages is not supported: the chat template places the "
                           "special tokens", param="add_special_tokens", code="unsupported_parameter")
    chat = parse(ChatCompletionRequest, {"messages": req.messages, "tools": req.tools,
                                         "chat_template_kwargs": req.chat_template_kwargs})
    if len(chat.messages) > max_messages:
        raise RequestError(f"the request has {len(chat.messages)} messages; at most {max_messages} are accepted",
                           param="messages", code="too_many_messages")
    check_text_size(engine, sum(content_chars(m.content) for m in chat.messages), "messages")
    extras = chat_extras.prepare(engine, chat)
    try:
        return list(tok.render_chat(extras.messages, req.add_generation_prompt, boundary_messages=0,
                                    tools=extras.tools, template_kwargs=extras.template_kwargs).ids)
    except ValueError as err:
        raise RequestError(str(err), param="messages", code="invalid_value") from None


def register(app: App, ctx: ServerContext) -> None:
    engine, config = ctx.engine, ctx.config

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request, config.keys)
        req = parse(TokenizeRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        ids = await run_in_threadpool(token_ids, engine, req, config.max_messages)
        tok = engine.tokenizer
        tokens: list = [{"id": t, "piece": tok.decode([t])} for t in ids] if req.with_pieces else ids
        body = {"tokens": tokens, "count": len(ids), "max_model_len": engine.max_context}
        if req.return_token_strs:
            body["token_strs"] = [tok.id_to_token(t) for t in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request, config.keys)
        req = parse(DetokenizeRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        if engine.tokenizer is None:
            raise RequestError(f"model {engine.name} has no tokenizer", code="invalid_value")
        vocab = engine.model.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens",
                               code="invalid_value")
        text = await run_in_threadpool(engine.tokenizer.decode, req.tokens)
        return {"content": text, "prompt": text}
