"""Anthropic's Messages API over the chat path: a ``/v1/messages`` body becomes the chat request
it means (system turn, messages with images, tool calls and tool results, tools, tool_choice,
stop_sequences), so rendering, tools, grammars, reuse and tenants are the chat path's own; the
reply goes back as Anthropic content blocks, stop_reason and usage, errors in Anthropic's shape.

Usage: ``cache_read_input_tokens`` is the prompt turnkv restored from its cache (the chat API's
``cached_tokens``), ``input_tokens`` the rest, which turnkv prefilled. turnkv keeps every prefix
without a write premium or a ``cache_control`` breakpoint, so ``cache_creation_input_tokens`` is
always 0 and ``input_tokens + cache_read_input_tokens`` is the whole prompt (what count_tokens says).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from ..engine.engine import TokenEvent
from . import tools as toolkit
from .schemas import RequestError, _Strict
from .streaming import failure, timed_out
from .worker import Failed, Finished, Job

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
# Anthropic's error types by HTTP status (a 5xx is api_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES or path.startswith(MESSAGES + "/")


def error_json(err: RequestError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


class CountTokensRequest(_Strict):
    model: StrictStr | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_salt: StrictStr | None = Field(None, max_length=1024)    # turnkv's extension, as in chat

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(..., ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None     # its format (a JSON schema) constrains the reply


# ----------------------------------------------------------------------------- requests


def chat_body(req: CountTokensRequest) -> dict:
    """The chat-completions body that asks what ``req`` asks (parsed by ChatCompletionRequest)."""
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise _bad("thinking is not supported: the served model answers without extended thinking", "thinking")
    body: dict[str, Any] = {"messages": template_messages(req), "max_tokens": getattr(req, "max_tokens", 1)}
    for name in ("temperature", "top_p", "top_k", "stream", "cache_salt"):
        value = getattr(req, name, None)
        if value is not None:
            body[name] = value
    if getattr(req, "stop_sequences", None):
        body["stop"] = req.stop_sequences
    if req.tools is not None:
        body["tools"] = [chat_tool(i, t) for i, t in enumerate(req.tools)]
    output_format = (getattr(req, "output_config", None) or {}).get("format")
    if output_format is not None:
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise _bad('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": output_format.get("schema")}}
    if req.tool_choice is not None:
        body["tool_choice"], parallel = chat_tool_choice(req.tool_choice)
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    return body


def chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type", "custom") != "custom":
        raise _bad(f"tools[{i}]: server tools ({tool.get('type')!r}) are not supported; define a client tool "
                   f"with name, description and input_schema", "tools")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise _bad(f"tools[{i}].name must be a non-empty string", "tools")
    if not isinstance(schema, dict):
        raise _bad(f"tools[{i}].input_schema must be a JSON schema object", "tools")
    fn = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: dict) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls or None for the chat default of one forced call)."""
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
               '{"type": "tool", "name": ...}', "tool_choice")


def system_text(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in system):
        return "\n".join(b["text"] for b in system) or None
    raise _bad("system must be a string or a list of text blocks", "system")


def template_messages(req: CountTokensRequest) -> list[dict]:
    system = system_text(req.system)
    out = [{"role": "system", "content": system}] if system else []
    for i, msg in enumerate(req.messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant'", f"messages[{i}].role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks_to_messages(role, content, f"messages[{i}].content")
        else:
            raise _bad(f"messages[{i}].content must be a string or a list of content blocks", f"messages[{i}].content")
    return out


def _blocks_to_messages(role: str, blocks: list, where: str) -> list[dict]:
    """One Anthropic turn as chat messages: its text and images as one message, its tool_use
    blocks as that message's tool_calls, each tool_result as a tool message (in block order)."""
    out: list[dict] = []
    parts: list[dict] = []
    calls: list[dict] = []

    def flush() -> None:
        if parts or calls:
            msg: dict[str, Any] = {"role": role, "content": parts[:] or ""}
            if calls:
                msg["tool_calls"] = calls[:]
            out.append(msg)
            parts.clear()
            calls.clear()

    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            flush()
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                        "content": _result_text(block.get("content"), at)})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue      # turnkv never writes thinking blocks; a client replaying another model's is served
        else:
            raise _bad(f"{at}: a {role} turn takes text, image" +
                       (", tool_use" if role == "assistant" else ", tool_result") + f" blocks, got {kind!r}", at)
    flush()
    return out


def _string(block: dict, key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{at}.{key} must be a non-empty string", at)
    return value


def _tool_call(block: dict, at: str) -> dict:
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _bad(f"{at}.input must be an object", at)
    return {"id": _string(block, "id", at), "type": "function",
            "function": {"name": _string(block, "name", at), "arguments": args}}


def _result_text(content: Any, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise _bad(f"{at}.content must be a string or a list of text blocks", at)


def _image_url(source: Any, at: str) -> str:
    """An image source as the data URL the chat path decodes (a url source is passed on, and
    refused there unless it is a data URL: turnkv fetches nothing)."""
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return f"data:{media};base64,{data}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(f'{at}.source must be {{"type": "base64", "media_type": ..., "data": ...}} or '
               f'{{"type": "url", "url": ...}}', at)


# ----------------------------------------------------------------------------- replies


def usage_json(usage, output_tokens: int | None = None) -> dict:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens}


def tool_use_block(call: dict) -> dict:
    """A parsed chat tool call (server/tools.py) as a tool_use block."""
    fn = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
            "input": json.loads(fn["arguments"])}


