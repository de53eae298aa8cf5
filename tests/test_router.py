"""turnkv as a worker of a maintained router: the real sglang-router binary (its PyPI package, a
test extra) in front of two `turnkv serve --threads 1` replicas of the bundled SmolLM2 that share
one Redis tier (a real redis-server, tests/redis_server.py), all on loopback.

Asserted, as docs/scale-out.md promises: the router discovers the model's name from the replicas'
/server_info and names it in its own /v1/models; the fields it adds to every body are honoured
(ignore_eos generates past the end-of-sequence token) or refused by name; its cache-aware policy
keeps each conversation on one replica, whose memory serves every later turn; and a replica killed
while it streams a reply loses no conversation: each goes on on the other replica with the text a
server without a prompt cache (the oracle, started beside them) gives, restored from Redis, then
from the survivor's memory.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from redis_server import RedisServer, require_redis
from test_server import ROOT, Server, require_model
from test_tiers_server import wait_written

MODEL = "smollm2-135m"
pytestmark = pytest.mark.real
REPLY_TOKENS = 8
TOPICS = ["the bakery's sourdough schedule", "a bicycle repair workshop", "the choir's winter concert",
          "the library's map collection", "a rooftop beehive", "the harbour ferry timetable"]
FOLLOW_UPS = ["Give one more detail.", "And what should we avoid?", "Summarise that in five words."]
AFTER_LOSS = ["Who should I ask about it?", "Thank you. Anything else?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """``python -m sglang_router.launch_router`` as a user runs it (docs/scale-out.md)."""

    MODULE, LOG_LEVEL = "sglang_router.launch_router", "warn"

    def __init__(self, workers: list[str], policy: str = "cache_aware"):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = Path(tempfile.mkstemp(prefix="turnkv-router-", suffix=".log")[1])
        cmd = [sys.executable, "-m", self.MODULE, "--worker-urls", *workers,
               "--policy", policy, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
               "--log-level", self.LOG_LEVEL, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               # its metrics listener defaults to one fixed port: two routers at once (another
               # module, a benchmark) would fail to start on it
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def wait_models(self, timeout: float = 60) -> list[str]:
        """The model ids the router lists once every worker is registered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200 and r.json().get("data"):
                    return [m["id"] for m in r.json()["data"]]
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router listed no model: {self.log.read_text(errors='replace')[-3000:]}")

    def healthy(self) -> dict[str, bool]:
        """Worker URL -> whether the router's health check currently passes it."""
        workers = httpx.get(self.url + "/workers", timeout=10).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in workers}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        print(f"--- router log (tail) ---\n{self.log.read_text(errors='replace')[-3000:]}")
        self.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cluster():
    require_model(MODEL)
    pytest.importorskip("sglang_router", reason="the test extra sglang-router is not installed")
    redis = RedisServer(require_redis()).start()
    replicas = [Server.start(MODEL, "--threads", "1", "--redis-url", redis.url) for _ in range(2)]
    cold = Server.start(MODEL, "--threads", "1", "--no-prompt-cache")
    router = None
    try:
        for s in (*replicas, cold):
            s.wait_ready()
        router = Router([r.url for r in replicas])
        yield router, replicas, cold
    finally:
        if router is not None:
            router.stop()
        for s in (*replicas, cold):
            s.stop()
        redis.cleanup()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def counts(server: Server) -> tuple[int, int, int]:
    """(lookups, memory hits, Redis hits) of a replica's prompt cache so far."""
    s = server.get("/v1/cache/stats").json()
    return s["lookups"], s["hits"], s["tiers"]["redis"]["hits"]


def test_info_routes_and_model_discovery(cluster):
    router, replicas, _ = cluster
    assert router.wait_models() == [MODEL]      # not "unknown": read from /server_info
    for path in ("/server_info", "/get_server_info"):
        info = replicas[0].get(path).json()
        assert info["served_model_name"] == MODEL and info["max_running_requests"] >= 1
        assert info["context_length"] == info["max_model_len"] > 0
    for path in ("/model_info", "/get_model_info"):
        info = replicas[0].get(path).json()
        assert info["is_generation"] is True and info["model_type"] == "llama"


