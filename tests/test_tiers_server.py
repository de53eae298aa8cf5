"""Warm restart and replicas with real `turnkv serve` processes on the bundled SmolLM2.

Server A (``--cache-dir`` and ``--redis-url``) answers turn 1 and is stopped. Server B starts on the
same folder (nothing in its memory) and server C on another folder and the same Redis: each answers
turn 2 with turn 1's history reported as cached, and the same text as a server without a prompt
cache. The Redis is a real redis-server process (tests/redis_server.py).
"""

from __future__ import annotations

import time

import httpx
import pytest

from redis_server import RedisServer, require_redis
from test_server import Server, require_model

MODEL = "smollm2-135m"
pytestmark = pytest.mark.real
SYSTEM = ("You are the planning assistant of a community garden with three sites. " * 12).strip()


def chat(server: Server, messages: list[dict]) -> tuple[str, dict]:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def tiers(server: Server) -> dict:
    return server.get("/v1/cache/stats").json()["tiers"]


def wait_written(server: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wb = tiers(server)["write_behind"]
        if wb["depth"] == 0 and wb["written"] == wb["queued"] and wb["queued"] > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"write-behind did not drain: {tiers(server)}")


def test_restart_and_replica_serve_turn_two_from_lower_tiers(tmp_path):
    require_model(MODEL)
    redis = RedisServer(require_redis()).start()
    servers: list[Server] = []
    try:
        cold = Server.start(MODEL, "--no-prompt-cache")
        a = Server.start(MODEL, "--cache-dir", str(tmp_path / "a"), "--redis-url", redis.url)
        servers += [cold, a]
        for s in servers:
            s.wait_ready()
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which beds are free?"}]
        reply1, usage1 = chat(a, turn1)
        assert reply1 == chat(cold, turn1)[0]
        wait_written(a)
        a.stop()
        servers.remove(a)

        b = Server.start(MODEL, "--cache-dir", str(tmp_path / "a"))            # restarted on the same folder
        c = Server.start(MODEL, "--cache-dir", str(tmp_path / "c"), "--redis-url", redis.url)   # a replica
        servers += [b, c]
        b.wait_ready()
        c.wait_ready()
        turn2 = turn1 + [{"role": "assistant", "content": reply1},
                         {"role": "user", "content": "And which ones need water?"}]
        want, _ = chat(cold, turn2)
        for server, tier in ((b, "disk"), (c, "redis")):
            text, usage = chat(server, turn2)
            assert text == want, (tier, text, want)
            # turn 1's prompt and reply are restored, not prefilled
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage1["prompt_tokens"], (tier, usage)
            stats = tiers(server)[tier]
            assert stats["hits"] == 1 and not stats["refusals"], stats
        metrics = httpx.get(c.url + "/metrics", timeout=60).text
        assert 'turnkv_cache_tier_hits_total{tier="redis"} 1.0' in metrics
    finally:
        for s in servers:
            s.stop()
        redis.cleanup()
