"""A validated request's way through the engine worker: queued (or refused with the reason), then
answered as a stream of SSE chunks or as one JSON body once it ends."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.engine import ContextLengthError, GenerationRequest, QueueFull
from . import chat_extras, schemas
from .context import ServerContext
from .schemas import RATE_LIMIT, SERVER_ERROR, RequestError
from .streaming import CHAT, Reply, failure, stream_events, timed_out, wait_end
from .worker import Failed, Finished, Job, WorkerDown


async def generate(ctx: ServerContext, request: Request, endpoint: str, gen: GenerationRequest, stream: bool,
                   include_usage: bool, tool_format: str | None = None,
                   tool_forced: list[str] | None = None) -> Response:
    reply = Reply(endpoint, schemas.new_id("chatcmpl" if endpoint == CHAT else "cmpl"), schemas.now(),
                  ctx.engine.name, include_usage, ctx.config.request_timeout_s, n=gen.params.n, tool_format=tool_format,
                  tool_forced=tool_forced, names=ctx.token_names if gen.params.logprobs is not None else None)
    job = submit(ctx, gen, endpoint, stream)
    if stream:
        return event_stream(stream_events(job, reply))
    end = await ended(ctx, request, job)
    if isinstance(end, Response):
        return end
    build = schemas.chat_completion if endpoint == CHAT else schemas.text_completion
    logprobs = [reply.logprobs(r.logprobs) for r in end.results] if reply.names is not None else None
    body = build(reply.rid, reply.created, reply.model, end.result, end.queue_ms,
                 results=end.results, logprobs=logprobs)
    return JSONResponse(chat_extras.apply_tool_calls(body, reply.tool_format) if endpoint == CHAT else body)


def submit(ctx: ServerContext, gen: GenerationRequest, endpoint: str, stream: bool) -> Job:
    """Queue ``gen`` with the engine worker; a refusal is a RequestError (429, 503 or 400)."""
    gen.timeout_s = ctx.config.request_timeout_s
    try:
        return ctx.worker.submit(gen, endpoint, stream_tokens=stream)
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


async def ended(ctx: ServerContext, request: Request, job: Job,
                error_body: Callable[[RequestError], dict] = RequestError.body) -> Finished | Response:
    """A non-streamed job's end, or the response that replaces the reply: 499 when the client
    went away, the error (in the shape ``error_body`` gives it) when the generation failed or ran
    out of time."""
    end = await wait_end(job, request)
    if end is None:
        return Response(status_code=499)     # nginx's "client closed request": nobody reads it
    if isinstance(end, Failed):
        err = failure(end.error)
        return JSONResponse(error_body(err), status_code=err.status)
    if end.result.finish_reason == "timeout":
        err = timed_out(ctx.config.request_timeout_s)
        return JSONResponse(error_body(err), status_code=err.status)
    return end


def event_stream(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def wants_usage(req) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
