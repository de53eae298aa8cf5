"""Tools, structured output, chat_template_kwargs and the web page over real `turnkv serve`
processes (SmolLM2, whose own ChatML template renders no tools: the server runs the shipped
chatml-tools template instead), driven by the official `openai` client.

Two servers start once for the module: one as `make serve` starts it (no template flag: the switch
is automatic), with the prompt cache and an API key, one with `--chat-template chatml-tools` and
--no-prompt-cache (the oracle: a cold prefill of every turn)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from test_server import API_KEY, Server, require_model

TEMPLATE = ("--chat-template", "chatml-tools")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers():
    require_model("smollm2-135m")
    cached = Server.start("smollm2-135m", api_key=API_KEY)
    cold = Server.start("smollm2-135m", *TEMPLATE, "--no-prompt-cache")
    try:
        cached.wait_ready()
        cold.wait_ready()
    except BaseException:
        cached.stop()
        cold.stop()
        raise
    yield cached, cold
    cached.stop()
    cold.stop()


def chat(server: Server, messages: list, **kw):
    return server.client().chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def assistant_turn(message) -> dict:
    """What a client appends to its history for an assistant reply (the openai SDK's own dump)."""
    return message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})


# ----------------------------------------------------------------------------------------- tools


def test_bundled_model_answers_tools_out_of_the_box(servers):
    cached, cold = servers
    assert "chat template chatml-tools (automatic" in cached.text()        # the banner says so
    assert "chat template chatml-tools (--chat-template)" in cold.text()
    r = chat(cached, [{"role": "user", "content": "What time is it in Rome?"}], tools=[WEATHER, CLOCK],
             tool_choice="required", max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])


def test_tool_round_trip_over_three_turns_reuses_and_equals_cold(servers):
    cached, cold = servers
    history = [{"role": "system", "content": "You are a weather assistant for travellers in Europe."},
               {"role": "user", "content": "What is the weather in Paris right now?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    # turn 1: the call (forced by tool_choice: the 135M model does not call tools on its own)
    r1 = chat(cached, history, tools=[WEATHER, CLOCK], tool_choice=forced, max_tokens=48)
    c1 = chat(cold, history, tools=[WEATHER, CLOCK], tool_choice=forced, max_tokens=48)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert [(c.function.name, c.function.arguments) for c in c1.choices[0].message.tool_calls] == \
           [(call.function.name, call.function.arguments)]

    # turn 2: the tool's result goes back; the model answers in text
    history += [assistant_turn(choice.message),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    r2 = chat(cached, history, tools=[WEATHER, CLOCK], max_tokens=24)
    c2 = chat(cold, history, tools=[WEATHER, CLOCK], max_tokens=24)
    assert r2.choices[0].message.content == c2.choices[0].message.content
    assert c2.usage.prompt_tokens_details.cached_tokens == 0
    cached2 = r2.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt and the reply up to its first token that the template's rendering
    # tokenizes differently (a grammar-forced reply may be tokenized non-canonically by the model)
    assert r1.usage.prompt_tokens < cached2 < r2.usage.prompt_tokens

    # turn 3: the text reply and a new question: everything generated so far is restored
    history += [assistant_turn(r2.choices[0].message), {"role": "user", "content": "And in Rome?"}]
    r3 = chat(cached, history, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=48)
    c3 = chat(cold, history, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=48)
    calls3 = r3.choices[0].message.tool_calls
    assert r3.choices[0].finish_reason == "tool_calls" and calls3
    assert [(c.function.name, c.function.arguments) for c in calls3] == \
           [(c.function.name, c.function.arguments) for c in c3.choices[0].message.tool_calls]
    # prompt 2 and reply 2, all but the reply's last token (sampled, never fed to the model)
    assert r3.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens - 1


def streamed_deltas(server: Server, messages: list, **kw) -> tuple[list, str | None, str]:
    """(the tool_calls delta entries in order, the finish_reason, the content) of a streamed reply."""
    deltas, finish, content = [], None, ""
    for chunk in chat(server, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return deltas, finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_equals_the_whole_one(servers, choice):
    cached, _ = servers
    messages = [{"role": "user", "content": "What time is it in Oslo?"}]
    kw = dict(tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=48)
    whole = chat(cached, messages, **kw).choices[0].message.tool_calls
    deltas, finish, content = streamed_deltas(cached, messages, **kw)
    assert finish == "tool_calls" and content == ""
    # a forced call opens (id, type, name) as soon as its name is generated; its arguments follow
    heads = [d for d in deltas if d.function.name]
    assert [d.index for d in heads] == list(range(len(whole))) and deltas[0] is heads[0]
    assert all(d.id and d.id.startswith("call_") and d.type == "function" and d.function.arguments == ""
               for d in heads)
    args = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(whole))]
    assert [(h.function.name, a) for h, a in zip(heads, args)] == \
           [(c.function.name, c.function.arguments) for c in whole]


def test_a_call_to_the_named_function_opens_with_the_first_token(servers):
    cached, _ = servers
    messages = [{"role": "user", "content": "What time is it in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    # one token in, the model has not written the name yet: the named call is open all the same
    deltas, finish, content = streamed_deltas(cached, messages, tools=[WEATHER, CLOCK], tool_choice=named,
                                              max_tokens=1)
    assert finish == "length" and content == ""
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == \
           [(0, "function", "get_time", "")]
    # with the model free to pick, nothing opens before the name is written
    deltas, _, content = streamed_deltas(cached, messages, tools=[WEATHER, CLOCK], tool_choice="required",
                                         max_tokens=1)
    assert deltas == [] and content


def test_tool_request_errors(servers):
    cached, _ = servers
    client = cached.client()
    messages = [{"role": "user", "content": "hi"}]
    bad = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}), "chat_template_kwargs"),
        (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]), "messages"),
    ]
    for kw, param in bad:
        kw = {"messages": messages, **kw}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", max_tokens=4, **kw)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, (kw, err.value.body)
    # tool_choice "none": tools are rendered but no call is parsed or forced
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4)
    assert r.choices[0].message.tool_calls is None
    # chat_template_kwargs are accepted (this template uses none of them: the same prompt)
    a = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    b = client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


