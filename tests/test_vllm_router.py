"""turnkv behind vllm-router (vLLM's router, PyPI `vllm-router`, a test extra): the real binary in
front of two `turnkv serve --threads 1` replicas of the bundled SmolLM2 on one Redis tier, on
loopback, as test_router.py runs sglang-router (docs/scale-out.md says what differs).

Asserted: the router's /v1/models names the model; the fields it adds to every body (SGLang's and
vLLM's `include_reasoning`) are accepted and `ignore_eos` honoured; its `cache_aware` policy, which
tokenizes each request through the worker's /tokenize and matches token prefixes, keeps each
conversation on one replica, whose memory serves every later turn; `consistent_hash` does the same
by a session id; and when a replica is killed, its conversations go on on the other one, restored
from Redis.
"""

from __future__ import annotations

import httpx
import pytest

from redis_server import RedisServer, require_redis
from test_router import FOLLOW_UPS, MODEL, TOPICS, Conversations, Router, counts, post, retried
from test_server import Server, require_model
from test_tiers_server import wait_written

pytestmark = pytest.mark.real


class VllmRouter(Router):
    """``vllm-router`` (its console script runs this module) with the same flags as sglang-router."""

    MODULE, LOG_LEVEL = "vllm_router.launch_router", "warning"


@pytest.fixture(scope="module")
def cluster():
    require_model(MODEL)
    pytest.importorskip("vllm_router", reason="the test extra vllm-router is not installed")
    redis = RedisServer(require_redis()).start()
    replicas = [Server.start(MODEL, "--threads", "1", "--redis-url", redis.url) for _ in range(2)]
    routers: list[Router] = []
    try:
        for r in replicas:
            r.wait_ready()
        routers = [VllmRouter([r.url for r in replicas], policy) for policy in ("cache_aware", "consistent_hash")]
        for router in routers:
            router.wait_models()
        yield routers, replicas
    finally:
        for router in routers:
            router.stop()
        for r in replicas:
            r.stop()
        redis.cleanup()


def test_models_and_body_fields(cluster):
    (router, _), replicas = cluster
    assert router.wait_models() == [MODEL]      # the router passes /v1/models on to a worker
    ask = {"messages": [{"role": "user", "content": "Say only the word yes."}], "max_tokens": 24}
    plain = post(router.url, ask)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    past = post(router.url, {**ask, "ignore_eos": True}).json()
    assert past["choices"][0]["finish_reason"] == "length" and past["usage"]["completion_tokens"] == 24
    assert post(router.url, {**ask, "include_reasoning": False}).status_code == 200
    r = post(replicas[0].url, {**ask, "include_reasoning": "yes"})   # a field turnkv knows, checked
    assert r.status_code == 400 and "include_reasoning" in r.text, r.text


def test_cache_aware_keeps_conversations_on_a_replica(cluster):
    (router, _), replicas = cluster
    chats = Conversations(router, replicas, TOPICS[:4])
    chats.first_turns()
    from_memory, later = chats.later_turns(FOLLOW_UPS[1:])
    assert from_memory >= 0.9 * later, (from_memory, later, chats.home)


def test_consistent_hash_keeps_a_session_on_a_replica(cluster):
    (_, router), replicas = cluster
    chats = Conversations(router, replicas, TOPICS[2:], body=lambda i: {"user": f"session-{i}"})
    chats.first_turns()
    from_memory, later = chats.later_turns(FOLLOW_UPS[1:])
    assert from_memory == later, (from_memory, later, chats.home)


def test_failover_restores_from_redis(cluster):
    (router, _), replicas = cluster
    chats = Conversations(router, replicas, ["a lighthouse keeper's log", "the village orchard", "a tram depot"])
    chats.first_turns()
    chats.later_turns(FOLLOW_UPS[1:2])
    if len(set(chats.home.values())) == 1:     # all on one replica: kill that one
        victim = next(iter(chats.home.values()))
    else:
        victim = chats.home[0]
    for r in replicas:
        wait_written(r)
    replicas[victim].proc.kill()
    replicas[victim].proc.wait()
    survivor = replicas[1 - victim]
    moved = [i for i, k in chats.home.items() if k == victim]
    redis_before = counts(survivor)[2]
    for i in range(len(chats.histories)):
        r = retried(router.url, chats.request(i))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= chats.prompt_len[i]
    assert counts(survivor)[2] - redis_before == len(moved)
    assert httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
