"""From an HTTP request to a GenerationRequest: the body read under a deadline and size limit,
parsed (off the event loop when large), validated against the schemas, and checked against what
the engine can ever answer. Every refusal is a ``RequestError`` (an OpenAI-style 4xx body)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import replace

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ..engine.engine import ContextLengthError, GenerationRequest
from ..engine.grammar import ll_tokenizer
from ..engine.sampling import ParamError, SamplingParams
from ..loading.token_chars import longest_token_chars
from . import chat_extras, schemas
from .context import BODY_TIMEOUT_S, DEFAULT_MAX_MESSAGES, DEFAULT_MAX_N
from .schemas import ChatCompletionRequest, CompletionRequest, RequestError, content_chars
from .tenants import tenant_key
from .tools import template_format

log = logging.getLogger("turnkv.server")

PARSE_INLINE_BYTES = 64 * 1024    # bodies above this are parsed on a worker thread, not the event loop


def sampling_params(req: ChatCompletionRequest | CompletionRequest, defaults: SamplingParams,
                    max_context: int, max_n: int = DEFAULT_MAX_N) -> SamplingParams:
    """The request's sampling fields over the server's defaults; RequestError on values no request
    could ever satisfy. A max_tokens that fits the context but not after the prompt is clamped
    (finish_reason "length"), as llama.cpp's server does."""
    unsupported = req.unsupported()
    if unsupported:
        param, message = unsupported[0]
        raise RequestError(message, param=param, code="unsupported_parameter")
    limit = req.token_limit()
    if limit is not None and limit >= max_context:
        raise RequestError(f"{req.token_limit_param()} is {limit} but the model's context is {max_context} "
                           f"tokens (prompt included)", param=req.token_limit_param(), code="invalid_value")
    top_k = req.top_k if req.top_k is not None else defaults.top_k
    stop = req.stop_list()
    return replace(
        defaults,
        max_tokens=limit if limit is not None else defaults.max_tokens,
        temperature=req.temperature if req.temperature is not None else defaults.temperature,
        top_p=req.top_p if req.top_p is not None else defaults.top_p,
        top_k=max(0, top_k),
        seed=req.seed if req.seed is not None else defaults.seed,
        stop=stop if stop is not None else list(defaults.stop),
        ignore_eos=req.ignore_eos or defaults.ignore_eos,
        **scoring(req, max_n),
    )


def scoring(req: ChatCompletionRequest | CompletionRequest, max_n: int) -> dict:
    """Penalties, logit_bias, stop_token_ids, logprobs and n (checked against ``--max-n``)."""
    if req.n > max_n:
        raise RequestError(f"n is {req.n} but this server returns at most {max_n} choices per request (--max-n)",
                           param="n", code="invalid_value")
    try:
        return req.scoring()
    except ParamError as err:
        raise RequestError(str(err), param=err.param, code="invalid_value") from None


def max_token_chars(engine) -> int:
    """An upper bound on the characters one token stands for (the longest vocabulary entry), so
    a text longer than ``context x this`` cannot fit the context whatever its tokens: refused
    before the template or the tokenizer spend time on it. Once per engine, from the cache dir
    where an earlier start stored it (loading/token_chars.py)."""
    cached = getattr(engine, "_max_token_chars", None)
    if cached is None:
        cached = longest_token_chars(engine.tokenizer)[0]
        engine._max_token_chars = cached
    return cached


def warm_up(engine) -> None:
    """What the first request would otherwise pay once, done before the server accepts one:
    the vocabulary scan of ``max_token_chars`` (~0.2 s for Gemma 3's 262k entries, a read of the
    cache dir once an earlier start stored its result) and the import
    of anyio's thread-pool backend (starlette runs sync endpoints through it). Measured on the
    Zen 3 VM: Gemma 3's first request took 640 ms more than its prefill, later ones ~60 ms.
    The grammar engine's view of the vocabulary comes later: ``warm_up_grammar``."""
    import importlib

    max_token_chars(engine)
    try:     # a private module: only a head start, so a renamed one must not stop the server
        importlib.import_module("anyio._backends._asyncio")
    except ImportError:
        pass


def warm_up_grammar(engine) -> None:
    """When the chat template renders tools, the grammar engine's view of the vocabulary, which
    every forced tool call (and structured output) compiles against: 6-11 s for Gemma 3's 262k
    entries on a busy 2-core Zen 4, 0.3-0.8 s for Llama 3's 128k, paid by the first such request
    otherwise. Without tools it stays lazy: a server that never sees a grammar never pays it.
    ``serve`` calls it on a thread of its own once the server answers (``grammar_warm_up_thread``):
    a grammar request that comes first waits in ``ll_tokenizer`` for the one build, under its lock,
    and no request sees a view before it is complete."""
    tok = engine.tokenizer
    if tok is not None and template_format(tok.chat_template) is not None:
        ll_tokenizer(tok)