def test_router_body_fields(cluster):
    """The router turns max_tokens into max_completion_tokens and adds SGLang's fields."""
    router, _, _ = cluster
    router.wait_models()
    ask = {"messages": [{"role": "user", "content": "Say only the word yes."}], "max_tokens": 24}
    plain = post(router.url, ask).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 24
    past = post(router.url, {**ask, "ignore_eos": True, "skip_special_tokens": False}).json()
    assert past["choices"][0]["finish_reason"] == "length" and past["usage"]["completion_tokens"] == 24
    text = past["choices"][0]["message"]["content"]
    # the same reply, then the end-of-turn token (shown: skip_special_tokens false) and more
    assert text.startswith(plain["choices"][0]["message"]["content"] + "<|im_end|>"), text
    for field, value in (("no_stop_trim", True), ("continue_final_message", True), ("return_hidden_states", True)):
        r = post(router.url, {**ask, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def scrape(server: Server) -> dict[str, float]:
    """Every sample of a replica's /metrics by name (labels dropped: one model per replica)."""
    text = server.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_gateway_metrics_under_load(cluster):
    """The series llm-d's endpoint picker reads, scraped while more requests than --max-seqs run."""
    _, replicas, _ = cluster
    server = replicas[0]
    max_seqs = server.get("/server_info").json()["max_running_requests"]
    body = {"messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
            "max_tokens": 32, "ignore_eos": True}
    seen: list[dict[str, float]] = []
    with ThreadPoolExecutor(max_seqs + 4) as pool:
        replies = [pool.submit(post, server.url, body) for _ in range(max_seqs + 4)]
        while not all(r.done() for r in replies):
            seen.append(scrape(server))
        assert all(r.result().status_code == 200 for r in replies)
    for m in seen:
        assert m["sglang:num_running_reqs"] == m["vllm:num_requests_running"] <= max_seqs
        assert m["sglang:num_queue_reqs"] == m["vllm:num_requests_waiting"]
        assert m["vllm:num_requests_waiting"] + m["vllm:num_requests_running"] <= max_seqs + 4
        assert 0 <= m["vllm:kv_cache_usage_perc"] == m["sglang:token_usage"] < 1
    full = [m for m in seen if m["vllm:num_requests_waiting"] > 0 and m["vllm:num_requests_running"] == max_seqs]
    assert full, "no scrape saw every slot taken and a queue"
    assert all(m["vllm:kv_cache_usage_perc"] > 0 for m in full)
    deadline = time.monotonic() + 10        # the engine ends a sequence just after its reply is sent
    while (idle := scrape(server))["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
    # the same prompt again and again: the prefix-cache counters are turnkv's own, in vLLM's names
    assert idle["vllm:prefix_cache_queries_total"] == idle["turnkv_prompt_cache_query_tokens_total"] > 0
    assert 0 < idle["vllm:prefix_cache_hits_total"] == idle["turnkv_prompt_cache_hit_tokens_total"]
    hit_rate = idle["vllm:prefix_cache_hits_total"] / idle["vllm:prefix_cache_queries_total"]
    assert idle["sglang:cache_hit_rate"] == pytest.approx(hit_rate)


class Conversations:
    """Chats through a router: first turns arrive together (the policy sends a new prefix to the
    least loaded replica), later turns one at a time, so each is seen landing on one replica and
    restoring from it. ``body`` adds fields to every request (a session id, say)."""

    def __init__(self, router: Router, replicas: list[Server], topics: list[str], body=lambda i: {}):
        self.router, self.replicas, self.body = router, replicas, body
        self.histories = [[{"role": "system", "content": f"You are the helpful assistant of {topic}. " * 6},
                           {"role": "user", "content": f"Tell me about {topic}."}] for topic in topics]
        self.prompt_len: dict[int, int] = {}     # conversation -> its last turn's prompt tokens
        self.home: dict[int, int] = {}           # conversation -> the replica that served its last turn

    def request(self, i: int) -> dict:
        return {"messages": self.histories[i], "max_tokens": REPLY_TOKENS, **self.body(i)}

    def reply(self, i: int, body: dict, follow_up: str) -> None:
        self.prompt_len[i] = body["usage"]["prompt_tokens"]
        self.histories[i] += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                              {"role": "user", "content": follow_up}]

    def first_turns(self) -> None:
        with ThreadPoolExecutor(len(self.histories)) as pool:
            firsts = list(pool.map(lambda i: post(self.router.url, self.request(i)), range(len(self.histories))))
        for i, r in enumerate(firsts):
            self.reply(i, r.json(), FOLLOW_UPS[0])

    def later_turns(self, follow_ups: list[str]) -> tuple[int, int]:
        """(turns whose whole history came from the serving replica's memory, turns played)."""
        from_memory = later = 0
        for follow_up in follow_ups:
            for i in range(len(self.histories)):
                before = [counts(r) for r in self.replicas]
                body = post(self.router.url, self.request(i)).json()
                after = [counts(r) for r in self.replicas]
                served = [k for k in range(len(self.replicas)) if after[k][0] > before[k][0]]
                assert len(served) == 1, (before, after)
                k = served[0]
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= self.prompt_len[i], body["usage"]
                later += 1
                # all of the history restored, and not from Redis: from this replica's memory
                from_memory += after[k][2] == before[k][2] and self.home.get(i, k) == k
                self.home[i] = k
                self.reply(i, body, follow_up)
        return from_memory, later


def retried(url: str, body: dict, timeout: float = 30) -> httpx.Response:
    """What a client does with the router's 500s: until its health check notices a dead worker
    (--health-check-interval-secs 1 here), the router still sends it requests and answers 500
    (docs/scale-out.md); the OpenAI SDK retries those."""
    deadline = time.monotonic() + timeout
    while (r := post(url, body)).status_code >= 500 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    return r


def cut_stream(url: str, body: dict, kill) -> str:
    """Stream a reply and call ``kill`` as soon as text has arrived; the text seen before the end."""
    body = {"model": MODEL, "temperature": 0, **body, "max_tokens": 40, "ignore_eos": True, "stream": True}
    text = ""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
                text += (choices[0]["delta"].get("content") or "") if choices else ""
                if text and kill is not None:
                    kill()
                    kill = None
    except httpx.HTTPError:
        pass            # the stream broke with the replica: what a client sees of a crash
    assert kill is None, "the reply ended before any text streamed"
    return text


def test_conversations_stay_on_a_replica_and_survive_its_loss(cluster):
    router, replicas, cold = cluster
    router.wait_models()
    chats = Conversations(router, replicas, TOPICS)
    chats.first_turns()
    from_memory, later = chats.later_turns(FOLLOW_UPS[1:])
    home = chats.home
    assert from_memory >= 0.9 * later, (from_memory, later, home)
    assert set(home.values()) == {0, 1}, home       # the first turns were spread

    # kill the replica that holds conversation 0 while it streams that conversation's next reply
    victim = home[0]
    survivor = replicas[1 - victim]
    moved = [i for i in home if home[i] == victim]
    for r in replicas:
        wait_written(r)          # the histories so far are in Redis: what outlives the replica
    seen = cut_stream(router.url, chats.request(0), replicas[victim].proc.kill)
    replicas[victim].proc.wait()
    for after_loss, follow_up in enumerate(AFTER_LOSS):
        redis_before = counts(survivor)[2]
        for i in range(len(chats.histories)):
            body = chats.request(i)
            r = retried(router.url, body).json()
            text = r["choices"][0]["message"]["content"]
            # greedy: the text a server without a prompt cache gives for the same history
            assert text == post(cold.url, body).json()["choices"][0]["message"]["content"], (i, text)
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= chats.prompt_len[i], r["usage"]
            if i == 0 and after_loss == 0:
                assert text.startswith(seen) or seen.startswith(text), (seen, text)
            chats.reply(i, r, follow_up)
        assert router.healthy() == {survivor.url: True, replicas[victim].url: False}
        # the moved histories came from Redis once (and were promoted), then from memory
        assert counts(survivor)[2] - redis_before == (len(moved) if after_loss == 0 else 0)
