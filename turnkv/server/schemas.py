"""Request validation and response shapes of the OpenAI-compatible API.

Requests are pydantic models: wrong types are refused (strict fields, no "5" -> 5 coercion) so a
client bug surfaces as a 400 instead of a silently different request. Fields OpenAI defines but
turnkv does not implement are accepted only at their neutral value (e.g. ``echo: false``),
otherwise refused by name, never ignored. Unknown fields are ignored, as vLLM and llama.cpp do.
Responses are plain dicts built by small functions: they are made per token while streaming.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)

# OpenAI's own limits where the API defines them; a seed must fit torch.Generator.manual_seed.
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20          # OpenAI's top_logprobs limit (also the completions logprobs cap here)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
# chat-template variables a request's chat_template_kwargs cannot replace
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")

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


def content_text(content: Any) -> str | list[dict]:
    """A message's content as one string: a string, or a list of text parts (joined by newlines,
    as the tokenizer does). A list with image parts (``{"type": "image_url", "image_url": {"url":
    ...}}``) stays a list of text and image_url parts, for a vision model (docs/images.md).
    Raises ValueError naming what is wrong."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts, parts = [], []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str):
                    raise ValueError(f"content[{j}].image_url.url must be a string (a data:image/...;base64, URL)")
                parts.append({"type": "image_url", "image_url": {"url": url}})
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}} "
                                 "or an image_url part")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        if len(parts) > len(texts):
            return parts
        return "\n".join(texts)
    raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")


