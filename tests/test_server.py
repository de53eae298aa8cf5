"""The OpenAI-compatible server, end to end: real `turnkv serve` processes on loopback ports,
driven by the official `openai` client (and raw httpx for what a client library will not send).

Two servers on the bundled SmolLM2 start once for the whole module: one with the prompt cache and
an API key, one with --no-prompt-cache (the oracle: what a cold prefill of every turn gives).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))          # bench/ holds the shared benchmark conversation

from bench.conversation import SYSTEM_PROMPT  # noqa: E402
from turnkv.loading.bundled import find_bundled  # noqa: E402
from turnkv.server.tenants import tenant_key  # noqa: E402

API_KEY = "test-key-123"
MAX_CONTEXT = 2048
START_TIMEOUT_S = 600         # two model loads on a busy 2-core machine
REPLY_TOKENS = 10
# Short questions after the long shared system prompt: each turn adds ~20 tokens to a history of
# 550+, so a server that reuses the history reports well over 90% of every prompt as cached.
QUESTIONS = [
    "What can we sow at the North garden this weekend?",
    "How far apart should the beans go?",
    "Which beds are safe for tomatoes?",
    "How do we keep slugs off the lettuce?",
    "Which flowers help Mira's bees?",
    "Write one line for the assembly about a water tank.",
    "Who waters the Hill garden in July?",
    "What is the first thing to do for the festival?",
]


def require_model(name: str) -> None:
    installed, _ = find_bundled(name)
    if not installed:
        pytest.skip(f"bundled model {name} is not installed")


@dataclass
class Server:
    proc: subprocess.Popen
    log: Path
    model: str
    url: str = ""
    api_key: str | None = None

    @classmethod
    def start(cls, model: str, *flags: str, api_key: str | None = None) -> "Server":
        log = Path(tempfile.mkstemp(prefix="turnkv-server-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "turnkv.cli", "serve", "-m", model, "--port", "0",
               "--max-context", str(MAX_CONTEXT), *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        # output to a file, never a pipe nobody drains (a full pipe would block the server)
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(proc, log, model, api_key=api_key)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            if not self.url:
                found = re.search(r"serving \S+ at (http://[^\s]+)", self.text())
                self.url = found.group(1) if found else ""
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        # the server's log goes to the captured output: pytest shows it when a test failed
        print(f"--- {self.model} server log (tail) ---\n{self.text()[-4000:]}")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key or "none",
                             max_retries=0, timeout=600)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60)


def start_servers(model: str) -> tuple[Server, Server]:
    require_model(model)
    # both load at once: model loading is mostly waiting on dequantization, and it halves the wait
    cached = Server.start(model, api_key=API_KEY)
    cold = Server.start(model, "--no-prompt-cache")
    try:
        cached.wait_ready()
        cold.wait_ready()
    except BaseException:
        cached.stop()
        cold.stop()
        raise
    return cached, cold


@pytest.fixture(scope="module")
def servers():
    cached, cold = start_servers("smollm2-135m")
    yield cached, cold
    cached.stop()
    cold.stop()


@pytest.fixture(scope="module")
def cached(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def cold(servers) -> Server:
    return servers[1]


# ------------------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def chat(server: Server, messages: list[dict], stream: bool, max_tokens: int = REPLY_TOKENS,
         **extra) -> Reply:
    client = server.client()
    if not stream:
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                           temperature=0, **extra)
        return Reply(r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens,
                     r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens)
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **extra):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "include_usage must bring a usage chunk"
    return Reply("".join(pieces), finish, usage.prompt_tokens, usage.completion_tokens,
                 usage.prompt_tokens_details.cached_tokens)


def play(server: Server, stream: bool, **extra) -> tuple[list[dict], list[Reply]]:
    """The 8-turn conversation; returns the last turn's messages and every reply."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = chat(server, messages, stream, **extra)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.text})
    return messages[:-1], replies


def metric_samples(server: Server) -> dict[str, list]:
    # a server with an API key serves /metrics to its admin only (with one --api-key, that key)
    text = httpx.get(server.url + "/metrics", headers=server.headers(), timeout=60).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def metric(server: Server, name: str, **labels) -> float:
    samples = metric_samples(server).get(name, [])
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


# --------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def conversation(servers):
    """The 8 turns on both servers: streamed from the cached one, not streamed from the cold one."""
    cached, cold = servers
    last_messages, warm = play(cached, stream=True)
    _, oracle = play(cold, stream=False)
    return last_messages, warm, oracle


