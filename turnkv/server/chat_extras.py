"""What a chat request adds beyond messages and sampling: tools, tool_choice, response_format
and chat_template_kwargs, turned into the template's inputs, a grammar (engine/grammar.py) and
the tool-call format its reply is parsed with (server/tools.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.grammar import Grammar, GrammarError
from . import tools as toolkit
from .schemas import ChatCompletionRequest, RequestError


@dataclass
class ChatExtras:
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict | None = None
    grammar: Grammar | None = None
    tool_format: str | None = None     # parse the reply's tool calls in this format (None: don't)


def _bad(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param=param, code=code)


def tool_format(engine, req: ChatCompletionRequest) -> str | None:
    """The format the reply's tool calls are parsed in: None without tools or with tool_choice none."""
    if not req.tools or req.tool_choice == "none" or engine.tokenizer is None:
        return None
    return toolkit.template_format(engine.tokenizer.chat_template)


def forced_names(req: ChatCompletionRequest) -> list[str] | None:
    """The functions a grammar forces the reply to call (``required``: every tool; a named
    function: that one), or None when the model is free. Call after ``prepare`` validated them."""
    if not req.tools or req.tool_choice in (None, "auto", "none"):
        return None
    return toolkit.forced_names(toolkit.validate_tools(req.tools), req.tool_choice)


def prepare(engine, req: ChatCompletionRequest) -> ChatExtras:
    """Validate the extras against the model; RequestError (400) naming the field at fault.
    Compiling a grammar takes milliseconds (the tokenizer's first one seconds, unless warm_up built it): call it off the
    event loop."""
    try:
        messages = [toolkit.history_message(m) for m in req.template_messages()]
    except ValueError as err:
        raise _bad(str(err), "messages") from None
    extras = ChatExtras(messages, template_kwargs=req.chat_template_kwargs or None)
    tok = engine.tokenizer
    forced = None
    if req.tools:
        try:
            extras.tools = toolkit.validate_tools(req.tools)
            forced = toolkit.forced_names(extras.tools, req.tool_choice)
        except ValueError as err:
            raise _bad(str(err), "tool_choice" if "tool_choice" in str(err) else "tools") from None
        fmt = toolkit.template_format(tok.chat_template if tok is not None else None)
        if fmt is None and req.tool_choice != "none":
            raise _bad(f"the chat template of {engine.name} does not render tools (no Hermes <tool_call> or "
                       f"Llama 3 JSON tool format); start the server with --chat-template and a template "
                       f"that does (the shipped chatml-tools suits ChatML models)", "tools", "unsupported_parameter")
        extras.tool_format = tool_format(engine, req)
    elif req.tool_choice not in (None, "none", "auto"):
        raise _bad("tool_choice needs tools", "tool_choice")
    try:
        constrained, schema = req.response_schema()
    except ValueError as err:
        raise _bad(str(err), "response_format") from None
    if constrained and forced:
        raise _bad("response_format cannot be combined with a forced tool_choice", "response_format")
    try:
        if constrained:
            extras.grammar = Grammar.json_schema(tok, schema)
        elif forced:
            extras.grammar = Grammar.lark(tok, toolkit.call_grammar(extras.tool_format, extras.tools, forced,
                                                                     parallel=req.parallel_tool_calls is True))
    except GrammarError as err:
        raise _bad(str(err), "tool_choice" if forced else "response_format") from None
    return extras


def apply_tool_calls(body: dict, fmt: str | None) -> dict:
    """A chat.completion body with each choice's tool-call text moved into ``message.tool_calls``
    (finish_reason "tool_calls" where calls were found)."""
    if fmt is None:
        return body
    for choice in body.get("choices", []):
        message = choice.get("message") or {}
        content, calls = toolkit.parse(message.get("content") or "", fmt)
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            if choice.get("finish_reason") == "stop":
                choice["finish_reason"] = "tool_calls"
    return body


class ToolStream:
    """Per choice StreamParsers for a streamed reply (``forced``: see StreamParser)."""

    def __init__(self, fmt: str, forced: list[str] | None = None):
        self.fmt, self.forced = fmt, forced
        self.parsers: dict[int, toolkit.StreamParser] = {}

    def content(self, index: int, text: str) -> str:
        return self.parsers.setdefault(index, toolkit.StreamParser(self.fmt, self.forced)).push(text)

    def opened(self, index: int) -> list[dict]:
        """Opening deltas of choice ``index``'s calls whose names have just been generated."""
        parser = self.parsers.get(index)
        return parser.opened() if parser is not None else []

    def end(self, index: int) -> tuple[str, list[dict]]:
        """(content left to send, tool_calls delta entries) when choice ``index`` finishes."""
        parser = self.parsers.pop(index, None)
        return parser.finish() if parser is not None else ("", [])