def content_chars(content: Any) -> int:
    """Characters of text in a message's content (a string or a list of parts)."""
    if isinstance(content, list):
        return sum(len(p.get("text", "").strip()) for p in content)
    return len((content or "").strip())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant turn that called tools
    tool_call_id: StrictStr | None = None              # a tool result: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info) -> str | list[dict] | None:
        return None if value is None else content_text(value)

    def as_template_message(self) -> dict:
        # "developer" is OpenAI's newer name for the system role; templates know only "system".
        # An assistant turn that only called tools has null content: it renders as empty text.
        role = "system" if self.role == "developer" else self.role
        msg = {"role": role, "content": self.content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
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
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)     # vLLM's extension; 1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)          # vLLM's extension; 0 = off
    logit_bias: dict[str, float] | None = None                  # token id (a string) -> bias in [-100, 100]
    stop_token_ids: list[StrictInt] | None = None              # vLLM's extension
    speculative: Literal["off", "ngram", "cache", "mtp", "auto"] | None = None   # drafters.MODES: docs/speculative.md
    draft_max: StrictInt | None = Field(None, ge=1, le=64)
    # SGLang's fields, which sglang-router adds to every body it forwards (docs/scale-out.md)
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    return_hidden_states: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit JSON null means "not set" for every optional field (as OpenAI's API and its
        clients treat it); a required field sent as null is then reported missing."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (decimal integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

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
        if self.no_stop_trim:
            out.append(("no_stop_trim", "no_stop_trim is not supported: a matched stop string is never returned"))
        if self.return_hidden_states:
            out.append(("return_hidden_states", "return_hidden_states is not supported"))
        return out

    def scoring(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets beyond the basic ones (penalties, bias, n,
        logprobs); absent fields keep the server's defaults."""
        out: dict[str, Any] = {"n": self.n, "skip_special_tokens": self.skip_special_tokens,
                               "presence_penalty": self.presence_penalty,
                               "frequency_penalty": self.frequency_penalty,
                               "logit_bias": {int(k): float(v) for k, v in (self.logit_bias or {}).items()}}
        if self.repetition_penalty is not None:
            out["repetition_penalty"] = self.repetition_penalty
        if self.min_p is not None:
            out["min_p"] = self.min_p
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.speculative is not None:
            out["speculative"] = self.speculative
        if self.draft_max is not None:
            out["draft_max"] = self.draft_max
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None                  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extra chat-template variables (vLLM's field)
    continue_final_message: StrictBool = False              # SGLang's / vLLM's; only false is supported
    # turnkv has no reasoning parser: a model's reasoning stays in content, either value is served alike
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    include_reasoning: StrictBool = True     # vLLM's; vllm-router adds it to every chat request

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict | None) -> dict | None:
        reserved = sorted(set(value or ()) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set through chat_template_kwargs")
        return value

    def response_schema(self) -> tuple[bool, dict | None]:
        """(constrained, schema) of response_format: json_object -> (True, None), json_schema ->
        (True, the schema), text or absent -> (False, None). ValueError names what is wrong."""
        rf = self.response_format
        kind = (rf or {}).get("type", "text")
        if kind == "text":
            return False, None
        if kind == "json_object":
            return True, None
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError('response_format.json_schema must be {"name": ..., "schema": {...}}')
            return True, spec.get("schema") or {"type": "object"}
        raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.continue_final_message:
            out.append(("continue_final_message", "continue_final_message is not supported: every chat "
                        "ends with the template's generation prompt"))
        return out

    def scoring(self) -> dict[str, Any]:
        out = super().scoring()
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        out["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return out

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: Any = Field(...)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
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
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is supported"))
        return out

    def scoring(self) -> dict[str, Any]:
        return {**super().scoring(), "logprobs": self.logprobs}


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
        # TTFT breakdown: render (the chat template) and tokenize, before the engine; then from
        # submit: queue (waiting for a slot), lookup, restore, prefill (admit -> prompt consumed,
        # steps shared with other requests included), sample (the first token's sampler, grammar
        # mask included); ttft_ms counts from submit
        "render_ms": round(stats.render_ms, 3),
        "tokenize_ms": round(stats.tokenize_ms, 3),
        "queue_ms": round(queue_ms, 3),
        "lookup_ms": round(stats.lookup_ms, 3),
        "restore_ms": round(stats.restore_ms, 3),
        "prefill_ms": round(stats.prefill_ms, 3),
        "sample_ms": round(stats.sample_ms, 3),
        "ttft_ms": round(stats.ttft_ms, 3),
        "decode_ms": round(stats.decode_ms, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "prefilled_tokens": stats.prefilled_tokens,
        "checkpoints": stats.checkpoints,
        "reuse_from": stats.reuse_from,
        # speculative decoding (docs/speculative.md): the mode or "off (reason)", draft tokens verified, kept
        "speculative": stats.speculative,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "forced_drafted_tokens": stats.forced_drafted,     # of them, what the grammar forced (docs/speculative.md)
        "forced_accepted_tokens": stats.forced_accepted,
        "drafts": stats.drafts,          # by kind: "ngram", "cache", "forced" (drafted, accepted, acceptance_rate)
    }


def chat_choice(result, logprobs: dict | None = None) -> dict:
    return {"index": result.index, "message": {"role": "assistant", "content": result.text},
            "logprobs": logprobs, "finish_reason": result.finish_reason}


def _envelope(obj: str, rid: str, created: int, model: str, choices: list) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def _whole(obj: str, rid: str, created: int, model: str, choices: list, result, queue_ms: float) -> dict:
    """A non-streamed reply: the choices, then the request's usage (over all choices) and timings."""
    return {**_envelope(obj, rid, created, model, choices), "usage": usage_json(result.usage),
            "timings": timings_json(result.stats, queue_ms)}


def _chunk(obj: str, rid: str, created: int, model: str, choice: dict, include_usage: bool) -> dict:
    chunk = _envelope(obj, rid, created, model, [choice])
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_completion(rid: str, created: int, model: str, result, queue_ms: float, *, results: list | None = None,
                    logprobs: list[dict | None] | None = None) -> dict:
    """``result``: the request's (usage over all choices); ``results``: every choice (n > 1),
    ``logprobs``: each choice's formatted logprobs (server/logprobs.py)."""
    results = results or [result]
    logprobs = logprobs or [None] * len(results)
    choices = [chat_choice(r, lp) for r, lp in zip(results, logprobs)]
    return _whole("chat.completion", rid, created, model, choices, result, queue_ms)


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               include_usage: bool = False, *, index: int = 0, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk("chat.completion.chunk", rid, created, model, choice, include_usage)


def text_completion(rid: str, created: int, model: str, result, queue_ms: float, *, results: list | None = None,
                    logprobs: list[dict | None] | None = None) -> dict:
    results = results or [result]
    logprobs = logprobs or [None] * len(results)
    choices = [{"index": r.index, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}
               for r, lp in zip(results, logprobs)]
    return _whole("text_completion", rid, created, model, choices, result, queue_ms)


def text_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None = None,
               include_usage: bool = False, *, index: int = 0, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk("text_completion", rid, created, model, choice, include_usage)


def usage_chunk(rid: str, created: int, model: str, object_name: str, result, queue_ms: float) -> dict:
    """The extra last chunk `stream_options.include_usage` asks for: no choices, just usage."""
    return {"id": rid, "object": object_name, "created": created, "model": model, "choices": [],
            "usage": usage_json(result.usage), "timings": timings_json(result.stats, queue_ms)}
