"""OpenAI-compatible HTTP API over one Engine (FastAPI + uvicorn).

The HTTP side validates and tokenizes (off the event loop), then hands a GenerationRequest to the
single engine worker (worker.py) and relays what comes back: one JSON body, or SSE chunks while
streaming. Every refusal is an OpenAI-style error body ``{"error": {message, type, param, code}}``
with a 4xx status, FastAPI's own 422 shape never reaches a client.

Isolation: the prompt cache namespaces snapshots by ``GenerationRequest.tenant``; the server sets
it to a hash of the API key a request authenticated with and its ``cache_salt``, so one tenant
never reuses (or can time) another's prefix.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import hashlib
import json
import secrets
import socket
import sys
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
from ..engine.sampling import SamplingParams
from . import schemas
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .schemas import (AUTHENTICATION, NOT_FOUND, RATE_LIMIT, SERVER_ERROR, ChatCompletionRequest, CompletionRequest,
                      RequestError, error_body)
from .worker import EngineWorker, Failed, Finished, Job

MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_S = 0.5       # how often a waiting non-streaming request checks its client is still there
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class ServerConfig:
    api_key: str | None = None
    defaults: SamplingParams = field(default_factory=SamplingParams)   # the CLI's sampling flags
    max_body_bytes: int = MAX_BODY_BYTES


# ------------------------------------------------------------------------- request -> engine


def tenant_key(api_key: str | None, cache_salt: str | None) -> str:
    """The prompt-cache namespace of a request: "" for the anonymous, salt-free tenant.

    Hashed so neither the key nor the salt is kept in the cache's memory or shown in its stats."""
    if not api_key and not cache_salt:
        return ""
    material = json.dumps({"api_key": api_key or "", "cache_salt": cache_salt or ""}, sort_keys=True)
    return hashlib.sha256(material.encode("utf-8")).hexdigest()[:32]


def sampling_params(req: ChatCompletionRequest | CompletionRequest, defaults: SamplingParams,
                    max_context: int) -> SamplingParams:
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
    )


def build_chat_request(engine, req: ChatCompletionRequest, params: SamplingParams, tenant: str) -> GenerationRequest:
    try:
        gen = engine.chat_request(req.template_messages(), params, tenant)
    except ValueError as err:
        raise RequestError(str(err), param="messages", code="invalid_value") from None
    check(engine, gen, "messages")
    return gen


def build_completion_request(engine, req: CompletionRequest, params: SamplingParams,
                             tenant: str) -> GenerationRequest:
    if isinstance(req.prompt, str):
        try:
            gen = engine.text_request(req.prompt, params, tenant)
        except ValueError as err:
            raise RequestError(str(err), param="prompt", code="invalid_value") from None
    else:
        gen = GenerationRequest(prompt_ids=list(req.prompt), params=params, boundaries=[], tenant=tenant)
    check(engine, gen, "prompt")
    return gen


def check(engine, gen: GenerationRequest, prompt_param: str) -> None:
    try:
        engine.check_request(gen)
    except ContextLengthError as err:
        raise RequestError(str(err), param=prompt_param, code="context_length_exceeded") from None
    except ValueError as err:
        raise RequestError(str(err), code="invalid_value") from None


# ------------------------------------------------------------------------------ HTTP helpers


