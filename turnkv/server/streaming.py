"""Server-sent events: a job's tokens as OpenAI stream chunks (``stream_events``), and what a
reply needs to name itself (``Reply``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from ..engine.engine import TokenEvent
from . import chat_extras, schemas
from . import logprobs as lp_format
from .schemas import SERVER_ERROR, RequestError
from .worker import ChoiceEnd, Failed, Finished, Job

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
DISCONNECT_POLL_S = 0.5       # how often a waiting non-streaming request checks its client is still there


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
    tool_forced: list[str] | None = None   # a grammar forces calls to these functions (StreamParser)

    def logprobs(self, entries: list, offset: int = 0) -> dict | None:
        """One choice's logprobs in this endpoint's shape (None when not asked for)."""
        if self.names is None:
            return None
        if self.endpoint == CHAT:
            return lp_format.chat_logprobs(entries, self.names)
        return lp_format.completion_logprobs(entries, self.names, offset)


class _Chunks:
    """The SSE chunks of one job's events: each choice's text, the logprobs of tokens whose text
    is not out yet and (chat with tools) the text held back until it is known not to be a call."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.chat = reply.endpoint == CHAT
        self.head = (reply.rid, reply.created, reply.model)
        self.pending: dict[int, list] = {}     # per choice: logprobs of tokens whose text is not out yet
        self.offsets: dict[int, int] = {}      # completions: each choice's text_offset so far
        self.ended: set[int] = set()
        self.tool_stream = chat_extras.ToolStream(reply.tool_format, reply.tool_forced) if self.chat and reply.tool_format else None

    def opening(self) -> list[str]:
        if not self.chat:
            return []
        return [sse(schemas.chat_chunk(*self.head, {"role": "assistant", "content": ""},
                                       include_usage=self.reply.include_usage, index=index))
                for index in range(self.reply.n)]

    def logprobs(self, index: int) -> dict | None:
        entries = self.pending.pop(index, [])
        if not entries:
            return None
        start = self.offsets.get(index, 0)
        if not self.chat:
            self.offsets[index] = start + lp_format.text_length(entries, self.reply.names)
        return self.reply.logprobs(entries, start)

    def piece(self, index: int, text: str, finish_reason: str | None = None) -> str:
        lp = self.logprobs(index)
        if self.chat:
            delta = {"content": text} if finish_reason is None else {}
            return sse(schemas.chat_chunk(*self.head, delta, finish_reason, include_usage=self.reply.include_usage,
                                          index=index, logprobs=lp))
        return sse(schemas.text_chunk(*self.head, text, finish_reason, include_usage=self.reply.include_usage,
                                      index=index, logprobs=lp))

    def last_pieces(self, index: int, finish_reason: str) -> list[str]:
        out = []
        if self.tool_stream is not None:      # the held-back text: tool calls, or content after all
            rest, calls = self.tool_stream.end(index)
            if rest:
                out.append(self.piece(index, rest))
            if calls:
                out.append(sse(schemas.chat_chunk(*self.head, {"tool_calls": calls},
                                                  include_usage=self.reply.include_usage, index=index)))
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return out + [self.piece(index, "", finish_reason)]

    def token(self, item: TokenEvent) -> list[str]:
        if item.logprob is not None:
            self.pending.setdefault(item.index, []).append(item.logprob)
        if self.tool_stream is None:
            return [self.piece(item.index, item.text)] if item.text else []
        text = self.tool_stream.content(item.index, item.text)
        out = [self.piece(item.index, text)] if text else []
        heads = self.tool_stream.opened(item.index)
        if heads:
            out.append(sse(schemas.chat_chunk(*self.head, {"tool_calls": heads},
                                              include_usage=self.reply.include_usage, index=item.index)))
        return out

    def choice_end(self, item: ChoiceEnd) -> list[str]:
        if item.result.finish_reason == "timeout":
            return []
        self.ended.add(item.result.index)
        return self.last_pieces(item.result.index, item.result.finish_reason)

    def finished(self, item: Finished) -> list[str]:
        if item.result.finish_reason == "timeout":
            return [sse(timed_out(self.reply.timeout_s).body())]
        out = []
        for r in item.results:
            if r.index not in self.ended:
                out += self.last_pieces(r.index, r.finish_reason)
        if self.reply.include_usage:
            out.append(sse(schemas.usage_chunk(*self.head, "chat.completion.chunk" if self.chat else "text_completion",
                                               item.result, item.queue_ms)))
        return out


async def stream_events(job: Job, reply: Reply) -> AsyncIterator[str]:
    """SSE chunks of a job. Starlette cancels this generator when the client disconnects; the
    ``finally`` then cancels the generation (a no-op once it has finished)."""
    chunks = _Chunks(reply)
    try:
        for chunk in chunks.opening():
            yield chunk
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                out = chunks.token(item)
            elif isinstance(item, ChoiceEnd):
                out = chunks.choice_end(item)
            elif isinstance(item, Finished):
                out = chunks.finished(item)
            elif isinstance(item, Failed):
                out = [sse(failure(item.error).body())]
            else:
                continue
            for chunk in out:
                yield chunk
            if isinstance(item, (Finished, Failed)):
                break
        yield sse("[DONE]")
    finally:
        job.cancel()
