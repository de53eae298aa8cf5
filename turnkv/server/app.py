"""OpenAI-compatible HTTP API over one Engine (FastAPI + uvicorn).

The HTTP side validates and tokenizes (off the event loop), then hands a GenerationRequest to the
single engine worker (worker.py) and relays what comes back: one JSON body, or SSE chunks while
streaming. Every refusal is an OpenAI-style error body ``{"error": {message, type, param, code}}``
with a 4xx status, FastAPI's own 422 shape never reaches a client.

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

import asyncio
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import ContextLengthError, GenerationRequest, QueueFull, TokenEvent
from ..engine.sampling import ParamError, SamplingParams
from . import logprobs as lp_format
from . import chat_extras, schemas
from .. import web
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .schemas import (AUTHENTICATION, NOT_FOUND, RATE_LIMIT, SERVER_ERROR, ChatCompletionRequest, CompletionRequest,
                      RequestError, content_chars, error_body)
from .slow_client_guard import GuardedH11
from .tenants import KeyRing, Principal, tenant_key
from .tools import chatml_tools_for
from .worker import ChoiceEnd, EngineWorker, Failed, Finished, Job, WorkerDown

MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_S = 0.5       # how often a waiting non-streaming request checks its client is still there
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_N = 16
DEFAULT_MAX_CONNECTIONS = 1024
BODY_TIMEOUT_S = 30.0         # a client has this long to send a body (headers: protocol.GuardedH11)
PARSE_INLINE_BYTES = 64 * 1024    # bodies above this are parsed on a worker thread, not the event loop
log = logging.getLogger("turnkv.server")


@dataclass
class ServerConfig:
    keys: KeyRing = field(default_factory=KeyRing)
    defaults: SamplingParams = field(default_factory=SamplingParams)   # the CLI's sampling flags
    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    request_timeout_s: float | None = None     # None: no deadline
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = DEFAULT_MAX_N                 # choices per request (--max-n)


# ------------------------------------------------------------------------- request -> engine


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
    before the template or the tokenizer spend time on it. Computed once per engine."""
    cached = getattr(engine, "_max_token_chars", None)
    if cached is None:
        vocab = engine.tokenizer.backend.get_vocab() if engine.tokenizer is not None else {}
        cached = max((len(t) for t in vocab), default=64)
        engine._max_token_chars = cached
    return cached


def warm_up(engine) -> None:
    """What the first request would otherwise pay once, done before the server accepts one:
    the vocabulary scan of ``max_token_chars`` (~0.5 s for Gemma 3's 262k entries) and the import
    of anyio's thread-pool backend (starlette runs sync endpoints through it). Measured on the
    Zen 3 VM: Gemma 3's first request took 640 ms more than its prefill, later ones ~60 ms."""
    import importlib

    max_token_chars(engine)
    try:     # a private module: only a head start, so a renamed one must not stop the server
        importlib.import_module("anyio._backends._asyncio")
    except ImportError:
        pass


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


# ------------------------------------------------------------------------------ HTTP helpers


def authorize(request: Request, keys: KeyRing) -> Principal:
    """Who sent the request (the anonymous admin when the server has no keys); 401 otherwise."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    principal = keys.identify(token.strip() if scheme.lower() == "bearer" else None)
    if principal is None:
        raise RequestError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                           status=401, type=AUTHENTICATION, code="invalid_api_key")
    return principal


def require_admin(principal: Principal, what: str) -> None:
    if not principal.admin:
        raise RequestError(f"{what} needs the admin key (--admin-key)", status=403, type="permission_error",
                           code="admin_required")


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


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def failure(err: BaseException) -> RequestError:
    """A generation that failed inside the engine: requests are validated before they are queued,
    so this is an internal fault (logged by the engine), never the client's."""
    return RequestError("internal error: the generation failed (see the server log)", status=500,
                        type=SERVER_ERROR)


def timed_out(timeout_s: float | None) -> RequestError:
    return RequestError(f"the request did not finish within the server's request timeout "
                        f"({timeout_s:g} s, --request-timeout)", status=408, code="request_timeout")


