"""What ``POST /v1/responses`` answers: the response object (output items: an assistant message,
then one ``function_call`` item per call), whole or as the Responses API's stream of typed events
with sequence numbers, and the stored conversation that ``previous_response_id`` continues."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..engine.engine import TokenEvent
from ..engine.sampling import SamplingParams
from . import tools as toolkit
from .response_store import ResponseStore
from .responses_input import ResponsesRequest
from .schemas import RequestError
from .streaming import failure, timed_out
from .worker import Failed, Finished, Job


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def assistant_message(content: str | None, calls: list[dict]) -> dict:
    """The reply as a chat history message: what an explicit-history request converts its output
    items back to, so both render the same tokens."""
    msg = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = calls
    return msg


@dataclass
class Turn:
    """One response in the making: what its body echoes of the request, and where it is kept."""

    rid: str
    created: int
    model: str
    req: ResponsesRequest
    params: SamplingParams
    tool_format: str | None
    tool_forced: list[str] | None       # a grammar forces calls to these functions (StreamParser)
    conversation: list[dict]            # the messages the reply follows (instructions excluded)
    store: ResponseStore | None         # None: store false
    tenant: str
    timeout_s: float | None = None

    def body(self, status: str, output: list[dict], result=None) -> dict:
        req, incomplete = self.req, None
        if result is not None and result.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": req.store, "temperature": self.params.temperature, "top_p": self.params.top_p,
                "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
                "usage": usage_json(result.usage) if result is not None else None, "metadata": req.metadata or {},
                "user": req.user}

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole reply, as the stream splits it."""
        return toolkit.parse(text, self.tool_format) if self.tool_format else (text, [])

    def complete(self, content: str | None, calls: list[dict], result, mid: str | None = None,
                 output: list[dict] | None = None) -> dict:
        """The finished response's body (and it stored, when asked); ``output``: its items as they
        were streamed, when not the reply's (content, calls) (a forced call cut short)."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        if output is None:
            output = [] if content is None else [message_item(mid or new_id("msg"), content, status)]
            output += [call_item(c) for c in calls]
        body = self.body(status, output, result)
        if self.store is not None:
            self.store.put(self.tenant, body, [*self.conversation, assistant_message(content, calls)])
        return body


class _Events:
    """The typed SSE events of one response: content streams as ``output_text`` deltas of one
    message item (opened at the first non-blank text, so a call preceded only by blank text has no
    message, as in the whole reply); calls, known once complete, follow as ``function_call`` items.
    A call the grammar forces opens its item as soon as its name is known (the first token, when
    only one function is allowed), and its arguments stream as ``function_call_arguments`` deltas."""

    def __init__(self, turn: Turn):
        self.turn, self.seq, self.mid = turn, 0, new_id("msg")
        self.parser = toolkit.StreamParser(turn.tool_format, turn.tool_forced) if turn.tool_format else None
        self.held = ""              # leading blank text: a message only if no call follows
        self.text: str | None = None
        self.raw = ""               # the reply's text (forced calls: what is stored)
        self.live: list[dict] = []  # function_call items opened while streaming (forced calls)
        self.closed: set[int] = set()

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        body = self.turn.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def open_message(self) -> list[str]:
        self.text = ""
        return [self.event("response.output_item.added", output_index=0,
                           item=message_item(self.mid, None, "in_progress")),
                self.event("response.content_part.added", item_id=self.mid, output_index=0, content_index=0,
                           part=text_part(""))]

    def content(self, text: str, force: bool = False) -> list[str]:
        out = []
        if self.text is None:
            self.held += text
            if not self.held.strip() and not force:
                return []
            text, self.held = self.held, ""
            out = self.open_message()
        self.text += text
        if text:
            out.append(self.event("response.output_text.delta", item_id=self.mid, output_index=0, content_index=0,
                                  delta=text, logprobs=[]))
        return out

    def token(self, text: str) -> list[str]:
        self.raw += text
        if self.parser is None:
            return self.content(text) if text else []
        text = self.parser.push(text)
        out = self.content(text) if text else []
        if self.parser.forced is None:
            return out
        for head in self.parser.opened():
            self.live.append(call_item(head, "in_progress"))
            out.append(self.event("response.output_item.added", output_index=self.at(len(self.live) - 1),
                                  item=dict(self.live[-1])))
        for i, piece, whole in self.parser.arguments():
            out += self.arguments(i, piece)
            if whole:
                out += self.close_call(i, "completed")
        return out

    def at(self, index: int) -> int:
        """The output_index of the reply's ``index``-th call."""
        return index + (self.text is not None)

    def arguments(self, index: int, piece: str) -> list[str]:
        if not piece:
            return []
        item = self.live[index]
        item["arguments"] += piece
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self.at(index), delta=piece)]

    def close_call(self, index: int, status: str) -> list[str]:
        self.closed.add(index)
        item = self.live[index]
        item["status"] = status
        return [self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=self.at(index), arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=self.at(index), item=dict(item))]

    def close_message(self, status: str) -> list[str]:
        text = self.text or ""
        return [self.event("response.output_text.done", item_id=self.mid, output_index=0, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.mid, output_index=0, content_index=0,
                           part=text_part(text)),
                self.event("response.output_item.done", output_index=0, item=message_item(self.mid, text, status))]

    def call(self, index: int, call: dict) -> list[str]:
        item = call_item(call)
        fields = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index,
                           item=call_item(call, "in_progress", arguments="")),
                self.event("response.function_call_arguments.delta", **fields, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **fields, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def finished(self, result) -> list[str]:
        if result.finish_reason == "timeout":
            return [self.error(timed_out(self.turn.timeout_s))]
        rest, deltas = self.parser.finish() if self.parser is not None else ("", [])
        if self.live:
            return self.finished_live(result, deltas)
        calls = [{k: v for k, v in d.items() if k != "index"} for d in deltas]
        out = self.content(rest, force=not calls)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        if self.text is not None:
            out += self.close_message(status)
        first = 0 if self.text is None else 1
        for i, call in enumerate(calls):
            out += self.call(first + i, call)
        body = self.turn.complete(self.text, calls, result, self.mid)
        return out + [self.event(f"response.{status}", response=body)]

    def finished_live(self, result, deltas: list[dict]) -> list[str]:
        """The end of a reply whose forced calls opened while streaming: their arguments not sent
        yet, their items closed, any later call whole. What is stored is what the whole reply stores."""
        out, later = [], []
        for d in deltas:
            if d["index"] < len(self.live):
                out += self.arguments(d["index"], d["function"]["arguments"])
            else:
                later.append({k: v for k, v in d.items() if k != "index"})
        status = "incomplete" if result.finish_reason == "length" else "completed"
        for i in range(len(self.live)):
            if i not in self.closed:
                out += self.close_call(i, status)
        for call in later:
            out += self.call(self.at(len(self.live)), call)
            self.live.append(call_item(call))
        calls = self.parser.calls
        body = self.turn.complete(None if calls else self.raw, calls, result, self.mid, output=self.live)
        return out + [self.event(f"response.{status}", response=body)]

    def error(self, err: RequestError) -> str:
        return self.event("error", code=err.code or err.type, message=err.message, param=err.param)


async def stream_response(job: Job, turn: Turn) -> AsyncIterator[str]:
    """The job's events as the Responses API's stream. Starlette cancels this generator when the
    client disconnects; the ``finally`` then cancels the generation."""
    events = _Events(turn)
    try:
        for chunk in events.opening():
            yield chunk
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                out = events.token(item.text)
            elif isinstance(item, Finished):
                out = events.finished(item.result)
            elif isinstance(item, Failed):
                out = [events.error(failure(item.error))]
            else:
                continue
            for chunk in out:
                yield chunk
            if isinstance(item, (Finished, Failed)):
                break
    finally:
        job.cancel()
