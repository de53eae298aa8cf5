"""/v1/responses (the OpenAI Responses API) over a real `turnkv serve` on the bundled SmolLM2, with
an API key file of two tenants, driven by the official `openai` SDK and the OpenAI Agents SDK.

The oracle for a continued conversation is the same conversation sent whole under a fresh
``cache_salt`` (a namespace with nothing cached: a cold prefill). The 135M model does not call tools
on its own, so tool calls are forced with tool_choice, as in test_server_extras.py."""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from test_server import Server, require_model

MODEL = "smollm2-135m"
KEYS = {"alice": "alice-key", "bob": "bob-key"}
INSTRUCTIONS = "You are a weather assistant for travellers in Europe. Answer in one short sentence."
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": CITY, "strict": True}
CLOCK = {"type": "function", "name": "get_time", "description": "The local time of a city",
         "parameters": CITY, "strict": True}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server():
    require_model(MODEL)
    keys = Path(tempfile.mkdtemp(prefix="turnkv-keys-")) / "keys"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    srv = Server.start(MODEL, "--api-keys", str(keys))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def client(srv: Server, tenant: str = "alice") -> openai.OpenAI:
    return srv.client(KEYS[tenant])


def create(srv: Server, tenant: str = "alice", **kw):
    kw.setdefault("max_output_tokens", 16)
    return client(srv, tenant).responses.create(model="m", temperature=0, **kw)


def cold(**kw) -> dict:
    """A namespace of its own: nothing cached, the prompt prefilled from scratch."""
    return {"extra_body": {"cache_salt": uuid.uuid4().hex}, **kw}


def cached(r) -> int:
    return r.usage.input_tokens_details.cached_tokens