def check_conversation(warm: list[Reply], oracle: list[Reply]) -> None:
    for turn, (w, o) in enumerate(zip(warm, oracle), start=1):
        assert (w.text, w.finish_reason, w.prompt_tokens, w.completion_tokens) == \
               (o.text, o.finish_reason, o.prompt_tokens, o.completion_tokens), f"turn {turn}"
        assert o.cached_tokens == 0, "--no-prompt-cache must never report cached tokens"
        if turn > 1:
            assert w.cached_tokens >= 0.9 * w.prompt_tokens, f"turn {turn}: {w}"
            assert w.cached_tokens < w.prompt_tokens
    assert all(r.completion_tokens >= 1 and r.finish_reason in ("stop", "length") for r in warm)


def test_eight_turn_reuse_is_exact_and_cached(conversation):
    check_conversation(*conversation[1:])


@pytest.mark.slow
@pytest.mark.real
def test_eight_turn_reuse_gemma3():
    """Gemma 3: sliding-window layers (window 512) whose ring wraps during the conversation."""
    cached, cold = start_servers("gemma3-270m")
    try:
        last_messages, warm = play(cached, stream=True)
        _, oracle = play(cold, stream=False)
        check_conversation(warm, oracle)
        other = chat(cached, last_messages, stream=False, max_tokens=1, extra_body={"cache_salt": "other"})
        assert other.cached_tokens == 0
    finally:
        cached.stop()
        cold.stop()