def stop_reason(result, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if result.stop_string is not None:
        return "stop_sequence", result.stop_string
    return "end_turn", None


def message_json(rid: str, model: str, content: list[dict], usage: dict,
                 reason: tuple[str | None, str | None] = (None, None)) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


def message(rid: str, model: str, result, tool_format: str | None) -> dict:
    """The whole reply of a finished generation."""
    text, calls = toolkit.parse(result.text, tool_format) if tool_format else (result.text, [])
    content = [{"type": "text", "text": text}] if text or not calls else []
    content += [tool_use_block(c) for c in calls]
    return message_json(rid, model, content, usage_json(result.usage), stop_reason(result, bool(calls)))


# ----------------------------------------------------------------------------- streaming


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Blocks:
    """A streamed reply's content blocks: text deltas as they come (text that may start a tool
    call held back, as the chat stream does), each tool call a tool_use block at the end. A call
    the grammar forces (``forced``: see StreamParser) opens its block as soon as its name is known
    (the first token, when only one function is allowed) and its input streams as it is written;
    one block is open at a time, as Anthropic streams them."""

    def __init__(self, tool_format: str | None, forced: list[str] | None = None):
        self.parser = toolkit.StreamParser(tool_format, forced) if tool_format else None
        self.index = -1
        self.text_open = False
        self.live: list[dict] = []      # forced calls opened while streaming: block, input pieces, state

    def _start(self, block: dict) -> str:
        self.index += 1
        return event("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": block})

    def _stop(self) -> str:
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, text: str) -> list[str]:
        out = self._text(self.parser.push(text) if self.parser is not None else text)
        if self.parser is None or self.parser.forced is None:
            return out
        for head in self.parser.opened():
            block = {"type": "tool_use", "id": "toolu_" + head["id"].removeprefix("call_"),
                     "name": head["function"]["name"], "input": {}}
            self.live.append({"block": block, "pieces": [], "whole": False, "state": "waiting"})
        for i, piece, whole in self.parser.arguments():
            self.live[i]["pieces"].append(piece)
            self.live[i]["whole"] = whole
        return out + self._advance()

    def _input(self, partial: str) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": partial}})

    def _advance(self, end: bool = False) -> list[str]:
        """The live tool_use blocks in order: each started, fed the input written so far, and
        stopped once whole (all of them at the ``end``) before the next one starts."""
        out = []
        for call in self.live:
            if call["state"] == "stopped":
                continue
            if call["state"] == "waiting":
                if self.text_open:
                    out.append(self._stop())
                    self.text_open = False
                out.append(self._start(call["block"]))
                call["state"] = "open"
            out += [self._input(p) for p in call["pieces"] if p]
            call["pieces"].clear()
            if not (call["whole"] or end):
                break
            out.append(self._stop())
            call["state"] = "stopped"
        return out

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.text_open else [self._start({"type": "text", "text": ""})]
        self.text_open = True
        return out + [event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": {"type": "text_delta", "text": text}})]

    def end(self) -> tuple[list[str], bool]:
        """(the last events of the content, whether the reply called tools)."""
        rest, calls = self.parser.finish() if self.parser is not None else ("", [])
        if self.live:
            return self._end_live(calls), True
        out = self._text(rest)
        if self.index < 0 and not calls:       # an empty reply still has its (empty) text block
            out.append(self._start({"type": "text", "text": ""}))
            self.text_open = True
        if self.text_open:
            out.append(self._stop())
        return out + self._whole(calls), bool(calls)

    def _whole(self, calls: list[dict]) -> list[str]:
        out = []
        for call in calls:
            block = tool_use_block(call)
            out += [self._start({**block, "input": {}}), self._input(json.dumps(block["input"], ensure_ascii=False)),
                    self._stop()]
        return out

    def _end_live(self, deltas: list[dict]) -> list[str]:
        """After live tool_use blocks: their input not sent yet, then any later call whole."""
        later = []
        for d in deltas:
            if d["index"] < len(self.live):
                self.live[d["index"]]["pieces"].append(d["function"]["arguments"])
            else:
                later.append({k: v for k, v in d.items() if k != "index"})
        return self._advance(end=True) + self._whole(later)


async def stream_message(job: Job, rid: str, model: str, tool_format: str | None, forced: list[str] | None,
                         timeout_s: float | None) -> AsyncIterator[str]:
    """A job's events as Anthropic's stream: message_start (sent once the engine has admitted the
    request, so its usage says what was reused), ping, the content blocks, message_delta with the
    stop_reason and the final usage, message_stop; a failure is an ``error`` event. Starlette
    cancels this generator when the client disconnects; ``finally`` cancels the generation."""
    blocks = _Blocks(tool_format, forced)
    try:
        item = await job.events.get()
        usage = usage_json(job.seq.usage, output_tokens=0)
        yield event("message_start", {"type": "message_start", "message": message_json(rid, model, [], usage)})
        yield event("ping", {"type": "ping"})
        while True:
            if isinstance(item, TokenEvent):
                for out in blocks.text(item.text):
                    yield out
            elif isinstance(item, Failed):
                yield event("error", error_json(failure(item.error)))
                break
            elif isinstance(item, Finished):
                if item.result.finish_reason == "timeout":
                    yield event("error", error_json(timed_out(timeout_s)))
                    break
                out, called = blocks.end()
                for chunk in out:
                    yield chunk
                reason, sequence = stop_reason(item.result, called)
                yield event("message_delta", {"type": "message_delta", "usage": usage_json(item.result.usage),
                                              "delta": {"stop_reason": reason, "stop_sequence": sequence}})
                yield event("message_stop", {"type": "message_stop"})
                break
            item = await job.events.get()
    finally:
        job.cancel()
