"""A killed replica loses no conversation (issue 50, docs/scale-out.md): two `turnkv serve`
replicas on one Redis tier behind the real sglang-router, and a third server without a prompt cache
as the oracle. Mid-session, while the router streams a conversation's reply from one replica, that
replica is killed with SIGKILL. The client retries the turn (as the OpenAI SDK retries a 5xx);
once the router's health check drops the dead replica, every conversation's next turns succeed on
the survivor with the same text as the cold server gives for the same history (greedy), the moved
conversations' histories restored from Redis and from the turn after that from the survivor's own
memory (the Redis entry was promoted), with nothing prefilled twice.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from redis_server import RedisServer, require_redis
from test_router import MODEL, Router, counts, post
from test_server import Server, require_model
from test_tiers_server import wait_written

pytestmark = pytest.mark.real
REPLY_TOKENS = 8
STREAMED_TOKENS = 40         # the reply that is cut: long enough to be killed while it streams
TOPICS = ["the night bus timetable", "a school vegetable plot", "the museum's fossil room", "a canal boat club"]
FOLLOW_UPS = ["Give one more detail.", "And what should we avoid?", "Who should I ask?", "Summarise in five words."]


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
        router.wait_models()
        yield router, replicas, cold
    finally:
        if router is not None:
            router.stop()
        for s in (*replicas, cold):
            s.stop()
        redis.cleanup()


def reply_of(r: httpx.Response) -> tuple[str, dict]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def retried(url: str, body: dict, timeout: float = 30) -> httpx.Response:
    """What a client does with the router's 5xx while the dead replica is still listed: retry."""
    deadline = time.monotonic() + timeout
    while (r := post(url, body)).status_code >= 500 and time.monotonic() < deadline:
        time.sleep(0.3)
    return r


def cut_stream(router: Router, history: list[dict], kill) -> str:
    """Stream a reply through the router and call ``kill`` once text has arrived; the text seen."""
    body = {"model": MODEL, "messages": history, "max_tokens": STREAMED_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = ""
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"]
                text += (delta[0]["delta"].get("content") or "") if delta else ""
                if text and kill is not None:
                    kill()
                    kill = None
    except httpx.HTTPError:
        pass            # the stream broke with the replica: what the client sees of a crash
    assert kill is None, "the reply ended before any text streamed"
    return text


def test_killed_replica_loses_no_conversation(cluster):
    router, replicas, cold = cluster
    histories = [[{"role": "system", "content": f"You answer questions about {topic}. " * 8},
                  {"role": "user", "content": f"Tell me about {topic}."}] for topic in TOPICS]
    prompt_len: dict[int, int] = {}
    home: dict[int, int] = {}

    def turn(i: int, url: str, follow_up: str) -> dict:
        body = {"messages": histories[i], "max_tokens": REPLY_TOKENS}
        text, usage = reply_of(retried(url, body) if url == router.url else post(url, body))
        want, _ = reply_of(post(cold.url, body))
        assert text == want, (i, text, want)           # greedy: the cold server's text, token for token
        if i in prompt_len:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_len[i], (i, usage)
        prompt_len[i] = usage["prompt_tokens"]
        histories[i] += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
        return usage

    with ThreadPoolExecutor(len(histories)) as pool:      # arriving together, they spread
        list(pool.map(lambda i: turn(i, router.url, FOLLOW_UPS[0]), range(len(histories))))
    for i in range(len(histories)):                       # one at a time: each seen landing
        before = [counts(r) for r in replicas]
        turn(i, router.url, FOLLOW_UPS[1])
        after = [counts(r) for r in replicas]
        home[i] = next(k for k in range(2) if after[k][0] > before[k][0])
    assert set(home.values()) == {0, 1}, home

    victim = home[0]
    for r in replicas:
        wait_written(r)          # the histories so far are in Redis: what survives the replica
    seen = cut_stream(router, histories[0], lambda: replicas[victim].proc.kill())
    replicas[victim].proc.wait()
    survivor = replicas[1 - victim]
    moved = [i for i in home if home[i] == victim]
    redis_hits = counts(survivor)[2]
    # the cut turn again, then each conversation's next turn: the router's health check drops
    # the dead replica within a second here; until then `retried` retries its 500s
    turn(0, router.url, FOLLOW_UPS[2])
    assert histories[0][-2]["content"].startswith(seen) or seen.startswith(histories[0][-2]["content"])
    for i in range(1, len(histories)):
        turn(i, router.url, FOLLOW_UPS[2])
    assert counts(survivor)[2] - redis_hits == len(moved)     # each moved history came from Redis
    assert router.healthy() == {survivor.url: True, replicas[victim].url: False}
    redis_hits = counts(survivor)[2]
    for i in range(len(histories)):
        turn(i, router.url, FOLLOW_UPS[3])
    assert counts(survivor)[2] == redis_hits                  # and then from the survivor's memory