def test_cache_salt_isolates_tenants(cached, conversation):
    last_messages = conversation[0]           # tenant A (the key, no salt) played it on the cached server
    b = chat(cached, last_messages, stream=False, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    assert b.cached_tokens == 0
    b_again = chat(cached, last_messages, stream=True, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    assert b_again.cached_tokens >= 0.9 * b_again.prompt_tokens     # B reuses its own prefix
    a_again = chat(cached, last_messages, stream=False, max_tokens=1)
    assert a_again.cached_tokens >= 0.9 * a_again.prompt_tokens
    c = chat(cached, last_messages, stream=False, max_tokens=1, extra_body={"cache_salt": "tenant-c"})
    assert c.cached_tokens == 0


def test_tenant_key_separates_keys_and_salts():
    assert tenant_key(None, None) == ""
    keys = {tenant_key(k, s) for k in (None, "k1", "k2") for s in (None, "s1", "s2")}
    assert len(keys) == 9
    assert tenant_key("k1", "s1") == tenant_key("k1", "s1")
    assert "k1" not in tenant_key("k1", None)


def test_cache_stats_show_hits_and_kv_modes(cached, cold, conversation):
    stats = cached.get("/v1/cache/stats").json()
    assert stats["hits"] >= 7 and stats["tokens_reused"] > 0 and stats["entries"] > 0 and stats["bytes"] > 0
    assert stats["prompt_cache_enabled"] is True
    from turnkv.models.weights import native_kernels_built    # the default: gguf when built

    gguf = native_kernels_built()
    assert stats["weights"] == ("gguf" if gguf else "native") and stats["dtype"] == "float32"
    # --kv-cache-mode auto: float16 KV under the gguf weights, the compute dtype otherwise
    assert stats["kv_cache_mode_effective"] == ["fp16" if gguf else "native"] * 30
    assert stats["namespaces"] >= 2          # the tenants above
    threads = stats["threads"]               # --adaptive-threads on by default: gguf weights, 2+ threads
    assert threads["adaptive"] == ("on" if gguf and threads["most"] > 1 else "off")
    assert 1 <= threads["current"] <= threads["most"]
    off = cold.get("/v1/cache/stats").json()
    assert off["prompt_cache_enabled"] is False and off["hits"] == 0 and off["entries"] == 0


def test_metrics_parse_and_count(cached, conversation):
    samples = metric_samples(cached)
    assert metric(cached, "turnkv_requests_total", endpoint="/v1/chat/completions", outcome="ok") >= 8
    queries = metric(cached, "turnkv_prompt_cache_query_tokens_total")
    hits = metric(cached, "turnkv_prompt_cache_hit_tokens_total")
    assert 0 < hits < queries
    assert metric(cached, "turnkv_prompt_tokens_total") == queries
    assert metric(cached, "turnkv_generation_tokens_total") > 0
    for hist in ("turnkv_time_to_first_token_seconds", "turnkv_e2e_request_latency_seconds"):
        assert samples[hist + "_count"][0].value >= 8
        assert samples[hist + "_sum"][0].value > 0
    assert "turnkv_prompt_cache_bytes" in samples and "turnkv_requests_pending" in samples
    assert samples["turnkv_compute_threads"][0].value >= 1


def test_models_and_health(cached):
    models = cached.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    health = httpx.get(cached.url + "/health", timeout=10)      # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"
    missing = httpx.post(cached.url + "/v1/tokenize", json={}, headers=cached.headers(), timeout=10)
    assert missing.status_code == 404          # no such route: still the OpenAI error shape
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_completions_text_and_token_ids(cached, cold):
    client = cached.client()
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    ref = cold.client().completions.create(model="smollm2-135m", prompt="The capital of France is",
                                           max_tokens=6, temperature=0)
    assert r.choices[0].text == ref.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text

    by_ids = client.completions.create(model="smollm2-135m", prompt=[504, 3575, 282, 4649, 314], max_tokens=4,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == 5 and by_ids.usage.completion_tokens == 4
    by_ids_cold = cold.client().completions.create(model="smollm2-135m", prompt=[[504, 3575, 282, 4649, 314]],
                                                   max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_ids_cold.choices[0].text


def test_stop_strings_and_token_limits(cached):
    messages = [{"role": "user", "content": "Describe the sea in one sentence."}]
    free = chat(cached, messages, stream=False, max_tokens=12)
    assert free.finish_reason == "length" and free.completion_tokens == 12
    middle = len(free.text) // 2
    stop = free.text[middle:middle + 3]          # a stop string the reply is known to contain
    assert len(stop) == 3, free.text
    for stream in (False, True):
        stopped = chat(cached, messages, stream=stream, max_tokens=12, stop=["@@never@@", stop])
        assert stopped.finish_reason == "stop"
        assert stopped.text == free.text[:free.text.index(stop)]
        assert stopped.completion_tokens <= free.completion_tokens
    limited = cached.client().chat.completions.create(model="m", messages=messages, max_completion_tokens=3,
                                                      temperature=0)
    assert limited.usage.completion_tokens == 3 and limited.choices[0].finish_reason == "length"
    assert free.text.startswith(limited.choices[0].message.content)


def test_seeded_sampling_repeats(cached):
    client = cached.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    outs = [client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=1.0,
                                           top_p=0.9, seed=1234).choices[0].message.content for _ in range(2)]
    assert outs[0] == outs[1]


def test_ten_concurrent_clients(cached, cold):
    prompts = [[{"role": "user", "content": f"Give me one fact about the number {i}."}] for i in range(10)]
    expected = [chat(cold, p, stream=False, max_tokens=4) for p in prompts]
    with ThreadPoolExecutor(max_workers=10) as pool:
        got = list(pool.map(lambda ip: chat(cached, ip[1], stream=ip[0] % 2 == 0, max_tokens=4),
                            enumerate(prompts)))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert (g.text, g.completion_tokens, g.prompt_tokens) == (e.text, e.completion_tokens, e.prompt_tokens), i


def test_disconnect_mid_stream_cancels_and_server_stays_correct(cached, cold):
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    cancelled_before = metric(cached, "turnkv_requests_total", outcome="cancelled")
    body = {"model": "m", "messages": messages, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", cached.url + "/v1/chat/completions", json=body, headers=cached.headers()) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 3:
                    break          # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 120
    while metric(cached, "turnkv_requests_total", outcome="cancelled") <= cancelled_before:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.2)
    assert httpx.get(cached.url + "/health", timeout=10).status_code == 200
    # the same prompt again reuses what the cancelled run left in the cache; it must equal a cold run
    after = chat(cached, messages, stream=False, max_tokens=8)
    assert after.text == chat(cold, messages, stream=False, max_tokens=8).text


def _bad_requests(server: Server) -> list[tuple[str, dict, int, str | None]]:
    """(name, httpx request kwargs, expected status, expected error param)."""
    chat_url = server.url + "/v1/chat/completions"
    auth = server.headers()
    ok_msgs = [{"role": "user", "content": "hi"}]

    def post(body=None, raw=None, headers=None, url=chat_url):
        kw = {"method": "POST", "url": url, "headers": {**auth, **(headers or {})}}
        if raw is not None:
            kw["content"] = raw
        else:
            kw["json"] = body
        return kw

    return [
        ("malformed json", post(raw=b'{"messages": [', headers={"content-type": "application/json"}), 400, None),
        ("not an object", post(body=[1, 2]), 400, None),
        ("empty body", post(raw=b""), 400, None),
        ("missing messages", post(body={"model": "m"}), 400, "messages"),
        ("empty messages", post(body={"messages": []}), 400, "messages"),
        ("messages not a list", post(body={"messages": "hi"}), 400, "messages"),
        ("unknown role", post(body={"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role"),
        ("content wrong type", post(body={"messages": [{"role": "user", "content": 5}]}), 400,
         "messages[0].content"),
        ("max_tokens negative", post(body={"messages": ok_msgs, "max_tokens": -1}), 400, "max_tokens"),
        ("max_tokens string", post(body={"messages": ok_msgs, "max_tokens": "5"}), 400, "max_tokens"),
        ("max_tokens huge", post(body={"messages": ok_msgs, "max_tokens": 10**12}), 400, "max_tokens"),
        ("temperature out of range", post(body={"messages": ok_msgs, "temperature": 7}), 400, "temperature"),
        ("stop wrong type", post(body={"messages": ok_msgs, "stop": [1]}), 400, "stop"),
        ("n above --max-n", post(body={"messages": ok_msgs, "n": 17}), 400, "n"),
        ("prompt over the context", post(body={"messages": [{"role": "user", "content": "hello " * MAX_CONTEXT}]}),
         400, "messages"),
        ("completion prompt over the context", post(url=server.url + "/v1/completions",
                                                    body={"prompt": [1] * (MAX_CONTEXT + 5)}), 400, "prompt"),
        ("token id outside the vocabulary", post(url=server.url + "/v1/completions",
                                                 body={"prompt": [1, 10**9]}), 400, None),
        ("batched prompts", post(url=server.url + "/v1/completions", body={"prompt": ["a", "b"]}), 400, "prompt"),
        ("oversized body", post(raw=b'{"messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}'),
         413, None),
        ("wrong api key", post(body={"messages": ok_msgs}, headers={"Authorization": "Bearer nope"}), 401, None),
        ("wrong method", {"method": "GET", "url": chat_url, "headers": auth}, 405, None),
    ]


def test_burst_of_bad_requests_between_good_ones(cached):
    def good() -> str:
        r = httpx.post(cached.url + "/v1/completions", headers=cached.headers(), timeout=120,
                       json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    reference = good()
    with httpx.Client(timeout=120) as http:
        for i, (name, kwargs, status, param) in enumerate(_bad_requests(cached)):
            try:
                r = http.request(**kwargs)
            except httpx.TransportError:
                # the server may close the socket on an oversized body before reading it all
                assert status == 413, name
                continue
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert isinstance(err["message"], str) and err["message"], name
            if param is not None:
                assert err["param"] == param, (name, err)
            if i % 4 == 3:
                assert good() == reference
    assert good() == reference
    assert httpx.get(cached.url + "/health", timeout=10).status_code == 200
    assert metric(cached, "turnkv_requests_total", outcome="rejected") >= 15


def test_openai_client_errors(cached):
    client = cached.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=17)
    assert err.value.status_code == 400 and "--max-n" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi " * MAX_CONTEXT}],
                                       stream=True)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        cached.client(api_key="wrong").models.list()


def test_flush_empties_the_cache(cached):
    messages = [{"role": "user", "content": "Say something about rivers."}]
    chat(cached, messages, stream=False, max_tokens=2)
    assert chat(cached, messages, stream=False, max_tokens=2).cached_tokens > 0
    r = httpx.delete(cached.url + "/v1/cache", headers=cached.headers(), timeout=60)
    assert r.status_code == 200 and r.json()["flushed"] is True and r.json()["entries_removed"] > 0
    assert cached.get("/v1/cache/stats").json()["entries"] == 0
    assert chat(cached, messages, stream=False, max_tokens=2).cached_tokens == 0
    assert httpx.delete(cached.url + "/v1/cache", timeout=60).status_code == 401    # needs the key


# ------------------------------------------------------------------- sampling and scoring (issue 17)


def test_chat_logprobs_shape_values_and_stream(cached, cold):
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    kw = dict(model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    r = cached.client().chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert bytes(e.bytes).decode("utf-8") == e.token and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(v) for v in lps) <= 1 + 1e-6
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob   # greedy
    # the same numbers from a cold server (the engine's logits are reuse-exact) and from a stream
    ref = cold.client().chat.completions.create(**kw).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in ref] == [(e.token, e.logprob) for e in content]
    streamed = []
    for chunk in cached.client().chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
           [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]
    plain = cached.client().chat.completions.create(model="m", messages=messages, max_tokens=2, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []
    assert cached.client().chat.completions.create(model="m", messages=messages, max_tokens=2).choices[0].logprobs \
        is None


def test_completions_logprobs_legacy_shape(cached):
    kw = dict(model="m", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
    r = cached.client().completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == value and len(top) <= 3 and max(top.values()) == value
    streamed = [c.choices[0].logprobs for c in cached.client().completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_n_choices_share_one_prefill_over_http(cached, cold):
    messages = [{"role": "user", "content": "Suggest a name for a small grey cat, please."}]
    one = cold.client().chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    before = cached.get("/v1/cache/stats").json()["tokens_prefilled"]
    r = cached.client().chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, n=3)
    after = cached.get("/v1/cache/stats").json()["tokens_prefilled"]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens                       # the prompt counted once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert after - before == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens   # prefilled once
    # seeded and streamed: chunks carry each choice's index; choice i repeats (and equals seed + i alone)
    kw = dict(model="m", messages=messages, max_tokens=8, temperature=1.0, seed=77, n=2)
    whole = cold.client().chat.completions.create(**kw)
    texts, finish = {0: "", 1: ""}, {}
    for chunk in cached.client().chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices} and set(finish) == {0, 1}
    alone = cold.client().chat.completions.create(**{**kw, "n": 1, "seed": 78})
    assert alone.choices[0].message.content == whole.choices[1].message.content
    texts = cached.client().completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text == texts.choices[1].text


def test_penalties_bias_and_stop_token_ids(cached, cold):
    messages = [{"role": "user", "content": "Repeat the word apple ten times."}]
    kw = dict(model="m", messages=messages, max_tokens=12, temperature=0)
    plain = cached.client().chat.completions.create(**kw, logprobs=True)
    penalized = dict(presence_penalty=1.5, frequency_penalty=1.0,
                     extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    got = cached.client().chat.completions.create(**kw, **penalized)
    assert got.choices[0].message.content == cold.client().chat.completions.create(**kw, **penalized) \
        .choices[0].message.content
    assert got.choices[0].message.content != plain.choices[0].message.content
    # +100 on one token (id 1000): greedy picks nothing else; that token as a stop_token_id ends at once
    forced = cached.client().chat.completions.create(**{**kw, "max_tokens": 4}, logprobs=True,
                                                     logit_bias={"1000": 100})
    tokens = [e.token for e in forced.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1
    stopped = cached.client().chat.completions.create(**kw, logit_bias={"1000": 100},
                                                      extra_body={"stop_token_ids": [1000]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].message.content == ""
    # logprobs stay those of the raw distribution: the forced token was not the model's own choice
    assert forced.choices[0].logprobs.content[0].logprob < plain.choices[0].logprobs.content[0].logprob


def test_null_fields_tiny_temperature_and_bad_values(cached):
    url, headers = cached.url + "/v1/chat/completions", cached.headers()
    msgs = [{"role": "user", "content": "Say hello."}]
    nulls = {k: None for k in ("n", "stream", "stream_options", "temperature", "top_p", "presence_penalty",
                               "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stop", "seed",
                               "max_tokens", "max_completion_tokens", "user", "top_k", "min_p",
                               "repetition_penalty", "stop_token_ids", "ignore_eos", "cache_salt", "model")}
    greedy = httpx.post(url, json={"messages": msgs, "max_tokens": 5, "temperature": 0}, headers=headers, timeout=120)
    assert greedy.status_code == 200, greedy.text
    r = httpx.post(url, json={"messages": msgs, **nulls}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    tiny = httpx.post(url, json={"messages": msgs, "max_tokens": 5, "temperature": 1e-40}, headers=headers,
                      timeout=120)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    ok = httpx.post(cached.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": None,
                                                         "n": None, "echo": None, "best_of": None},
                    headers=headers, timeout=120)
    assert ok.status_code == 200, ok.text
    bad = [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
           ({"logit_bias": {"49152": 5}}, "logit_bias"), ({"logit_bias": {"abc": 5}}, "logit_bias"),
           ({"logit_bias": {"5": 101}}, "logit_bias"), ({"n": 0}, "n"), ({"n": 17}, "n"),
           ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
           ({"presence_penalty": 3}, "presence_penalty"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
           ({"messages": None}, "messages")]
    for fields, param in bad:
        r = httpx.post(url, json={"messages": msgs, **fields}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    for raw in (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": Infinity}',
                b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -Infinity}}'):
        r = httpx.post(url, content=raw, headers={**headers, "content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (raw, r.text)
    r = httpx.post(cached.url + "/v1/completions", json={"prompt": "hi", "logprobs": 21}, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_warm_up_does_the_vocabulary_scan_before_any_request():
    """``serve`` calls warm_up before accepting: the prompt-size bound the first request checks
    is already known (the longest vocabulary entry), and it refuses exactly past context x it."""
    from types import SimpleNamespace

    from turnkv.loading import load_tokenizer
    from turnkv.server.requests import RequestError, check_text_size, warm_up

    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("the bundled SmolLM2 is not installed")
    tokenizer = load_tokenizer("smollm2-135m")
    engine = SimpleNamespace(tokenizer=tokenizer, max_context=64)
    warm_up(engine)
    longest = max(len(t) for t in tokenizer.backend.get_vocab())
    assert engine._max_token_chars == longest > 1
    check_text_size(engine, 64 * longest, "messages")
    with pytest.raises(RequestError):
        check_text_size(engine, 64 * longest + 1, "messages")
    assert getattr(tokenizer, "_llguidance", None) is None     # the grammar view is not on this path


def test_grammar_view_is_built_once_the_server_answers_and_only_for_a_tools_template():
    """The grammar engine's vocabulary view (forced tool calls compile against it) is built on
    a thread of its own after the server answers, not before: the thread waits for
    ``answering()``, and a stop before that ends it without building."""
    import threading
    from types import SimpleNamespace

    from turnkv.engine.grammar import ll_tokenizer
    from turnkv.loading import load_tokenizer, shipped_template
    from turnkv.server.requests import grammar_warm_up_thread

    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("the bundled SmolLM2 is not installed")
    tokenizer = load_tokenizer("smollm2-135m")
    plain = grammar_warm_up_thread(SimpleNamespace(tokenizer=tokenizer), lambda: True, threading.Event())
    plain.join(30)
    assert getattr(tokenizer, "_llguidance", None) is None     # no tools in the template: stays lazy

    tools = tokenizer.with_template(shipped_template("chatml-tools"))
    answering, stop = threading.Event(), threading.Event()
    thread = grammar_warm_up_thread(SimpleNamespace(tokenizer=tools), answering.is_set, stop)
    thread.join(0.2)
    assert thread.is_alive() and getattr(tools, "_llguidance", None) is None
    answering.set()
    thread.join(30)
    assert not thread.is_alive() and tools._llguidance is ll_tokenizer(tools)

    stopped = tokenizer.with_template(shipped_template("chatml-tools"))
    stop = threading.Event()
    thread = grammar_warm_up_thread(SimpleNamespace(tokenizer=stopped), lambda: False, stop)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and getattr(stopped, "_llguidance", None) is None


def test_the_model_load_imports_none_of_the_modules_serve_imports_beside_it():
    """``serve`` imports the HTTP side's modules on a thread while the main thread loads the model
    (server/serve.py): every name it lists exists (the thread drops a failed import silently), and
    the load itself imports none of them, so neither thread waits on the other's module locks."""
    import importlib

    from turnkv.server.serve import HTTP_MODULES

    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("the bundled SmolLM2 is not installed")
    for name in HTTP_MODULES:
        importlib.import_module(name)
    probe = ("import sys\n"
             "import turnkv.engine.engine as e\n"
             "before = set(sys.modules)\n"
             "e.Engine.load('smollm2-135m', progress=False)\n"
             "print(' '.join(sorted(set(sys.modules) - before)))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.split()
    assert "turnkv.models.llama" in loaded        # the probe saw the load's own imports
    packages = {"turnkv.server"} | {name.split(".")[0] for name in HTTP_MODULES if not name.startswith("turnkv.")} \
        | {"starlette", "pydantic"}
    assert not [m for m in loaded if any(m == p or m.startswith(p + ".") for p in packages)]
