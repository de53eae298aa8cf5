"""Tool calling: which format a chat template uses, the model's call text parsed into OpenAI
``tool_calls`` (whole, or while streaming), history messages made template-ready, and the grammar
that forces a call for ``tool_choice: "required"`` or a named function.

Formats (chosen from what the chat template renders):

- ``hermes``: Hermes / Qwen 2.5+ / ChatML-with-tools templates. A call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text before the first call is content.
- ``llama3_json``: Llama 3.1+/3.2/3.3 templates. The whole reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).

A template that renders neither has no tool support: requests with tools are refused (400) rather
than silently answered without them, except a ChatML template that renders every probe conversation
exactly as the shipped ``chatml-tools`` template does without tools (SmolLM2's): ``turnkv serve``
runs that template instead (``chatml_tools_for``), so the bundled chat model answers tools out of
the box.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .call_args import StableJson, canonical

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# a call's name, complete (its closing quote generated): Hermes, each <tool_call>; Llama 3, the first call
_HERMES_NAME = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_LLAMA_NAME = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# the text from a <tool_call> to the end that may still become a _HERMES_NAME match
_HERMES_NAME_SO_FAR = re.compile(
    r'<tool_call>\s*(?:\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"(?:[^"\\]|\\.)*\\?)?)?)?)?)?)?)?)?)?\Z')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*)', re.DOTALL)


CHATML_TOOLS = "chatml-tools"
# conversations the model's own template and chatml-tools must render alike before one replaces
# the other: with and without a system turn, several rounds, a system turn later on
_PROBES = (
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time..."},
     {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "The end."},
     {"role": "system", "content": "Now answer in French."}, {"role": "user", "content": "Merci !"}],
)


def _renders(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str | None:
    try:
        return tokenizer.render_text(messages, add_generation_prompt)
    except ValueError:        # a template may refuse a layout (e.g. a late system turn): so must the other
        return None


def chatml_tools_for(tokenizer):
    """``tokenizer`` under the shipped chatml-tools template when its own template renders no tools,
    is ChatML, and renders every probe conversation (with and without the generation prompt)
    character for character as chatml-tools does without tools; else None."""
    from ..loading.tokenizer import shipped_template

    own = tokenizer.chat_template if tokenizer is not None else None
    if not own or template_format(own) is not None or "<|im_start|>" not in own:
        return None
    tools = tokenizer.with_template(shipped_template(CHATML_TOOLS),
                                    note=f"{CHATML_TOOLS} (automatic: the model's ChatML template renders no "
                                         f"tools; without tools both render alike)")
    for messages in _PROBES:
        for gen in (True, False):
            if _renders(tokenizer, messages, gen) != _renders(tools, messages, gen):
                return None
    return tools


def template_format(template: str | None) -> str | None:
    """The tool-call format a chat template renders, or None when it does not render tools."""
    if not template or "tools" not in template:
        return None
    if _HERMES_OPEN in template:
        return HERMES
    if _PYTHON_TAG in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return LLAMA3_JSON
    return None


# ----------------------------------------------------------------------------- requests


def history_message(msg: dict) -> dict:
    """An OpenAI history message (already a template message) with its ``tool_calls`` made the
    shape templates expect: ``function.arguments`` a JSON object, not the string OpenAI sends
    (vLLM does the same), so the template renders a past call exactly as the model wrote it."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"tool_calls[{i}] must be an object with a 'function' object")
        fn = dict(call["function"])
        if not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{i}].function.name must be a string")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"tool_calls[{i}].function.arguments is not valid JSON") from None
        fn["arguments"] = args
        out.append({**call, "type": call.get("type", "function"), "function": fn})
    return {**msg, "tool_calls": out}


