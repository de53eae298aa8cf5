"""Tool calling without a model: the tool-call parsers (Hermes <tool_call> and Llama 3 JSON), the
streaming parser against the whole-text one, template format detection, and the chat template
rendering a past call and a tool result back so that the next turn's prompt extends the previous
turn's prompt + reply (the condition for reuse across tool rounds). Rendering uses the real
SmolLM2 tokenizer with the shipped chatml-tools template; the HTTP round trip is in
test_server_extras.py."""

from __future__ import annotations

import json
import re

import pytest

from turnkv.loading import load_tokenizer, shipped_template
from turnkv.loading.bundled import find_bundled
from turnkv.server import tools as T
from turnkv.server.chat_extras import forced_names
from turnkv.server.schemas import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# the tool parts of Llama 3.1's template, in its layout: calls are {"name": ..., "parameters": ...}
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Respond with a JSON {\"name\": function name, \"parameters\": arguments}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}"
    "{{ c.function.arguments | tojson }}{{ '}' }}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def smol():
    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("bundled model smollm2-135m is not installed")
    return load_tokenizer("smollm2-135m")


# ----------------------------------------------------------------------------- parsing


def test_hermes_calls_are_parsed_with_the_text_before_them_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = T.parse(text, T.HERMES)
    assert content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_text_that_is_not_a_well_formed_call_stays_content():
    for text in ("plain answer", "<tool_call>\n{not json}\n</tool_call>", '<tool_call>\n["a list"]\n</tool_call>'):
        assert T.parse(text, T.HERMES) == (text, [])
    assert T.parse("The answer is {\"name\": 1}", T.LLAMA3_JSON)[1] == []


def test_an_unterminated_hermes_call_at_the_end_is_still_a_call():
    content, calls = T.parse('<tool_call>\n{"name": "get_time", "arguments": {}}', T.HERMES)
    assert content is None and calls[0]["function"]["name"] == "get_time"


def test_llama3_json_calls():
    content, calls = T.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}', T.LLAMA3_JSON)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = T.parse('<|python_tag|>{"name": "get_time", "parameters": {}}; '
                       '{"name": "get_weather", "parameters": {"city": "Rome"}}', T.LLAMA3_JSON)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize("fmt,text", [
    (T.HERMES, 'Sure <b>bold</b> < done.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>'),
    (T.HERMES, "No call here, just a < sign and <tool"),
    (T.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (T.LLAMA3_JSON, "A plain reply with {braces} later."),
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streaming_parser_gives_what_the_whole_text_parser_gives(fmt, text, step):
    parser = T.StreamParser(fmt)
    streamed = "".join(parser.push(text[i:i + step]) for i in range(0, len(text), step))
    rest, deltas = parser.finish()
    content, calls = T.parse(text, fmt)
    assert streamed + rest == (content or "" if not calls or fmt == T.LLAMA3_JSON else streamed)
    if calls and fmt == T.HERMES:
        assert streamed.strip() == (content or "").strip()
    assert [d["function"] for d in deltas] == [c["function"] for c in calls]
    assert [d["index"] for d in deltas] == list(range(len(calls)))
    if fmt == T.HERMES and calls:       # content before the call streams before the call is complete
        first = T.StreamParser(fmt).push(text[: text.index("<tool_call>") + 4])
        assert first == text[: text.index("<tool_call>")]


_FORCED = [
    (T.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (T.HERMES, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "R\\"ome"}}\n</tool_call>'),
    (T.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
]


@pytest.mark.parametrize("fmt,text", _FORCED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_forced_call_streams_its_name_as_soon_as_it_is_generated(fmt, text, step):
    parser = T.StreamParser(fmt, forced=["get_weather", "get_time"])      # the model picks
    name_ends = [m.end() for m in re.finditer(r'"name": "[a-z_]+"', text)]
    heads, content = [], ""
    for i in range(0, len(text), step):
        content += parser.push(text[i:i + step])
        for head in parser.opened():
            # out at the first push that completes the name, before the call's arguments
            assert i < name_ends[head["index"]] <= i + step
            heads.append(head)
    assert content == "" and [h["index"] for h in heads] == list(range(len(heads))) and heads
    assert all(h["id"].startswith("call_") and h["type"] == "function" and h["function"]["arguments"] == ""
               for h in heads)
    rest, deltas = parser.finish()
    assert rest == ""
    # the deltas, put together by index as OpenAI clients do, are the calls the whole text holds
    got: dict[int, dict] = {}
    for d in heads + deltas:
        call = got.setdefault(d["index"], {"id": d.get("id"), "name": "", "arguments": ""})
        call["name"] += d.get("function", {}).get("name", "")
        call["arguments"] += d["function"].get("arguments", "")
    _, calls = T.parse(text, fmt)
    assert [(c["name"], c["arguments"]) for c in got.values()] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert [c["id"] for c in got.values()] == [c["id"] for c in parser.calls]


def test_a_forced_call_cut_short_streams_the_arguments_written():
    parser = T.StreamParser(T.HERMES, forced=["get_weather", "get_time"])
    parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    [head] = parser.opened()
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert parser.finish() == ("", [{"index": 0, "function": {"arguments": '{"city": "Par'}}])


@pytest.mark.parametrize("fmt,text", _FORCED)
def test_a_call_to_the_one_function_allowed_opens_with_the_first_token(fmt, text):
    # tool_choice names get_time / get_weather: the first call's name is known before it is written
    first = re.search(r'"name": "([a-z_]+)"', text).group(1)
    parser = T.StreamParser(fmt, forced=[first])
    assert parser.push(text[0]) == ""
    [head] = parser.opened()
    assert head["index"] == 0 and head["function"] == {"name": first, "arguments": ""}
    heads, later_ends = [head], [m.end() for m in re.finditer(r'"name": "[a-z_]+"', text)][1:]
    for i in range(1, len(text)):
        assert parser.push(text[i]) == ""
        for h in parser.opened():      # a later call (parallel_tool_calls) opens once its name is out
            assert i + 1 == later_ends[h["index"] - 1]
            heads.append(h)
    assert [h["index"] for h in heads] == list(range(len(later_ends) + 1))
    rest, deltas = parser.finish()
    _, calls = T.parse(text, fmt)
    assert rest == "" and [d["function"]["arguments"] for d in deltas] == [c["function"]["arguments"] for c in calls]
    assert [h["function"]["name"] for h in heads] == [c["function"]["name"] for c in calls]
    assert [h["id"] for h in heads] == [c["id"] for c in parser.calls]


def test_a_call_opened_with_the_first_token_and_cut_short_streams_no_arguments():
    parser = T.StreamParser(T.HERMES, forced=["get_weather"])
    parser.push("<tool_")
    [head] = parser.opened()
    assert head["function"]["name"] == "get_weather"
    assert parser.finish() == ("", [])


def test_the_name_known_before_the_reply_is_the_one_function_a_forced_call_may_name():
    def req(tools, choice):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "tools": tools, "tool_choice": choice})
    named = {"type": "function", "function": {"name": "get_time"}}
    assert forced_names(req([WEATHER, TIME], named)) == ["get_time"]
    assert forced_names(req([WEATHER], "required")) == ["get_weather"]
    assert forced_names(req([WEATHER, TIME], "required")) == ["get_weather", "get_time"]
    assert forced_names(req([WEATHER, TIME], "auto")) is None
    assert forced_names(req([WEATHER, TIME], "none")) is None
    assert T.StreamParser(T.HERMES, forced=["get_time"]).known_name == "get_time"
    assert T.StreamParser(T.HERMES, forced=["get_weather", "get_time"]).known_name is None   # known once written
    assert T.StreamParser(T.HERMES).known_name is None


def _stream_arguments(parser: T.StreamParser, text: str, step: int) -> tuple[dict, dict]:
    """Push ``text`` ``step`` characters at a time: (per call index, its arguments sent while
    streaming; per call index, the length of text pushed when its arguments were whole)."""
    sent: dict[int, str] = {}
    whole_at: dict[int, int] = {}
    for i in range(0, len(text), step):
        assert parser.push(text[i:i + step]) == ""
        parser.opened()
        for index, piece, whole in parser.arguments():
            sent[index] = sent.get(index, "") + piece
            if whole:
                whole_at[index] = min(i + step, len(text))
    return sent, whole_at


@pytest.mark.parametrize("fmt,text", _FORCED)
@pytest.mark.parametrize("step", [1, 4])
def test_a_forced_calls_arguments_stream_as_they_are_written(fmt, text, step):
    parser = T.StreamParser(fmt, forced=["get_weather", "get_time"])
    sent, whole_at = _stream_arguments(parser, text, step)
    _, calls = T.parse(text, fmt)
    final = [c["function"]["arguments"] for c in calls]
    # each call's arguments went out whole as soon as their closing brace was generated
    assert [sent[i] for i in range(len(final))] == final
    for i, args in enumerate(final):
        end = [m.end() for m in re.finditer(re.escape(args), text)][0]
        assert end <= whole_at[i] < end + step
    rest, deltas = parser.finish()
    assert rest == "" and deltas == [] and parser.sent == final


def test_arguments_that_read_otherwise_once_parsed_stream_up_to_there():
    # 1.50 and \u00e9 are written back as 1.5 and é: what is sent stays a prefix of the parsed arguments
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par", "n": 1.50, "s": "\\u00e9t\\u00e9"}}\n</tool_call>'
    parser = T.StreamParser(T.HERMES, forced=["get_weather"])
    sent, whole_at = _stream_arguments(parser, text, 1)
    assert sent[0] == '{"city": "Par", "n": ' and whole_at == {}
    rest, deltas = parser.finish()
    [call] = T.parse(text, T.HERMES)[1]
    assert call["function"]["arguments"] == '{"city": "Par", "n": 1.5, "s": "été"}'
    assert deltas == [{"index": 0, "function": {"arguments": '1.5, "s": "été"}'}}] and rest == ""
    assert parser.sent == [call["function"]["arguments"]]


def test_a_forced_call_cut_short_after_streaming_sends_the_rest_it_wrote():
    parser = T.StreamParser(T.HERMES, forced=["get_weather"])
    sent, _ = _stream_arguments(parser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par", "n": 12', 1)
    assert sent == {0: '{"city": "Par", "n": '}      # the number may go on
    assert parser.finish() == ("", [{"index": 0, "function": {"arguments": "12"}}])


def test_a_call_the_model_may_not_make_streams_only_once_complete():
    parser = T.StreamParser(T.HERMES)      # tool_choice auto: the held text may still be content
    parser.push('<tool_call>\n{"name": "get_weather", "arguments": {')
    assert parser.opened() == []


# ----------------------------------------------------------------------------- templates


def test_template_formats(smol):
    assert T.template_format(shipped_template("chatml-tools")) == T.HERMES
    assert T.template_format(LLAMA3_TEMPLATE) == T.LLAMA3_JSON
    assert T.template_format(smol.chat_template) is None          # SmolLM2's own template has no tools
    assert T.template_format(shipped_template("gemma3")) is None  # nor Gemma 3's


def test_chatml_tools_template_without_tools_renders_what_smollm2_renders(smol):
    tools_tok = smol.with_template(shipped_template("chatml-tools"))
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}]):
        assert tools_tok.render_text(msgs) == smol.render_text(msgs)


# real conversations, as clients send them: several rounds, code, markdown, unicode, blank lines,
# a long system prompt, an empty assistant turn and a late system turn
REAL_CHATS = [
    [{"role": "system", "content": "You are a senior Python reviewer. Answer with a short list of issues, "
                                   "most important first. Quote the offending line."},
     {"role": "user", "content": "```python\ndef mean(xs):\n    return sum(xs) / len(xs)\n```\nIs this OK?"},
     {"role": "assistant", "content": "1. `len(xs)` is 0 for an empty list: `ZeroDivisionError`.\n"
                                      "2. No type hints.\n\nSuggested:\n```python\ndef mean(xs: list[float]) -> "
                                      "float:\n    if not xs:\n        raise ValueError(\"empty\")\n"
                                      "    return sum(xs) / len(xs)\n```"},
     {"role": "user", "content": "Thanks! And for a generator?"}],
    [{"role": "user", "content": "Traduis « le chat dort sur le canapé » en anglais et en japonais."},
     {"role": "assistant", "content": "English: \"The cat is sleeping on the sofa.\"\n日本語: 「猫がソファで寝ている。」"},
     {"role": "user", "content": "Et en allemand ? 🙂"}],
    [{"role": "user", "content": "Give me three names for a bakery."},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "You sent nothing. Try again, please.\n\n  - keep them short\n  - no puns"},
     {"role": "assistant", "content": "Crumb, Hearth, Rise."},
     {"role": "system", "content": "From now on, answer in one word."},
     {"role": "user", "content": "Which one is best?"}],
]


def test_bundled_chatml_model_gets_the_tool_template_which_renders_real_chats_alike(smol):
    tools_tok = T.chatml_tools_for(smol)
    assert tools_tok is not None and "automatic" in tools_tok.template_note
    assert T.template_format(tools_tok.chat_template) == T.HERMES
    assert tools_tok.eos_token_ids == smol.eos_token_ids
    for msgs in REAL_CHATS:
        for cut in range(1, len(msgs) + 1):       # every prefix of the conversation, as each turn sends it
            own, auto = smol.render_chat(msgs[:cut]), tools_tok.render_chat(msgs[:cut])
            assert auto.text == own.text and auto.ids == own.ids
    assert "<tools>" in tools_tok.render_text(REAL_CHATS[0], tools=[WEATHER])


def test_other_templates_keep_their_own(smol):
    plain_chatml = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    for template in (shipped_template("gemma3"),          # not ChatML
                     plain_chatml,                        # ChatML, but no default system turn: renders otherwise
                     shipped_template("chatml-tools")):   # renders tools already
        assert T.chatml_tools_for(smol.with_template(template)) is None


@pytest.mark.parametrize("template,reply", [
    ("chatml-tools", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (LLAMA3_TEMPLATE, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_a_tool_round_renders_back_so_the_next_prompt_extends_prompt_plus_reply(smol, template, reply):
    tok = smol.with_template(shipped_template(template) if template == "chatml-tools" else template)
    fmt = T.template_format(tok.chat_template)
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = tok.render_chat(history, tools=[WEATHER, TIME])
    content, calls = T.parse(reply, fmt)
    assert calls and content is None
    # what an OpenAI client sends back: arguments as a JSON string, content null
    assistant = {"role": "assistant", "content": "", "tool_calls": calls}
    history += [T.history_message(assistant),
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp_c": 18}'}]
    second = tok.render_chat(history, tools=[WEATHER, TIME])
    assert second.text.startswith(first.text + reply)
    if fmt == T.HERMES:
        # and token for token (the Llama layout is rendered with SmolLM2's tokenizer here, whose
        # pre-tokenizer splits "\n\n{" unlike Llama 3's: only its text is compared)
        reply_ids = tok.encode(reply, add_special_tokens=False)
        assert second.ids[: len(first.ids) + len(reply_ids)] == first.ids + reply_ids
    assert '{"temp_c": 18}' in second.text[len(first.text):]


def test_history_tool_call_arguments_must_be_json():
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    with pytest.raises(ValueError, match="not valid JSON"):
        T.history_message(bad)


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_reserved_variables(smol):
    tok = smol.with_template("{% for m in messages %}{{ m.content }}{% endfor %}"
                             "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_text(msgs) == "hi"
    assert tok.render_text(msgs, template_kwargs={"enable_thinking": False}) == "hi/no_think"
    ChatCompletionRequest.model_validate({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    for key in ("messages", "tools", "add_generation_prompt"):
        with pytest.raises(Exception, match="cannot be set through chat_template_kwargs"):
            ChatCompletionRequest.model_validate({"messages": msgs, "chat_template_kwargs": {key: []}})


def test_forced_call_choice():
    tools = T.validate_tools([WEATHER, TIME])
    assert T.forced_names(tools, None) is None and T.forced_names(tools, "auto") is None
    assert T.forced_names(tools, "none") is None
    assert T.forced_names(tools, "required") == ["get_weather", "get_time"]
    assert T.forced_names(tools, {"type": "function", "function": {"name": "get_time"}}) == ["get_time"]
    with pytest.raises(ValueError, match="not in tools"):
        T.forced_names(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        T.forced_names(tools, "sometimes")


def test_chat_template_flag_takes_a_shipped_name_or_a_file(tmp_path):
    from turnkv.loading.errors import ModelLoadError
    from turnkv.loading.tokenizer import chat_template_source

    assert chat_template_source("chatml-tools") == shipped_template("chatml-tools")
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template_source(str(own)) == own.read_text()
    with pytest.raises(ModelLoadError, match="chatml-tools"):
        chat_template_source(str(tmp_path / "missing.jinja"))