def test_plain_response_is_what_chat_completions_answers(server):
    r = create(server, instructions=INSTRUCTIONS, input="Is it sunny in Paris in May?")
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and r.output_text
    chat = client(server).chat.completions.create(
        model="m", temperature=0, max_completion_tokens=16,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Is it sunny in Paris in May?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")


def test_streamed_events_come_in_the_documented_order(server):
    kw = dict(instructions=INSTRUCTIONS, input="Name a city in Italy.", max_output_tokens=12)
    whole = create(server, **kw)
    events = list(create(server, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens > 0


def test_a_tool_call_and_its_output_round_trip(server):
    question = {"role": "user", "content": "What is the weather in Paris right now?"}
    kw = dict(instructions=INSTRUCTIONS, tools=[WEATHER, CLOCK], max_output_tokens=48)
    r1 = create(server, input=[question], tool_choice=FORCE_WEATHER, **kw)
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)

    # streamed: the call's item opens with the first token, its arguments stream as they are written
    events = list(create(server, input=[question], tool_choice=FORCE_WEATHER, stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.name == "get_weather" and events[2].item.arguments == ""
    assert "".join(e.delta for e in events[3:-3]) == events[-3].arguments == call.arguments
    assert events[-2].item.name == "get_weather" and events[-2].item.arguments == call.arguments
    assert [(o.type, o.name, o.arguments) for o in events[-1].response.output] == \
           [("function_call", "get_weather", call.arguments)]
    assert events[-1].response.output[0].call_id == events[2].item.call_id

    # the client runs the tool and sends the whole history back: the call's prompt and reply are reused
    history = [question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 18})}]
    r2 = create(server, input=history, **kw)
    assert r2.output[0].type == "message" and r2.output_text
    assert r1.usage.input_tokens < cached(r2) < r2.usage.input_tokens
    c2 = create(server, input=history, **cold(**kw))
    assert cached(c2) == 0 and c2.output_text == r2.output_text


def test_a_call_to_the_named_function_opens_with_the_first_token(server):
    question = {"role": "user", "content": "What is the weather in Paris right now?"}
    kw = dict(instructions=INSTRUCTIONS, tools=[WEATHER, CLOCK], max_output_tokens=1, stream=True)
    # one token in, the model has not written the name yet: the named call's item is open all the same
    events = list(create(server, input=[question], tool_choice=FORCE_WEATHER, **kw))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.incomplete"]
    assert (events[2].item.type, events[2].item.name, events[2].item.status) == \
           ("function_call", "get_weather", "in_progress")
    assert events[4].item.status == "incomplete" and events[4].item.arguments == ""
    # with the model free to pick among two, nothing opens before the name is written
    events = list(create(server, input=[question], tool_choice="required", **kw))
    assert all(e.item.type == "message" for e in events if e.type == "response.output_item.added")


def test_previous_response_id_continues_from_the_cached_state(server):
    first = {"role": "user", "content": "Which city is the capital of Norway?"}
    r1 = create(server, instructions=INSTRUCTIONS, input=[first])
    r2 = create(server, instructions=INSTRUCTIONS, previous_response_id=r1.id, input="And of Sweden?")
    assert r2.previous_response_id == r1.id
    # the whole first prompt and its reply, all but the reply's last token (never fed to the model)
    assert cached(r2) == r1.usage.input_tokens + r1.usage.output_tokens - 1
    explicit = [first, *[o.model_dump(exclude_none=True) for o in r1.output],
                {"role": "user", "content": "And of Sweden?"}]
    oracle = create(server, instructions=INSTRUCTIONS, input=explicit, **cold())
    assert cached(oracle) == 0 and oracle.usage.input_tokens == r2.usage.input_tokens
    assert oracle.output_text == r2.output_text

    stored = client(server).responses.retrieve(r2.id)
    assert stored.id == r2.id and stored.output_text == r2.output_text
    client(server).responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(r2.id)


def test_response_ids_belong_to_their_tenant(server):
    mine = create(server, "alice", input="Tell me a secret word.")
    with pytest.raises(openai.NotFoundError) as err:
        create(server, "bob", previous_response_id=mine.id, input="What did I ask?")
    assert err.value.body["param"] == "previous_response_id" and err.value.body["type"] == "invalid_request_error"
    for call in (client(server, "bob").responses.retrieve, client(server, "bob").responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    assert client(server, "alice").responses.retrieve(mine.id).output_text == mine.output_text   # still there
    unstored = create(server, "alice", input="Say hi.", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        create(server, "alice", previous_response_id=unstored.id, input="Again.")


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "{}"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_json_schema_text_format(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                               "temp_c": {"type": "integer", "minimum": -40, "maximum": 50}},
              "required": ["city", "temp_c"], "additionalProperties": False}
    r = create(server, input="Describe the weather in Rome as JSON.", max_output_tokens=40,
               text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


# ------------------------------------------------------------------------------ OpenAI Agents SDK


def test_openai_agents_sdk_runs_a_two_tool_agent_with_reuse(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        seen.append(("get_weather", city))
        return json.dumps({"city": city, "temp_c": 18, "sky": "clear"})

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time of a city."""
        seen.append(("get_time", city))
        return json.dumps({"city": city, "time": "14:05"})

    api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=600)
    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather, get_time],
                         model=agents.OpenAIResponsesModel("smollm2", api),
                         # forced on the first step; the SDK resets tool_choice after a tool ran
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48))

    async def session():
        first = await agents.Runner.run(agent, "What is the weather in Paris?")
        # the second run streams, continuing the first on the server (previous_response_id)
        second = agents.Runner.run_streamed(agent, "And in Rome?", previous_response_id=first.last_response_id)
        events = [e.data.type async for e in second.stream_events() if e.type == "raw_response_event"]
        return first, second, events

    first, second, events = asyncio.run(session())
    assert events.count("response.completed") == 2 and "response.function_call_arguments.done" in events
    assert seen == [("get_weather", "Paris"), ("get_weather", "Rome")]
    for run in (first, second):
        kinds = [type(item).__name__ for item in run.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        assert isinstance(run.final_output, str) and run.final_output
    steps = first.raw_responses + second.raw_responses
    assert [[o.type for o in r.output] for r in steps] == [["function_call"], ["message"]] * 2
    # every later request restores at least the whole prompt before it
    for before, after in zip(steps, steps[1:]):
        assert cached(after) >= before.usage.input_tokens
