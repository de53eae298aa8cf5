"""The OpenAI Responses API's request (``POST /v1/responses``) and its translation into a chat
completions request: input items become chat messages, flat function tools the chat shape,
``text.format`` a ``response_format``, ``max_output_tokens`` the token limit. From there the request
takes the chat path (templates, tools, grammars, reuse, tenants), so both APIs render a
conversation to the same tokens and share its cached state."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from .schemas import SEED_MAX, SEED_MIN, ChatCompletionRequest, RequestError, _Strict

# what the chat path calls a field -> what the Responses API calls it (errors name the latter)
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                ("messages", "input"))
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")
# include values a turnkv reply satisfies as it is (there is no reasoning to encrypt)
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(_Strict):
    model: StrictStr | None = None
    input: Any = Field(...)
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    include: list[StrictStr] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: StrictBool = False
    reasoning: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: StrictInt | None = Field(None, ge=0)
    # turnkv's extensions, as on chat completions
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    top_k: StrictInt | None = Field(None, ge=-1)
    cache_salt: StrictStr | None = Field(None, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def refuse_unsupported(self) -> None:
        """Fields turnkv does not implement are refused by name unless at their neutral value."""
        refusals = [
            ("background", self.background, "background responses are not supported"),
            ("conversation", self.conversation is not None,
             "conversations are not supported: continue one with previous_response_id"),
            ("prompt", self.prompt is not None, "stored prompt templates are not supported"),
            ("truncation", self.truncation == "auto", 'only truncation "disabled" is supported'),
            ("reasoning", bool(self.reasoning), "reasoning settings are not supported (the model does not reason)"),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs is not supported on /v1/responses"),
        ]
        for include in self.include or ():
            refusals.append(("include", include not in HARMLESS_INCLUDES, f"include {include!r} is not supported"))
        verbosity = (self.text or {}).get("verbosity")
        refusals.append(("text.verbosity", verbosity not in (None, "medium"), "only text.verbosity medium is supported"))
        for param, refused, message in refusals:
            if refused:
                raise RequestError(message, param=param, code="unsupported_parameter")


def _bad(message: str, param: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


def _content(content: Any, where: str) -> str | list[dict]:
    """A message item's content as chat content: a string, or text / image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise _bad(f"{at}: only input_image parts with an image_url (a data: URL) are supported", at)
        else:
            raise _bad(f"{at} must be an input_text, output_text or input_image part, got {kind!r}", at)
    if all(p["type"] == "text" for p in parts):     # text only: joined as the chat path joins it
        return "\n".join(p["text"] for p in parts)
    return parts


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's output: a string, or a list of text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                        and isinstance(p.get("text"), str) for p in output):
        return "\n".join(p["text"] for p in output)
    raise _bad(f"{where}.output must be a string or a list of input_text parts", f"{where}.output")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _item(item: Any, where: str, out: list[dict]) -> None:
    """Appends the chat message(s) one input item stands for to ``out``."""
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an object (a message, function_call or function_call_output item)", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        out.append({"role": role, "content": _content(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": item.get("arguments", "")}}
        if not isinstance(call["function"]["arguments"], str):
            raise _bad(f"{where}.arguments must be a string of JSON", f"{where}.arguments")
        # calls right after an assistant turn belong to it: the model wrote them in one reply
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                    "content": _output_text(item.get("output"), where)})
    else:
        raise _bad(f"{where}: items of type {kind!r} are not supported (message, function_call and "
                   f"function_call_output are)", f"{where}.type")


def input_messages(value: Any) -> list[dict]:
    """The request's ``input`` as chat messages (a string is one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        _item(item, f"input[{i}]", out)
    return out


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses' flat function tools in the chat shape; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported, got type {kind!r}",
                               param=f"tools[{i}].type", code="unsupported_parameter")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice     # "none" / "auto" / "required"; anything else is refused by the chat path
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                       param="tool_choice", code="unsupported_parameter")


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt        # text / json_object as they are; the chat path refuses other types


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completions request the response is generated by (``messages``: the conversation,
    instructions excluded)."""
    from .requests import parse

    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body = {"messages": messages, "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "seed": req.seed, "top_k": req.top_k, "cache_salt": req.cache_salt, "user": req.user}
    with named_for_responses():
        return parse(ChatCompletionRequest, body)


class named_for_responses:
    """Re-raises a chat path's RequestError with the Responses API's field names."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, RequestError):
            for chat, responses in _PARAM_NAMES:
                if chat != "messages":       # "the request has 3 messages" stays as it reads
                    err.message = err.message.replace(chat, responses)
                if err.param is not None and err.param.startswith(chat):
                    err.param = responses if chat == "messages" else responses + err.param[len(chat):]
            if err.param is not None and err.param.startswith("tools"):
                err.param = err.param.replace(".function", "")
                err.message = err.message.replace(".function.", ".")
        return False
