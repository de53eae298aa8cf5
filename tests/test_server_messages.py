"""Anthropic's Messages API, /tokenize and /detokenize, and pydantic-ai as an agent framework, over
one real `turnkv serve` on the bundled SmolLM2 (prompt cache on, an API key), driven by the
official `anthropic` SDK (and raw httpx for the stream's exact events and what the SDK will not
send). The SDK speaks a newer API version that drops sampling parameters; the tests pin
temperature 0 through the body (and pydantic-ai through the 2023-06-01 version header) so the
tiny model's replies repeat."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

from test_server import API_KEY, Server, require_model

OLD_API = {"anthropic-version": "2023-06-01"}       # the version that still takes temperature
GREEDY = {"temperature": 0}
SYSTEM = "You are a helpful assistant for a community garden. Answer briefly."
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The local time of a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    require_model("smollm2-135m")
    srv = Server.start("smollm2-135m", api_key=API_KEY)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


def client(server: Server, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=600)


def salt() -> dict:
    """A fresh cache namespace: the request's first turn is cold whatever ran before."""
    return {**GREEDY, "cache_salt": uuid.uuid4().hex}


def reused(server: Server) -> int:
    return server.get("/v1/cache/stats").json()["tokens_reused"]


def count(c: anthropic.Anthropic, **kw) -> int:
    return c.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"}).input_tokens


def sse_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=600,
                      headers={"x-api-key": API_KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_plain_turns_report_reuse_as_cache_reads(server):
    c = client(server)
    extra = salt()
    first = [{"role": "user", "content": "What can we sow in the North garden this weekend?"}]
    kw = dict(model="m", max_tokens=12,
              system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}])
    m1 = c.messages.create(messages=first, extra_body=extra, **kw)
    assert m1.type == "message" and m1.role == "assistant" and m1.id.startswith("msg_")
    assert [b.type for b in m1.content] == ["text"] and m1.content[0].text
    assert m1.stop_reason in ("end_turn", "max_tokens") and m1.stop_sequence is None
    assert m1.usage.cache_read_input_tokens == 0 and m1.usage.cache_creation_input_tokens == 0
    assert m1.usage.input_tokens == count(c, messages=first, extra_body=extra, **kw)
    assert 1 <= m1.usage.output_tokens <= 12

    second = first + [{"role": "assistant", "content": m1.content[0].text},
                      {"role": "user", "content": [{"type": "text", "text": "How far apart should the beans go?"}]}]
    before = reused(server)
    m2 = c.messages.create(messages=second, extra_body=extra, **kw)
    u = m2.usage
    assert u.cache_read_input_tokens == reused(server) - before      # what the cache's stats counted
    assert u.cache_read_input_tokens >= m1.usage.input_tokens        # the whole first turn came back
    assert u.input_tokens + u.cache_read_input_tokens == count(c, messages=second, extra_body=extra, **kw)

    # the same conversation over chat completions: the same prompt and the same greedy reply
    chat = server.client().chat.completions.create(
        model="m", max_tokens=12, temperature=0, extra_body={"cache_salt": extra["cache_salt"]},
        messages=[{"role": "system", "content": SYSTEM}, *second[:2],
                  {"role": "user", "content": second[2]["content"][0]["text"]}])
    assert chat.choices[0].message.content == m2.content[0].text
    assert chat.usage.prompt_tokens == u.input_tokens + u.cache_read_input_tokens


