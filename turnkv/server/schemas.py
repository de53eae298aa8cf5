"""Request validation and response shapes of the OpenAI-compatible API.

Requests are pydantic models: wrong types are refused (strict fields, no "5" -> 5 coercion) so a
client bug surfaces as a 400 instead of a silently different request. Fields OpenAI defines but
turnkv does not implement are accepted only at their neutral value (e.g. ``presence_penalty: 0``),
otherwise refused by name, never ignored. Unknown fields are ignored, as vLLM and llama.cpp do.
Responses are plain dicts built by small functions: they are made per token while streaming.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

# OpenAI's own limits where the API defines them; a seed must fit torch.Generator.manual_seed.
MAX_STOP_STRINGS = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"


class RequestError(Exception):
    """A request turnkv refuses: becomes an OpenAI-style error body with this HTTP status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = INVALID_REQUEST, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------ requests


def content_text(content: Any) -> str:
    """A message's content as one string: a string, or a list of text parts (joined by newlines,
    as the tokenizer does). Raises ValueError naming what is wrong."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}}; "
                                 "only text content is supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info) -> str | None:
        return None if value is None else content_text(value)

    def as_template_message(self) -> dict:
        # "developer" is OpenAI's newer name for the system role; templates know only "system".
        # An assistant turn that only called tools has null content: it renders as empty text.
        role = "system" if self.role == "developer" else self.role
        msg = {"role": role, "content": self.content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)          # vLLM's extension; -1 and 0 mean off
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Any = None
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(None, max_length=1024)
    ignore_eos: StrictBool = False
    # accepted only at their neutral values
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return value

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to a value turnkv does not implement."""
        out = []
        if self.n != 1:
            out.append(("n", f"only n=1 is supported, got n={self.n}"))
        if self.presence_penalty:
            out.append(("presence_penalty", "presence_penalty is not supported (use 0)"))
        if self.frequency_penalty:
            out.append(("frequency_penalty", "frequency_penalty is not supported (use 0)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs:
            out.append(("logprobs", "logprobs are not supported"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only response_format {\"type\": \"text\"} is supported"))
        return out

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: Any = Field(...)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        return single_prompt(value)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def token_limit_param(self) -> str:
        return "max_tokens"

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.logprobs:
            out.append(("logprobs", "logprobs are not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is supported"))
        return out


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def single_prompt(value: Any) -> str | list[int]:
    """The completions prompt: text, token ids, or a batch of exactly one of either."""
    if isinstance(value, str):
        if not value:
            raise ValueError("prompt must not be empty")
        return value
    if isinstance(value, list) and value and len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0])):
        return single_prompt(value[0])
    if _is_token_list(value):
        if not value:
            raise ValueError("prompt must not be empty")
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ValueError("batched prompts are not supported: send one prompt per request")
    raise ValueError("prompt must be a string or a list of token ids")


def _param_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(err: ValidationError) -> RequestError:
    """The first pydantic error as an OpenAI-style 400 (param = the field's path)."""
    first = err.errors(include_url=False)[0]
    # a union (e.g. `stop: str | list[str]`) appends the member type to loc: drop it
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float"))))
    param = _param_path(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return RequestError(f"'{param}' is a required parameter", param=param, code="missing_required_parameter")
    return RequestError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ----------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage_json(usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def timings_json(stats, queue_ms: float) -> dict:
    # like llama.cpp's "timings": where a request's time went (ignored by OpenAI clients)
    return {
        # TTFT breakdown: render (chat template + tokenizer, before the engine), then from submit:
        # queue (waiting for a slot), lookup, restore, prefill (admit -> prompt consumed, steps
        # shared with other requests included); ttft_ms counts from submit
        "render_ms": round(stats.render_ms, 3),
        "queue_ms": round(queue_ms, 3),
        "lookup_ms": round(stats.lookup_ms, 3),
        "restore_ms": round(stats.restore_ms, 3),
        "prefill_ms": round(stats.prefill_ms, 3),
        "ttft_ms": round(stats.ttft_ms, 3),
        "decode_ms": round(stats.decode_ms, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "prefilled_tokens": stats.prefilled_tokens,
        "checkpoints": stats.checkpoints,
        "reuse_from": stats.reuse_from,
    }


def chat_completion(rid: str, created: int, model: str, result, queue_ms: float) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage_json(result.usage),
        "timings": timings_json(result.stats, queue_ms),
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               include_usage: bool = False) -> dict:
    chunk = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def text_completion(rid: str, created: int, model: str, result, queue_ms: float) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage_json(result.usage),
        "timings": timings_json(result.stats, queue_ms),
    }


def text_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
               include_usage: bool = False) -> dict:
    chunk = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, object_name: str, result, queue_ms: float) -> dict:
    """The extra last chunk `stream_options.include_usage` asks for: no choices, just usage."""
    return {"id": rid, "object": object_name, "created": created, "model": model, "choices": [],
            "usage": usage_json(result.usage), "timings": timings_json(result.stats, queue_ms)}