def authorize(request: Request, api_key: str | None) -> str | None:
    """The API key the request authenticated with (None when the server has none)."""
    if api_key is None:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                           status=401, type=AUTHENTICATION, code="invalid_api_key")
    return api_key


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    too_large = RequestError(f"request body is larger than {limit} bytes", status=413, code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:    # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    return body


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


async def stream_events(job: Job, reply: Reply) -> AsyncIterator[str]:
    """SSE chunks of a job. Starlette cancels this generator when the client disconnects; the
    ``finally`` then cancels the generation (a no-op once it has finished)."""
    chat = reply.endpoint == CHAT
    head = (reply.rid, reply.created, reply.model)
    try:
        if chat:
            yield sse(schemas.chat_chunk(*head, {"role": "assistant", "content": ""},
                                         include_usage=reply.include_usage))
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                if not item.text:
                    continue
                chunk = (schemas.chat_chunk(*head, {"content": item.text}, include_usage=reply.include_usage)
                         if chat else schemas.text_chunk(*head, item.text, include_usage=reply.include_usage))
                yield sse(chunk)
            elif isinstance(item, Finished):
                result = item.result
                yield sse(schemas.chat_chunk(*head, {}, result.finish_reason, include_usage=reply.include_usage)
                          if chat else
                          schemas.text_chunk(*head, "", result.finish_reason, include_usage=reply.include_usage))
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
    as ``serve`` does on the main thread."""
    config = config or ServerConfig()
    config.defaults.validate()
    cache_enabled = engine.prompt_cache is not None and bool(engine.prompt_cache.enabled)
    metrics = ServerMetrics(engine.name, cache_enabled)
    worker = EngineWorker(engine, on_done=metrics.observe, own_thread=engine_thread)
    metrics.bind(worker.pending, lambda: store_stats(engine))
    started = int(time.time())

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
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", type=SERVER_ERROR),
                            status_code=500)

    # --- generation ------------------------------------------------------------------------------
    async def generate(request: Request, endpoint: str, gen: GenerationRequest, stream: bool,
                       include_usage: bool) -> Response:
        reply = Reply(endpoint, schemas.new_id("chatcmpl" if endpoint == CHAT else "cmpl"), schemas.now(),
                      engine.name, include_usage)
        try:
            job = worker.submit(gen, endpoint, stream_tokens=stream)
        except QueueFull as err:
            raise RequestError(f"{err}; retry shortly", status=429, type=RATE_LIMIT, code="queue_full",
                               headers={"Retry-After": "1"}) from None
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
        build = schemas.chat_completion if endpoint == CHAT else schemas.text_completion
        return JSONResponse(build(reply.rid, reply.created, reply.model, end.result, end.queue_ms))

    def wants_usage(req) -> bool:
        return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        key = authorize(request, config.api_key)
        req = parse(ChatCompletionRequest, await read_json(request, config.max_body_bytes))
        params = sampling_params(req, config.defaults, engine.max_context)
        gen = await run_in_threadpool(build_chat_request, engine, req, params, tenant_key(key, req.cache_salt))
        return await generate(request, CHAT, gen, req.stream, wants_usage(req))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        key = authorize(request, config.api_key)
        req = parse(CompletionRequest, await read_json(request, config.max_body_bytes))
        params = sampling_params(req, config.defaults, engine.max_context)
        gen = await run_in_threadpool(build_completion_request, engine, req, params,
                                      tenant_key(key, req.cache_salt))
        return await generate(request, COMPLETIONS, gen, req.stream, wants_usage(req))

    # --- the rest --------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request, config.api_key)
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": started,
                                            "owned_by": "turnkv", "max_model_len": engine.max_context}]}

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse(error_body("the engine worker is not running", type=SERVER_ERROR),
                                status_code=503)
        return {"status": "ok", "model": engine.name, "pending": worker.pending()}

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        authorize(request, config.api_key)
        return cache_stats_json(engine, store_stats(engine), cache_enabled)

    @app.delete("/v1/cache")
    async def flush_cache(request: Request):
        authorize(request, config.api_key)
        before = store_stats(engine)
        if engine.prompt_cache is not None:
            # the store has its own lock: no need to wait behind queued generations, and a
            # generation running now just finds nothing to reuse on its next lookup
            engine.prompt_cache.clear()
        return {"flushed": True, "entries_removed": before.get("entries", 0),
                "bytes_freed": before.get("bytes", 0),
                "stats": cache_stats_json(engine, store_stats(engine), cache_enabled)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def store_stats(engine) -> dict:
    # PromptCache.stats() takes the store's lock, so it is safe beside the engine thread
    return dict(engine.prompt_cache.stats()) if engine.prompt_cache is not None else {}


def cache_stats_json(engine, stats: dict, enabled: bool) -> dict:
    """The store's stats plus what the store cannot know: which KV mode each layer really uses."""
    counts: dict[str, int] = {}
    for spec, mode in zip(engine.specs, engine.modes):
        if spec.is_attention:
            counts[mode] = counts.get(mode, 0) + 1
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
        # the engine's live state slots (not counted in the budget) and its load right now
        "live_bytes": engine.live_bytes,
        "running": len(engine.scheduler.running),
        "waiting": engine.pending() - len(engine.scheduler.running),
        "max_seqs": engine.scheduler.max_seqs,
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
    with sock:
        engine = engine_from(args)
        print_banner(engine, args.cache_budget_mb, args.prompt_cache)
        app = create_app(engine, ServerConfig(api_key=args.api_key, defaults=defaults), engine_thread=False)
        url = address(sock)
        print(f"turnkv: serving {engine.name} at {url} (OpenAI base URL {url}/v1"
              f"{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
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

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, shut_down)
        thread = threading.Thread(target=http, name="turnkv-http")
        thread.start()
        app.state.worker.run(stop)
        server.should_exit = True
        thread.join(10)
    return 0