def test_stream_events_in_order_and_equal_to_the_whole_reply(server):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "Name three vegetables."}],
            **salt()}
    whole = client(server).messages.create(**{k: body[k] for k in ("model", "max_tokens", "messages")},
                                           extra_body={k: body[k] for k in ("temperature", "cache_salt")})
    events = sse_events(server, body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    # the second request of the same prompt restores it: message_start already says so
    assert start["usage"]["cache_read_input_tokens"] > 0
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == \
           whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    with client(server).messages.stream(**{k: body[k] for k in ("model", "max_tokens", "messages")},
                                        extra_body={k: body[k] for k in ("temperature", "cache_salt")}) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == whole.content[0].text and streamed.usage.cache_read_input_tokens > 0


def test_stop_sequences_name_the_one_that_ended_the_reply(server):
    c = client(server)
    kw = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": "Describe a tomato plant."}])
    free = c.messages.create(**kw, extra_body=GREEDY).content[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]
    m = c.messages.create(**kw, stop_sequences=["zzqx", stop], extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == free[:free.index(stop)]


def test_tool_use_then_tool_result_round_trip_reuses(server):
    c = client(server)
    extra = salt()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", max_tokens=40, system=SYSTEM, tools=[WEATHER, CLOCK])
    m1 = c.messages.create(messages=messages, tool_choice={"type": "tool", "name": "get_weather"},
                           extra_body=extra, **kw)
    assert m1.stop_reason == "tool_use" and [b.type for b in m1.content] == ["tool_use"]
    call = m1.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and isinstance(call.input["city"], str)
    assert m1.usage.input_tokens == count(c, messages=messages, tool_choice={"type": "tool", "name": "get_weather"},
                                          extra_body=extra, **kw)

    # the same call streamed: a tool_use block whose input arrives as input_json_delta, as it is written
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        events = sse_events(server, {**kw, "messages": messages, "tool_choice": choice, **extra})
        starts = [d["content_block"] for n, d in events if n == "content_block_start"]
        assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["input"] == {}
        assert [n for n, _ in events][:3] == ["message_start", "ping", "content_block_start"]
        partials = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
        assert len(partials) > 1 and json.loads("".join(partials))["city"]
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert json.loads("".join(partials)) == call.input and starts[0]["name"] == "get_weather"
    with c.messages.stream(messages=messages, tool_choice={"type": "tool", "name": "get_weather"},
                           extra_body=extra, **kw) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", call.input)]

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    before = reused(server)
    m2 = c.messages.create(messages=messages, tool_choice={"type": "none"}, extra_body=extra,
                           **{**kw, "max_tokens": 8})
    assert m2.stop_reason in ("end_turn", "max_tokens") and m2.content[0].type == "text"
    # the first prompt (tools and system turn included) came back from the cache
    assert m2.usage.cache_read_input_tokens == reused(server) - before
    assert m2.usage.cache_read_input_tokens >= m1.usage.input_tokens


def test_a_call_to_the_named_tool_opens_with_the_first_token(server):
    body = {"model": "m", "max_tokens": 1, "system": SYSTEM, "tools": [WEATHER, CLOCK],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}], **salt()}
    # one token in, the model has not written the name yet: the named tool's block is open all the same
    events = sse_events(server, {**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_stop",
                                      "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    assert block["id"].startswith("toolu_") and events[4][1]["delta"]["stop_reason"] == "max_tokens"
    # with the model free to pick among two, nothing opens before the name is written
    events = sse_events(server, {**body, "tool_choice": {"type": "any"}})
    assert all(d["content_block"]["type"] == "text" for n, d in events if n == "content_block_start")


def test_errors_in_anthropic_shape(server):
    c = client(server)
    with pytest.raises(anthropic.AuthenticationError) as err:
        client(server, key="wrong").messages.create(model="m", max_tokens=4,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    for kw, needle in ((dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
                       (dict(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "tool", "name": "x"},
                             tools=[WEATHER]), "not in tools"),
                       (dict(messages=[{"role": "user", "content": [{"type": "document"}]}]), "document"),
                       (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
                           "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), "image")):
        with pytest.raises(anthropic.BadRequestError) as err:
            c.messages.create(model="m", max_tokens=4, **kw)
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
        assert needle in err.value.body["error"]["message"]
    for path, body, status, kind in (
            ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
            ("/v1/messages", {"max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}, 400,
             "invalid_request_error"),
            ("/v1/messages/nothing", {}, 404, "not_found_error")):
        r = httpx.post(server.url + path, json=body, headers={"x-api-key": API_KEY}, timeout=60)
        assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (status, "error", kind), r.text
    # the chat API keeps OpenAI's shape, and a Bearer key works on /v1/messages too
    r = httpx.post(server.url + "/v1/chat/completions", json={}, headers=server.headers())
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()
    r = httpx.post(server.url + "/v1/messages", headers=server.headers(), timeout=60, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_tokenize_and_detokenize_round_trip(server):
    def post(path: str, body: dict) -> dict:
        r = httpx.post(server.url + path, json=body, headers={"x-api-key": API_KEY}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    text = "Sow the beans 10 cm apart, then water them."
    ids = post("/tokenize", {"content": text})["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert post("/detokenize", {"tokens": ids}) == {"content": text, "prompt": text}
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    vllm = post("/tokenize", {"prompt": text})
    assert vllm["tokens"][-len(ids):] == ids and vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] > 0

    # with the chat template: the same tokens a chat request's prompt has
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which beds suit tomatoes?"}]
    chat = post("/tokenize", {"messages": messages})
    bare = post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and chat["count"] > bare["count"]
    assert post("/detokenize", {"tokens": chat["tokens"]})["content"].endswith("assistant\n")
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == chat["count"]
    assert count(client(server), model="m", messages=messages[1:], system=SYSTEM) == chat["count"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(server.url + "/tokenize", json={"content": "a", "prompt": "b"}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400


def test_pydantic_ai_agent_two_tool_round_trip(server):
    """pydantic-ai's Anthropic model drives an agent with two function tools: step 1 must call
    get_weather, step 2 get_time (forced per step: the bundled model is tiny), step 3 answers
    in text; every later step reuses the conversation so far."""
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=600,
                                   default_headers=OLD_API)
    forced = {1: ["get_weather"], 2: ["get_time"]}
    fresh = {"cache_salt": uuid.uuid4().hex}
    agent = Agent(AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(anthropic_client=sdk)),
                  instructions=SYSTEM, model_settings=lambda ctx: {
                      "tool_choice": forced.get(ctx.run_step, "none"), "temperature": 0.0,
                      "max_tokens": 40 if ctx.run_step in forced else 8,
                      "extra_body": fresh})
    calls = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(("get_weather", city))
        return f"Sunny, 21 C in {city}"

    @agent.tool_plain
    def get_time(city: str) -> str:
        """The local time of a city."""
        calls.append(("get_time", city))
        return f"14:05 in {city}"

    before = reused(server)
    result = agent.run_sync("What are the weather and the time in Paris?")
    assert [name for name, _ in calls] == ["get_weather", "get_time"] and all(city for _, city in calls)
    assert isinstance(result.output, str) and result.output
    usages = [m.usage for m in result.all_messages() if hasattr(m, "usage") and m.usage is not None]
    assert len(usages) == 3
    reads = [u.cache_read_tokens for u in usages]
    assert reads[0] == 0                      # a fresh question: nothing to reuse
    assert reads[1] >= usages[0].input_tokens and reads[2] >= usages[1].input_tokens    # each step reuses the last
    assert sum(reads) == reused(server) - before
