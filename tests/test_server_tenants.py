"""A server others can reach: tenants by API key, the admin, limits, slow clients and fuzzed bodies.

One real `turnkv serve` on the bundled SmolLM2 with a key file (alice, bob, carol), an admin key,
a per-tenant share of a small prompt-cache budget and short read timeouts, driven over HTTP.
"""

from __future__ import annotations

import json
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import Server, require_model

MODEL = "smollm2-135m"
ADMIN = "admin-secret"
KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key"}
MAX_MESSAGES = 32
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4     # SmolLM2: layers x (k, v) x kv heads x head dim x float32


def key_file(path: Path, keys: dict[str, str]) -> None:
    path.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for t, k in keys.items()))


@pytest.fixture(scope="module")
def server():
    require_model(MODEL)
    folder = Path(tempfile.mkdtemp(prefix="turnkv-keys-"))
    keys = folder / "keys"
    key_file(keys, KEYS)
    # a tenant's share holds 180 tokens of state, the whole cache 3 shares: without the share, one
    # tenant's flood would push everyone else's entries out of the global LRU
    srv = Server.start(MODEL, "--api-keys", str(keys), "--admin-key", ADMIN,
                       "--cache-budget-mb", str(3 * 180 * KV_BYTES_PER_TOKEN / 2**20),
                       "--tenant-budget-mb", str(180 * KV_BYTES_PER_TOKEN / 2**20),
                       "--max-messages", str(MAX_MESSAGES), "--max-tokens", "2",
                       "--header-timeout", "1", "--body-timeout", "2")
    srv.keys = keys
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def chat(srv: Server, key: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", headers=auth(key), timeout=300,
                      json={"messages": messages, "temperature": 0, **extra})


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "You answer gardeners' questions in one short sentence."},
            {"role": "user", "content": text}]


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def stats(srv: Server, key: str) -> dict:
    r = httpx.get(srv.url + "/v1/cache/stats", headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tenants_never_reuse_each_others_prefixes(server):
    messages = ask("When do I sow the broad beans on the north bed?")
    chat(server, KEYS["alice"], messages)
    again = chat(server, KEYS["alice"], messages)
    assert cached(again) >= again.json()["usage"]["prompt_tokens"] - 1        # alice reuses her own
    assert cached(chat(server, KEYS["carol"], messages)) == 0                 # carol's first request
    assert cached(chat(server, KEYS["alice"], messages, cache_salt="another")) == 0   # salt: a new namespace


def test_x_api_key_is_the_same_tenant_as_bearer(server):
    """Anthropic's clients send the key as x-api-key: it maps to the same tenant, so alice's
    /v1/messages request reuses the prompt her chat request left, and carol's does not (carol
    reuses at most the system turn of her own earlier question)."""
    messages = ask("Can the courgettes go next to the pumpkins?")
    chat(server, KEYS["alice"], messages)

    def message(headers: dict) -> httpx.Response:
        return httpx.post(server.url + "/v1/messages", headers=headers, timeout=300, json={
            "model": "m", "max_tokens": 4, "temperature": 0, "system": messages[0]["content"],
            "messages": messages[1:]})

    mine = message({"x-api-key": KEYS["alice"]})
    assert mine.status_code == 200, mine.text
    usage = mine.json()["usage"]
    assert usage["cache_read_input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] - 1
    theirs = message({"x-api-key": KEYS["carol"]})
    assert theirs.status_code == 200
    assert theirs.json()["usage"]["cache_read_input_tokens"] < usage["cache_read_input_tokens"]
    wrong = message({"x-api-key": "nobody"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


def test_stats_are_per_tenant_and_the_admin_sees_all(server):
    chat(server, KEYS["bob"], ask("Which flowers help the bees?"))
    bob = stats(server, KEYS["bob"])
    assert bob["entries"] >= 1 and bob["lookups"] >= 1
    for private in ("tenants", "memory", "running", "waiting", "live_bytes"):
        assert private not in bob                       # nothing of other tenants' activity
    admin = stats(server, ADMIN)
    assert {"alice", "bob"} <= set(admin["tenants"]) and admin["lookups"] > bob["lookups"]
    memory = admin["memory"]
    assert memory["rss_bytes"] > memory["live_state_bytes"] > 0 and memory["prompt_cache_bytes"] == admin["bytes"]


def test_a_flood_by_one_tenant_evicts_only_its_own_entries(server):
    bob_q = ask("How far apart should the tomato plants go?")
    chat(server, KEYS["bob"], bob_q)
    bob_before = stats(server, KEYS["bob"])
    for i in range(12):      # alice floods unique prompts: past her share, and past the whole budget
        chat(server, KEYS["alice"], ask(f"Question number {i}: " + "why is the soil so dry " * 4))
    alice = stats(server, KEYS["alice"])
    assert alice["evictions"] > 0 and alice["bytes"] <= alice["budget_bytes"]
    assert stats(server, ADMIN)["tenant_budget_bytes"] * 3 == stats(server, ADMIN)["budget_bytes"]
    bob = stats(server, KEYS["bob"])
    assert bob["evictions"] == bob_before["evictions"] == 0 and bob["entries"] == bob_before["entries"]
    again = chat(server, KEYS["bob"], bob_q)
    assert cached(again) >= again.json()["usage"]["prompt_tokens"] - 1


def test_a_tenant_flushes_only_its_own_entries(server):
    bob_q = ask("Should I water the lettuce in the evening?")
    chat(server, KEYS["bob"], bob_q)
    chat(server, KEYS["alice"], ask("Is it too late for peas?"))
    bob_entries = stats(server, KEYS["bob"])["entries"]
    flushed = httpx.delete(server.url + "/v1/cache", headers=auth(KEYS["alice"]), timeout=60)
    assert flushed.status_code == 200 and flushed.json()["entries_removed"] >= 1
    assert stats(server, KEYS["alice"])["entries"] == 0
    assert stats(server, KEYS["bob"])["entries"] == bob_entries
    again = chat(server, KEYS["bob"], bob_q)
    assert cached(again) >= again.json()["usage"]["prompt_tokens"] - 1
    # another tenant's entries are the admin's to flush, not alice's
    denied = httpx.delete(server.url + "/v1/cache?tenant=bob", headers=auth(KEYS["alice"]), timeout=60)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_required"
    by_admin = httpx.delete(server.url + "/v1/cache?tenant=bob", headers=auth(ADMIN), timeout=60)
    assert by_admin.status_code == 200 and by_admin.json()["entries_removed"] == bob_entries
    assert stats(server, KEYS["bob"])["entries"] == 0


def test_metrics_need_the_admin_and_health_says_nothing_of_the_load(server):
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(server.url + "/metrics", headers=auth(KEYS["alice"]), timeout=30).status_code == 403
    metrics = httpx.get(server.url + "/metrics", headers=auth(ADMIN), timeout=30)
    assert metrics.status_code == 200 and "turnkv_rss_bytes" in metrics.text
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and set(health.json()) == {"status", "model"}
    assert httpx.get(server.url + "/v1/models", headers=auth("wrong"), timeout=30).status_code == 401


def test_keys_are_reloaded_on_sighup_and_a_broken_file_keeps_the_old_ones(server):
    def status(key: str) -> int:
        return httpx.get(server.url + "/v1/models", headers=auth(key), timeout=30).status_code

    assert status("erin-key") == 401
    key_file(server.keys, {**KEYS, "erin": "erin-key"})
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while status("erin-key") != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status("erin-key") == 200
    server.keys.write_text("a line with three fields\n")
    server.proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert status("erin-key") == 200 and status(KEYS["alice"]) == 200
    assert "NOT reloaded" in server.text()
    key_file(server.keys, KEYS)


def test_request_limits_are_checked_before_any_rendering(server):
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(MAX_MESSAGES + 1)]
    r = chat(server, KEYS["alice"], many)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    t0 = time.monotonic()
    huge = chat(server, KEYS["alice"], ask("soil " * 400_000))         # 2 MB: no 2048-token context holds it
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 10


def test_client_mistakes_that_used_to_be_500s(server):
    surrogate = httpx.post(server.url + "/v1/chat/completions", headers={**auth(KEYS["alice"]),
                           "Content-Type": "application/json"}, timeout=60,
                           content=b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}')
    assert surrogate.status_code == 400 and surrogate.json()["error"]["code"] == "invalid_unicode"
    assert surrogate.json()["error"]["param"] == "messages[0].content"
    assert chat(server, KEYS["alice"], ask("hi"), temperature=1e-40).status_code == 200
    headers = {**auth(KEYS["alice"]), "Content-Type": "application/json"}
    deep = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                      content=b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")    # nesting
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
    giant = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                       json={"prompt": [7] * 400_000, "max_tokens": 1})                  # a giant array
    assert giant.status_code == 400 and giant.json()["error"]["code"] == "context_length_exceeded"
    crowd = chat(server, KEYS["alice"], [{"role": "user", "content": "x"}] * 100_000)
    assert crowd.status_code == 400 and crowd.json()["error"]["code"] == "too_many_messages"
    nulls = {k: None for k in ("n", "stream", "stream_options", "temperature", "top_p", "presence_penalty",
                               "frequency_penalty", "logit_bias", "stop", "seed", "max_tokens", "user")}
    assert chat(server, KEYS["alice"], ask("hi"), **nulls).status_code == 200


def test_slow_clients_are_cut_off(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    # headers a byte at a time (slowloris): the connection is closed after --header-timeout
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert s.recv(100) == b"" and time.monotonic() - t0 < 15
    # a body that never completes: 408 after --body-timeout
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice-key\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
        assert s.recv(4096).startswith(b"HTTP/1.1 408")
    assert chat(server, KEYS["alice"], ask("still there?")).status_code == 200


# --- fuzz: generated bodies at every endpoint, no 5xx, no hang ---------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["\ud800", "\udfff x", "", "x" * 5000, "user", "assistant", "text", "image_url"]))
JUNK = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=10)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=30), JUNK)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.fixed_dictionaries({"url": st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "http://x/y.png",
                                                       "data:,", "not a url"])}), JUNK)}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "file", "refusal", "video"]), "x": JUNK}),
    JUNK)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
                          optional={"content": st.one_of(st.text(max_size=40), st.lists(PART, max_size=3), JUNK),
                                    "name": JUNK, "tool_calls": JUNK, "tool_call_id": JUNK}),
    JUNK)