def grammar_warm_up_thread(engine, answering, stop: threading.Event) -> threading.Thread:
    """A started daemon thread that waits until ``answering()`` (the HTTP server accepts
    requests) and then runs ``warm_up_grammar``; ``stop`` set first ends it without building.
    A daemon: a server told to stop mid-build exits without waiting for it."""

    def build() -> None:
        while not answering():
            if stop.wait(0.02):
                return
        try:
            warm_up_grammar(engine)
        except Exception as err:     # only a head start: the first grammar request builds it again and says why
            log.warning("turnkv: the grammar engine's vocabulary view failed (%s); grammar requests will retry", err)

    thread = threading.Thread(target=build, name="turnkv-grammar-warm-up", daemon=True)
    thread.start()
    return thread


def check_text_size(engine, chars: int, param: str) -> None:
    limit = engine.max_context * max_token_chars(engine)
    if chars > limit:
        raise RequestError(f"the prompt text has {chars} characters: more than any {engine.max_context}-token "
                           f"context can hold", param=param, code="context_length_exceeded")


def build_chat_request(engine, req: ChatCompletionRequest, params: SamplingParams, tenant: str,
                       owner: str = "", max_messages: int = DEFAULT_MAX_MESSAGES) -> GenerationRequest:
    # bounded before any template work: rendering costs grow with the message count and text
    if len(req.messages) > max_messages:
        raise RequestError(f"the request has {len(req.messages)} messages; at most {max_messages} are "
                           f"accepted (--max-messages)", param="messages", code="too_many_messages")
    check_text_size(engine, sum(content_chars(m.content) for m in req.messages), "messages")
    try:
        extras = chat_extras.prepare(engine, req)     # tools, response_format, chat_template_kwargs
        gen = engine.chat_request(extras.messages, params, tenant, tools=extras.tools,
                                  template_kwargs=extras.template_kwargs)
        gen.grammar = extras.grammar
    except ValueError as err:    # the template refused the messages (raise_exception), or no template
        raise RequestError(str(err), param="messages", code="invalid_value") from None
    gen.owner = owner
    check(engine, gen, "messages")
    return gen


def build_completion_request(engine, req: CompletionRequest, params: SamplingParams,
                             tenant: str, owner: str = "") -> GenerationRequest:
    if isinstance(req.prompt, str):
        check_text_size(engine, len(req.prompt.strip()), "prompt")
        try:
            gen = engine.text_request(req.prompt, params, tenant)
        except ValueError as err:
            raise RequestError(str(err), param="prompt", code="invalid_value") from None
    else:
        if len(req.prompt) >= engine.max_context:
            raise RequestError(f"the prompt has {len(req.prompt)} tokens but the context is {engine.max_context} "
                               f"tokens (at least one token must be generated)", param="prompt",
                               code="context_length_exceeded")
        gen = GenerationRequest(prompt_ids=list(req.prompt), params=params, boundaries=[], tenant=tenant)
    gen.owner = owner
    check(engine, gen, "prompt")
    return gen


def check(engine, gen: GenerationRequest, prompt_param: str) -> None:
    try:
        engine.check_request(gen)
    except ContextLengthError as err:
        raise RequestError(str(err), param=prompt_param, code="context_length_exceeded") from None
    except ValueError as err:
        raise RequestError(str(err), param=getattr(err, "param", None), code="invalid_value") from None


async def read_json(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> dict:
    declared = request.headers.get("content-length")
    too_large = RequestError(f"request body is larger than {limit} bytes", status=413, code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout_s:g} s", status=408,
                           code="request_timeout") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    return parse_json(raw) if len(raw) <= PARSE_INLINE_BYTES else await run_in_threadpool(parse_json, raw)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:    # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    bad = find_unencodable(body)
    if bad is not None:
        raise RequestError(f"{bad or 'the body'}: the text holds a lone UTF-16 surrogate (not a Unicode "
                           f"character)", param=bad or None, code="invalid_unicode")
    return body


def find_unencodable(value, path: str = "") -> str | None:
    """The path of the first string (or key) that is not valid Unicode (a lone surrogate from a
    ``\\ud800`` JSON escape), else None. Iterative: nesting depth costs no stack."""
    todo = [(value, path)]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{where}.{k}" if where else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return where
                todo.append((item, sub))
        elif isinstance(v, list):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(v))
    return None


def parse(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise schemas.validation_error(err) from None


async def chat_generation(ctx, who, req: ChatCompletionRequest) -> GenerationRequest:
    """A validated chat request as the engine's GenerationRequest for the tenant ``who``: the
    sampling fields over the server's defaults, the template and tokenizer run off the event loop.
    Every API whose body maps onto chat messages (chat completions, responses) comes through here."""
    config = ctx.config
    params = sampling_params(req, config.defaults, ctx.engine.max_context, config.max_n)
    return await run_in_threadpool(build_chat_request, ctx.engine, req, params,
                                   tenant_key(who.tenant, req.cache_salt), who.tenant, config.max_messages)
