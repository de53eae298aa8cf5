"""The Responses API's request translation without a model: input items into chat messages, a
response's own output items read back as the history message the server stores (the condition for
previous_response_id and an explicit history to render the same tokens), the per-tenant store's
bounds, and fuzzed bodies that may only ever be refused with a RequestError (a 400), never crash.
The HTTP round trips are in test_server_responses.py."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from turnkv.server import tools as toolkit
from turnkv.server.response_store import ResponseStore
from turnkv.server.responses_input import ResponsesRequest, chat_request, input_messages
from turnkv.server.responses_output import assistant_message, call_item, message_item
from turnkv.server.requests import parse
from turnkv.server.schemas import RequestError

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                             {"type": "input_text", "text": "In Paris."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 18}'},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "14:05"}]}]
    msgs = input_messages(items)
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]      # both calls: one turn
    assert msgs[4] == {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}
    chat = chat_request(ResponsesRequest(input=items, instructions="Sys."), msgs).template_messages()
    assert chat[0] == {"role": "system", "content": "Sys."} and chat[1]["role"] == "system"
    assert chat[2]["content"] == "Weather?\nIn Paris."
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_a_reply_read_back_from_its_output_items_is_the_stored_message():
    for text in (CALL_TEXT, "Let me check.\n" + CALL_TEXT, "Sunny and 18 degrees."):
        content, calls = toolkit.parse(text, toolkit.HERMES)
        output = ([] if content is None else [message_item("msg_1", content, "completed")]) + \
                 [call_item(c) for c in calls]
        assert input_messages(json.loads(json.dumps(output))) == [assistant_message(content, calls)]


def test_the_store_is_bounded_per_tenant_and_never_crosses_tenants():
    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(5):
        store.put("alice", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert [store.get("alice", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("bob", "r4") is None and not store.delete("bob", "r4") and store.get("alice", "r4")
    store.get("alice", "r2")                                          # used: the LRU keeps it
    store.put("alice", {"id": "big"}, [{"role": "user", "content": "y" * 9_000}])
    assert store.get("alice", "r2") is not None and store.get("alice", "r3") is None


JUNK = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "x"])},
                             optional={"text": JUNK, "image_url": JUNK, "refusal": JUNK})
ITEM = st.fixed_dictionaries(
    {}, optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
                  "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                  "content": st.text(max_size=8) | st.lists(PART, max_size=2) | JUNK,
                  "call_id": st.text(max_size=4) | JUNK, "name": st.text(max_size=4) | JUNK,
                  "arguments": st.text(max_size=8) | JUNK, "output": st.text(max_size=8) | JUNK})
BODY = st.fixed_dictionaries({}, optional={
    "input": st.text(max_size=8) | st.lists(ITEM, max_size=4) | JUNK, "instructions": JUNK,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"])},
                                            optional={"name": JUNK, "parameters": JUNK}), max_size=2) | JUNK,
    "tool_choice": JUNK, "text": JUNK, "max_output_tokens": JUNK, "temperature": JUNK, "include": JUNK,
    "truncation": JUNK, "reasoning": JUNK, "store": JUNK, "metadata": JUNK})


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=BODY)
def test_fuzzed_bodies_are_refused_only_as_request_errors(body):
    try:
        req = parse(ResponsesRequest, body)
        req.refuse_unsupported()
        chat_request(req, input_messages(req.input))
    except RequestError as err:
        assert err.status == 400 and err.message