SMALL = st.one_of(st.integers(min_value=-3, max_value=3), JUNK)
FIELDS = {
    "messages": st.one_of(st.lists(MESSAGE, max_size=5), JUNK), "prompt": st.one_of(
        st.text(max_size=40), st.lists(st.integers(min_value=-5, max_value=60_000), max_size=8), JUNK),
    "model": JUNK, "max_tokens": SMALL, "max_completion_tokens": SMALL, "temperature": JUNK, "top_p": JUNK,
    "top_k": SMALL, "seed": JUNK, "stop": JUNK, "n": SMALL, "stream": st.one_of(st.booleans(), JUNK),
    "stream_options": JUNK, "logprobs": JUNK, "top_logprobs": SMALL, "presence_penalty": JUNK,
    "frequency_penalty": JUNK, "logit_bias": JUNK, "cache_salt": JUNK, "ignore_eos": JUNK, "tools": JUNK,
    "tool_choice": JUNK, "response_format": JUNK, "echo": JUNK, "suffix": JUNK, "best_of": SMALL,
    "user": JUNK, "chat_template_kwargs": JUNK, "min_p": JUNK, "repetition_penalty": JUNK,
    "stop_token_ids": JUNK,
}
BODY = st.one_of(
    st.builds(lambda known, unknown: {**unknown, **known}, st.fixed_dictionaries({}, optional=FIELDS),
              st.dictionaries(st.text(max_size=6), JUNK, max_size=2)),
    JUNK)
ENDPOINTS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/cache/stats"), ("DELETE", "/v1/cache"), ("GET", "/health"), ("POST", "/v1/models"),
             ("GET", "/nowhere")]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(body=BODY, endpoint=st.sampled_from(ENDPOINTS[:2]) | st.sampled_from(ENDPOINTS),
       key=st.sampled_from([KEYS["alice"], KEYS["bob"], None, "wrong"]))
def test_fuzzed_bodies_never_get_a_5xx(server, body, endpoint, key):
    method, path = endpoint
    raw = json.dumps(body, allow_nan=True).encode()           # \\ud800 travels as a JSON escape
    r = httpx.request(method, server.url + path, content=raw, timeout=120,
                      headers={**auth(key), "Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
    if r.status_code >= 400 and path.startswith("/v1/"):
        err = r.json()["error"]                               # always the OpenAI error shape
        assert isinstance(err["message"], str) and err["type"]


def test_the_server_still_answers_after_the_fuzz(server):
    assert chat(server, KEYS["alice"], ask("one more?")).status_code == 200
    log = server.text()
    assert "internal error on" not in log and "the engine loop died" not in log and "Traceback" not in log