def validate_tools(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({**tool, "type": "function"})
    return out


def forced_names(tools: list[dict], choice) -> list[str] | None:
    """The functions a call must name (``required``: any; a named choice: that one), or None
    when the model is free (``auto``, ``none``). Raises ValueError for a bad choice."""
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        return names
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return [name]
    raise ValueError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def call_grammar(fmt: str, tools: list[dict], names: list[str], parallel: bool = False) -> str:
    """A Lark grammar (llguidance) whose sentences are a call in ``fmt`` to one of ``names`` (one or
    more calls when ``parallel``), arguments matching the function's parameters schema, JSON spaced
    as the template's tojson. One call unless the request set parallel_tool_calls: small models
    forced into a call tend to repeat it until max_tokens."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    key = "arguments" if fmt == HERMES else "parameters"
    variants = []
    for name in names:
        params = by_name[name].get("parameters") or {"type": "object"}
        variants.append({"type": "object", "properties": {"name": {"const": name}, key: params},
                         "required": ["name", key], "additionalProperties": False})
    schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
    schema["x-guidance"] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
    body = json.dumps(schema)
    if fmt == HERMES:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" obj "\\n</tool_call>"\nobj: %json {body}\n'
    start = 'start: obj ("; " obj)*' if parallel else "start: obj"
    return f"{start}\nobj: %json {body}\n"


# ----------------------------------------------------------------------------- replies


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _one(obj, fmt: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = ("arguments", "parameters") if fmt == HERMES else ("parameters", "arguments")
    args = next((obj[k] for k in keys if k in obj), {})
    return _call(obj["name"], args)


def _hermes_calls(body: str) -> list[dict] | None:
    calls = []
    for m in _HERMES_CALL.finditer(body):
        try:
            call = _one(json.loads(m.group(1)), HERMES)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _llama_calls(text: str) -> list[dict] | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _one(obj, LLAMA3_JSON)
        if call is None:
            return None
        calls.append(call)
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        pos = len(body) - len(rest[1:].lstrip())
    return calls or None


def parse(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply; text that is not a well-formed call stays content."""
    if fmt == HERMES:
        at = text.find(_HERMES_OPEN)
        if at >= 0:
            calls = _hermes_calls(text[at:])
            if calls:
                content = text[:at]       # as vLLM's Hermes parser: not stripped, None when blank
                return (content if content.strip() else None), calls
    elif fmt == LLAMA3_JSON:
        calls = _llama_calls(text)
        if calls:
            return None, calls
    return text, []


@dataclass
class StreamParser:
    """Splits streamed reply text into content deltas and tool-call deltas.

    Content streams as it comes, except text that may be the start of a call, which is held back
    (Hermes: from ``<tool_call>`` on, and any tail that could begin it; Llama 3: a reply that
    starts with ``{`` or ``<|python_tag|>``). At the end the held text is parsed: calls become
    ``delta.tool_calls`` (one delta per call, complete), anything else is sent as content.

    ``forced`` (the functions a grammar forces the reply to call, so the held text cannot turn out
    to be content; None when the model is free): each call's opening delta (``index``, ``id``,
    ``type``, ``function.name``, empty ``arguments``) is ready from ``opened`` as soon as its name
    has been generated, as OpenAI and llama.cpp stream a call; its arguments follow, from
    ``arguments`` as they are written or from ``finish`` (cut short with the reply at
    ``max_tokens``). When ``forced`` names one function (a named ``tool_choice``, or ``required``
    with one tool) the first call's name is known before the model writes it: its opening delta is
    ready from the first token on, as vLLM streams a named ``tool_choice`` (the model's name
    tokens would add a decode step each to the client's time to first token)."""

    fmt: str
    forced: list[str] | None = None
    held: str = ""
    in_call: bool = False
    started: bool = False
    calls: list[dict] = field(default_factory=list)
    heads: list[dict] = field(default_factory=list)     # opening deltas sent (forced)
    sent: list[str] = field(default_factory=list)       # per opened call: its arguments text sent so far
    sent_n: list[int] = field(default_factory=list)     # its length (``sent`` itself kept up once whole, or in finish)
    done: list[bool] = field(default_factory=list)      # per opened call: its arguments all sent
    # what opened / arguments found so far in ``held`` (append-only once in a call), so each look
    # reads only the text pushed since the last: <tool_call> positions, names matched, each
    # opened call's arguments start (None: not yet) and scan
    opens: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    scanned: int = 0                                    # <tool_call> searched for up to here
    named: int = 0                                      # names searched for from here
    args_at: list[int | None] = field(default_factory=list)
    scans: list[StableJson] = field(default_factory=list)

    def __post_init__(self):
        if self.known_name is not None:      # the grammar leaves no room for content: all of it is calls
            self.in_call = True

    @property
    def known_name(self) -> str | None:
        """The first call's name when the grammar allows no other."""
        return self.forced[0] if self.forced is not None and len(self.forced) == 1 else None

    def push(self, text: str) -> str:
        """Content to send now for newly generated ``text`` ('' when held)."""
        self.held += text
        if self.in_call:
            return ""
        if self.fmt == LLAMA3_JSON:
            if not self.started:
                lead = self.held.lstrip()
                if not lead:
                    return ""
                self.started = True
                if lead.startswith("{") or lead.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(lead):
                    self.in_call = True
                    return ""
            out, self.held = self.held, ""
            return out
        at = self.held.find(_HERMES_OPEN)
        if at >= 0:
            out, self.held = self.held[:at], self.held[at:]
            self.in_call = True
            return out
        keep = 0      # the longest tail that is a prefix of "<tool_call>"
        for k in range(min(len(self.held), len(_HERMES_OPEN) - 1), 0, -1):
            if _HERMES_OPEN.startswith(self.held[-k:]):
                keep = k
                break
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def opened(self) -> list[dict]:
        """Opening deltas of the calls whose names are complete since the last look (forced only)."""
        if self.forced is None or not self.in_call:
            return []
        out = [self._open(self.known_name)] if self.known_name is not None and not self.heads else []
        if self.fmt == HERMES:
            names = self._hermes_names()
        else:
            m = _LLAMA_NAME.match(self.held) if not self.heads else None
            names = [m.group(1)] if m else []
        for name in names[len(self.heads):]:
            try:
                out.append(self._open(json.loads(f'"{name}"')))
            except ValueError:
                return out
        return out

    def _open(self, name: str) -> dict:
        head = {"index": len(self.heads), **_call(name, "")}
        self.heads.append(head)
        self.sent.append("")
        self.sent_n.append(0)
        self.done.append(False)
        self.args_at.append(None)
        self.scans.append(StableJson())
        return head

    def _find_opens(self) -> None:
        """``opens`` extended with the <tool_call> positions in the text pushed since the last look."""
        while (at := self.held.find(_HERMES_OPEN, self.scanned)) >= 0:
            self.opens.append(at)
            self.scanned = at + len(_HERMES_OPEN)
        self.scanned = max(self.scanned, len(self.held) - len(_HERMES_OPEN) + 1)

    def _hermes_names(self) -> list[str]:
        """The names of the calls written so far (what _HERMES_NAME.finditer over ``held`` finds),
        searched for only from the first <tool_call> that is not a match or a non-match yet."""
        self._find_opens()
        for at in self.opens:
            if at < self.named:
                continue
            m = _HERMES_NAME.match(self.held, at)
            if m:
                self.names.append(m.group(1))
                self.named = m.end()
            elif _HERMES_NAME_SO_FAR.match(self.held, at):
                return self.names        # this call's name is still being written
            else:
                self.named = at + 1
        return self.names

    def _written(self, held: str) -> list[str]:
        """Per opened call, its arguments text as written so far in ``held`` (from the value's first
        character)."""
        segments = held.split(_HERMES_OPEN)[1:] if self.fmt == HERMES else [held]
        out = []
        for seg in segments[:len(self.heads)]:
            m = _ARGS.search(seg)
            out.append(m.group(1) if m else "")
        return out

    def arguments(self) -> list[tuple[int, str, bool]]:
        """(index, arguments text, whether that call's arguments are now whole) of the opened calls'
        arguments written since the last look, as far as they are sure to read the same in the parsed
        call (forced only): what is sent is always a prefix of the final ``function.arguments``.
        Each look reads only the text pushed since the last (see ``_args_span``)."""
        out = []
        for i in range(len(self.heads)):
            if self.done[i] or (span := self._args_span(i)) is None:
                continue
            start, end = span
            scan = self.scans[i]
            fed = start + scan.n      # nothing more once the scan is final (a value that reads otherwise)
            stable, whole = scan.feed(self.held[fed:end] if fed < end and scan.result is None else "")
            n = self.sent_n[i]
            if whole:
                sent, text = self.held[start:start + n], canonical(self.held[start:start + stable])
                piece = text[n:] if text is not None and text.startswith(sent) else ""
                self.sent[i], self.done[i] = sent + piece, text is not None
            else:       # the sure part only grows and what was sent is its start: ``sent`` catches up in finish
                piece = self.held[start + n:start + stable] if stable > n else ""
            self.sent_n[i] = n + len(piece)
            if piece or self.done[i]:
                out.append((i, piece, self.done[i]))
        return out

    def _args_span(self, i: int) -> tuple[int, int] | None:
        """Where the opened call ``i``'s arguments value starts in ``held`` and where its text ends
        (the next <tool_call>, or the end), as ``_written`` splits it; None before the value's first
        character. The start is looked for only until found."""
        if self.fmt == HERMES:
            self._find_opens()
            if i >= len(self.opens):
                return None
            seg = self.opens[i] + len(_HERMES_OPEN)
            end = self.opens[i + 1] if i + 1 < len(self.opens) else len(self.held)
        else:
            seg, end = 0, len(self.held)
        if self.args_at[i] is None:
            m = _ARGS.search(self.held, seg, end)
            if m is None or m.start(1) >= end:      # not yet: more whitespace may come before the value
                return None
            self.args_at[i] = m.start(1)
        return self.args_at[i], end

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, tool-call deltas) at the end of the reply."""
        for i, n in enumerate(self.sent_n):
            if len(self.sent[i]) != n:      # streamed, not whole: what was sent is the start of the value
                self.sent[i] = self.held[self.args_at[i]:self.args_at[i] + n]
        held, self.held = self.held, ""
        if not self.in_call:
            return held, []
        content, calls = parse(held, self.fmt)
        if not calls and not self.heads:
            return held, []
        self.calls = calls
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        if self.heads:
            return "", self._rest(held, deltas)
        return ("" if self.fmt == HERMES else content or ""), deltas

    def _rest(self, held: str, deltas: list[dict]) -> list[dict]:
        """After opening deltas: those calls' arguments not sent yet (to the end, or as far as a reply
        cut short at ``max_tokens`` got), then any later call complete."""
        if not deltas:      # cut short: each opened call's arguments text as written so far
            return self._remainders([t.strip().removesuffix(_HERMES_CLOSE).rstrip() for t in self._written(held)])
        for head, call in zip(self.heads, self.calls):
            call["id"] = head["id"]
        whole = [c["function"]["arguments"] for c in self.calls[:len(self.heads)]]
        return self._remainders(whole) + deltas[len(self.heads):]

    def _remainders(self, whole: list[str]) -> list[dict]:
        """Deltas of each opened call's ``whole`` arguments past what ``arguments`` already sent."""
        out = []
        for head, text, sent in zip(self.heads, whole, self.sent):
            rest = text[len(sent):] if text.startswith(sent) else ""
            self.sent[head["index"]] = sent + rest
            if rest:
                out.append({"index": head["index"], "function": {"arguments": rest}})
        return out