# --------------------------------------------------------------------------------- structured


def test_json_schema_replies_validate_20_of_20(servers):
    cached, _ = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}

    def one(seed: int, n: int = 1):
        return cached.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Invent a person: name, age and city."}],
            response_format=fmt, max_tokens=64, temperature=1.0, seed=seed, n=n)

    with ThreadPoolExecutor(4) as pool:        # batched together by the engine
        replies = list(pool.map(one, range(17)))
    # and 3 choices of one request (n forks one prefill: each fork has its own grammar state)
    choices = [r.choices[0] for r in replies] + one(100, n=3).choices
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 1     # sampled, not one fixed text


def test_json_object_and_streaming(servers):
    cached, _ = servers
    messages = [{"role": "system", "content": 'Answer with a JSON object such as {"answer": "..."}.'},
                {"role": "user", "content": "What is the capital of Italy?"}]
    r = chat(cached, messages, response_format={"type": "json_object"}, max_tokens=48)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       chat(cached, messages, response_format=fmt, max_tokens=64, stream=True) if c.choices)
    whole = chat(cached, messages, response_format=fmt, max_tokens=64).choices[0].message.content
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON)


# ------------------------------------------------------------------------------------ web page


def test_web_page_is_served_and_calls_endpoints_that_exist(servers):
    """No browser here: the page, its script and style are served (without the key: the page asks
    for it), and every endpoint the script fetches answers (401 without the key, 200 with it)."""
    cached, _ = servers
    page = httpx.get(cached.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(/web/[^"]+)"', page.text)
    assert sorted(assets) == ["/web/app.js", "/web/style.css"]
    assert "http://" not in page.text and "https://" not in page.text        # nothing from outside
    script = httpx.get(cached.url + "/web/app.js", timeout=30)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "http://" not in script.text and "https://" not in script.text
    css = httpx.get(cached.url + "/web/style.css", timeout=30)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert httpx.get(cached.url + "/web/../app.py", timeout=30).status_code == 404
    assert httpx.get(cached.url + "/web/nope.js", timeout=30).status_code == 404

    endpoints = set(re.findall(r'api\("(/[^"]+)"', script.text))
    assert endpoints == {"/v1/models", "/v1/chat/completions", "/v1/cache/stats"}
    # the page stores the key per tab and sends it as a bearer token
    assert "sessionStorage" in script.text and '"Bearer "' in script.text
    assert "stream_options" in script.text and "include_usage" in script.text
    for path in ("/v1/models", "/v1/cache/stats"):
        assert httpx.get(cached.url + path, timeout=30).status_code == 401
        assert cached.get(path).status_code == 200
    # the request the page sends, with the fields it reads back
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hello!"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 8, "temperature": 0}
    with httpx.stream("POST", cached.url + "/v1/chat/completions", json=body, headers=cached.headers(),
                      timeout=120) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    last = events[-1]
    assert last["usage"]["prompt_tokens"] > 0 and "cached_tokens" in last["usage"]["prompt_tokens_details"]
    timings = last["timings"]
    for key in ("render_ms", "tokenize_ms", "queue_ms", "lookup_ms", "restore_ms", "prefill_ms", "sample_ms",
                "ttft_ms", "decode_tokens_per_s", "prefilled_tokens"):
        assert isinstance(timings[key], (int, float)), key
    # the TTFT breakdown: the template and the tokenizer before the engine, the first sample inside TTFT
    assert timings["render_ms"] > 0 and timings["tokenize_ms"] > 0
    assert 0 < timings["sample_ms"] <= timings["ttft_ms"] and timings["prefill_ms"] <= timings["ttft_ms"]
    stats = cached.get("/v1/cache/stats").json()
    for key in ("lookups", "hits", "entries", "bytes", "budget_bytes", "refusals", "layers",
                "kv_cache_mode_effective", "running", "waiting"):
        assert key in stats, key