async def wait_end(job: Job, request: Request) -> Finished | Failed | None:
    """The job's end; None (and the job cancelled) when the client went away first."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None
                continue
            if isinstance(item, (Finished, Failed)):
                return item
    except BaseException:
        job.cancel()
        raise


@dataclass
class Reply:
    """What one response needs to name itself."""

    endpoint: str
    rid: str
    created: int
    model: str
    include_usage: bool
    timeout_s: float | None = None
    n: int = 1                       # choices
    names: lp_format.TokenText | None = None   # set when the request asked for logprobs
    tool_format: str | None = None   # chat: parse tool calls out of the reply (server/tools.py)

    def logprobs(self, entries: list, offset: int = 0) -> dict | None:
        """One choice's logprobs in this endpoint's shape (None when not asked for)."""
        if self.names is None:
            return None
        if self.endpoint == CHAT:
            return lp_format.chat_logprobs(entries, self.names)
        return lp_format.completion_logprobs(entries, self.names, offset)


async def stream_events(job: Job, reply: Reply) -> AsyncIterator[str]:
    """SSE chunks of a job. Starlette cancels this generator when the client disconnects; the
    ``finally`` then cancels the generation (a no-op once it has finished)."""
    chat = reply.endpoint == CHAT
    head = (reply.rid, reply.created, reply.model)
    pending: dict[int, list] = {}     # per choice: logprobs of tokens whose text is not out yet
    offsets: dict[int, int] = {}      # completions: each choice's text_offset so far
    ended: set[int] = set()
    tool_stream = chat_extras.ToolStream(reply.tool_format) if chat and reply.tool_format else None

    def logprobs(index: int) -> dict | None:
        entries = pending.pop(index, [])
        if not entries:
            return None
        start = offsets.get(index, 0)
        if not chat:
            offsets[index] = start + lp_format.text_length(entries, reply.names)
        return reply.logprobs(entries, start)

    def piece(index: int, text: str, finish_reason: str | None = None) -> str:
        lp = logprobs(index)
        if chat:
            delta = {"content": text} if finish_reason is None else {}
            return sse(schemas.chat_chunk(*head, delta, finish_reason, include_usage=reply.include_usage,
                                          index=index, logprobs=lp))
        return sse(schemas.text_chunk(*head, text, finish_reason, include_usage=reply.include_usage,
                                      index=index, logprobs=lp))

    def last_pieces(index: int, finish_reason: str) -> list[str]:
        out = []
        if tool_stream is not None:      # the held-back text: tool calls, or content after all
            rest, calls = tool_stream.end(index)
            if rest:
                out.append(piece(index, rest))
            if calls:
                out.append(sse(schemas.chat_chunk(*head, {"tool_calls": calls}, include_usage=reply.include_usage,
                                                  index=index)))
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return out + [piece(index, "", finish_reason)]

    try:
        if chat:
            for index in range(reply.n):
                yield sse(schemas.chat_chunk(*head, {"role": "assistant", "content": ""},
                                             include_usage=reply.include_usage, index=index))
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                if item.logprob is not None:
                    pending.setdefault(item.index, []).append(item.logprob)
                text = tool_stream.content(item.index, item.text) if tool_stream is not None else item.text
                if not text:
                    continue
                yield piece(item.index, text)
            elif isinstance(item, ChoiceEnd):
                if item.result.finish_reason != "timeout":
                    ended.add(item.result.index)
                    for chunk in last_pieces(item.result.index, item.result.finish_reason):
                        yield chunk
            elif isinstance(item, Finished) and item.result.finish_reason == "timeout":
                yield sse(timed_out(reply.timeout_s).body())
                break
            elif isinstance(item, Finished):
                result = item.result
                for r in item.results:
                    if r.index not in ended:
                        for chunk in last_pieces(r.index, r.finish_reason):
                            yield chunk
                if reply.include_usage:
                    yield sse(schemas.usage_chunk(*head, "chat.completion.chunk" if chat else "text_completion",
                                                  result, item.queue_ms))
                break
            elif isinstance(item, Failed):
                yield sse(failure(item.error).body())
                break
        yield sse("[DONE]")
    finally:
        job.cancel()


# ---------------------------------------------------------------------------------------- app


def create_app(engine, config: ServerConfig | None = None, engine_thread: bool = True) -> FastAPI:
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
                 lambda: memory_stats(engine, store_stats(engine).get("bytes", 0)), lambda: worker.restarts)
    started = int(time.time())
    token_names = lp_format.TokenText(engine.tokenizer)     # logprobs name tokens through this cache

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="turnkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics

    # --- errors: always the OpenAI shape ---------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        if request.url.path in (CHAT, COMPLETIONS):
            metrics.rejected(request.url.path)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = NOT_FOUND if err.status_code == 404 else schemas.INVALID_REQUEST
        message = f"{request.method} {request.url.path}: {err.detail}"
        return JSONResponse(error_body(message, type=kind), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(error_body(str(err)), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, err: Exception):
        # an internal fault: the log has the traceback, the client a message that leaks nothing
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=err)
        return JSONResponse(error_body("internal error (see the server log)", type=SERVER_ERROR),
                            status_code=500)

    # --- generation ------------------------------------------------------------------------------
    async def generate(request: Request, endpoint: str, gen: GenerationRequest, stream: bool,
                       include_usage: bool, tool_format: str | None = None) -> Response:
        reply = Reply(endpoint, schemas.new_id("chatcmpl" if endpoint == CHAT else "cmpl"), schemas.now(),
                      engine.name, include_usage, config.request_timeout_s, n=gen.params.n, tool_format=tool_format,
                      names=token_names if gen.params.logprobs is not None else None)
        gen.timeout_s = config.request_timeout_s
        try:
            job = worker.submit(gen, endpoint, stream_tokens=stream)
        except QueueFull as err:
            raise RequestError(f"{err}; retry shortly", status=429, type=RATE_LIMIT, code="queue_full",
                               headers={"Retry-After": "1"}) from None
        except WorkerDown as err:
            raise RequestError(str(err), status=503, type=SERVER_ERROR, code="engine_down",
                               headers={"Retry-After": "5"}) from None
        except ContextLengthError as err:
            raise RequestError(str(err), code="context_length_exceeded") from None
        except ValueError as err:
            raise RequestError(str(err), code="invalid_value") from None
        if stream:
            return StreamingResponse(stream_events(job, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        end = await wait_end(job, request)
        if end is None:
            return Response(status_code=499)     # nginx's "client closed request": nobody reads it
        if isinstance(end, Failed):
            err = failure(end.error)
            return JSONResponse(err.body(), status_code=err.status)
        if end.result.finish_reason == "timeout":
            err = timed_out(config.request_timeout_s)
            return JSONResponse(err.body(), status_code=err.status)
        build = schemas.chat_completion if endpoint == CHAT else schemas.text_completion
        logprobs = [reply.logprobs(r.logprobs) for r in end.results] if reply.names is not None else None
        body = build(reply.rid, reply.created, reply.model, end.result, end.queue_ms,
                     results=end.results, logprobs=logprobs)
        return JSONResponse(chat_extras.apply_tool_calls(body, reply.tool_format) if endpoint == CHAT else body)

    def wants_usage(req) -> bool:
        return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        who = authorize(request, config.keys)
        req = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        params = sampling_params(req, config.defaults, engine.max_context, config.max_n)
        gen = await run_in_threadpool(build_chat_request, engine, req, params, tenant_key(who.tenant, req.cache_salt),
                                      who.tenant, config.max_messages)
        return await generate(request, CHAT, gen, req.stream, wants_usage(req), chat_extras.tool_format(engine, req))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        who = authorize(request, config.keys)
        req = parse(CompletionRequest, await read_json(request, config.max_body_bytes, config.body_timeout_s))
        params = sampling_params(req, config.defaults, engine.max_context, config.max_n)
        gen = await run_in_threadpool(build_completion_request, engine, req, params,
                                      tenant_key(who.tenant, req.cache_salt), who.tenant)
        return await generate(request, COMPLETIONS, gen, req.stream, wants_usage(req))

    # --- the rest --------------------------------------------------------------------------------
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

    @app.get("/")
    async def web_page():
        return await web_asset("index.html")

    @app.get("/web/{name}")
    async def web_asset(name: str):
        found = web.asset(name)
        if found is None:
            raise RequestError(f"GET /web/{name}: no such file", status=404, type=NOT_FOUND, code="not_found")
        return Response(found[0], media_type=found[1], headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def prometheus(request: Request):
        if config.keys.configured:
            require_admin(authorize(request, config.keys), "/metrics on a server with API keys")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def store_stats(engine, owner: str | None = None) -> dict:
    # PromptCache.stats() takes the store's lock, so it is safe beside the engine thread
    out = dict(engine.prompt_cache.stats(owner)) if engine.prompt_cache is not None else {}
    if owner is None and getattr(engine, "encoder_cache", None) is not None:
        out["images"] = engine.encoder_cache.stats()     # the image encoder cache (docs/images.md)
    return out


def memory_stats(engine, cache_bytes: int) -> dict:
    """Where the process's memory goes: the KV blocks and recurrent state live sequences hold, the
    prompt cache's blocks (the two overlap where they share blocks), everything the KV block
    pools have allocated (live, stored and free blocks), and the RSS beside them."""
    import psutil
    try:
        live = engine.live_bytes
    except RuntimeError:         # a slot changed under us (the engine thread): report 0 this time
        live = 0
    return {"live_state_bytes": live, "prompt_cache_bytes": cache_bytes, "kv_pool_bytes": engine.pool.pool_bytes,
            "rss_bytes": psutil.Process().memory_info().rss}


def cache_stats_json(engine, stats: dict, enabled: bool, global_view: bool = True, worker=None) -> dict:
    """The store's stats plus what the store cannot know: which KV mode each layer really uses.
    A tenant's view (``global_view`` False) holds its own counters and nothing of others' load."""
    counts: dict[str, int] = {}
    for spec, mode in zip(engine.specs, engine.modes):
        if spec.is_attention:
            counts[mode] = counts.get(mode, 0) + 1
    load = {}
    if global_view:
        load = {
            # the engine's live state slots (not counted in the budget) and its load right now
            "live_bytes": engine.live_bytes,
            "running": len(engine.scheduler.running),
            "waiting": engine.pending() - len(engine.scheduler.running),
            "max_seqs": engine.scheduler.max_seqs,
            "memory": memory_stats(engine, stats.get("bytes", 0)),
            "engine_restarts": worker.restarts if worker is not None else 0,
        }
    return {
        **stats,
        "model": engine.name,
        "prompt_cache_enabled": enabled,
        "weights": engine.weights,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_mode": engine.kv_mode,
        "kv_cache_mode_effective": list(engine.modes),
        "kv_cache_mode_attention_layers": counts,
        "layers": [spec.describe() for spec in engine.specs],
        **load,
    }


# -------------------------------------------------------------------------------------- serve


def listen_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before the model loads: a port in use fails at once, and the address
    printed is the real one (``--port 0`` picks a free port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def serve(args) -> int:
    import uvicorn

    from ..launch import engine_from, print_banner, sampling_from

    defaults = sampling_from(args)
    defaults.validate()
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as err:
        print(f"turnkv: error: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 2
    for name, value, low in (("--request-timeout", args.request_timeout, 0), ("--max-messages", args.max_messages, 0),
                             ("--max-connections", args.max_connections, 0), ("--tenant-budget-mb", args.tenant_budget_mb, -1),
                             ("--header-timeout", args.header_timeout, 0), ("--body-timeout", args.body_timeout, 0),
                             ("--max-n", args.max_n, 0)):
        if value is not None and value <= low:
            raise ValueError(f"{name} must be {'>= 0' if low < 0 else '> 0'}, got {value}")
    with sock:
        keys = KeyRing(args.api_key, args.api_keys, args.admin_key)    # a bad key file fails before the load
        engine = engine_from(args)
        if not args.chat_template:   # a ChatML template without tools: the shipped one that renders alike
            engine.tokenizer = chatml_tools_for(engine.tokenizer) or engine.tokenizer
        print_banner(engine, args.cache_budget_mb, args.prompt_cache)
        config = ServerConfig(keys=keys, defaults=defaults, max_messages=args.max_messages, max_n=args.max_n,
                              request_timeout_s=args.request_timeout, body_timeout_s=args.body_timeout)
        protocol = type("GuardedH11", (GuardedH11,), {"header_timeout_s": args.header_timeout})
        app = create_app(engine, config, engine_thread=False)
        warm_up(engine)
        url = address(sock)
        print(f"turnkv: serving {engine.name} at {url} (OpenAI base URL {url}/v1"
              f"{', API key required' if keys.configured else ''})", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5, http=protocol,
                                               limit_concurrency=args.max_connections, timeout_keep_alive=5))
        # The engine steps on the main thread, which loaded the model: a second thread running
        # OpenMP work would start a second team beside the main thread's, and with more OpenMP
        # threads than cores libgomp stops spinning between parallel regions (each kernel call
        # then waits on a futex wake-up): measured 2x slower decode. HTTP runs on its own thread.
        stop = threading.Event()

        def http() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                stop.set()

        def shut_down(signum, frame) -> None:
            server.should_exit = True
            stop.set()

        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda signum, frame: keys.reload_quietly())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, shut_down)
        thread = threading.Thread(target=http, name="turnkv-http")
        thread.start()
        app.state.worker.run(stop)
        server.should_exit = True
        thread.join(10)
    return 0
