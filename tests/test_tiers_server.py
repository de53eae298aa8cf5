"""Warm restart and replicas with real `turnkv serve` processes on the bundled SmolLM2.

Server A (``--cache-dir`` and ``--redis-url``) answers turn 1 and is stopped. Server B starts on the
same folder (nothing in its memory) and server C on another folder and the same Redis: each answers
turn 2 with turn 1's history reported as cached, and the same text as a server without a prompt
cache. The Redis is a real redis-server process (tests/redis_server.py).

A second test kills a server with SIGKILL right after replies whose entries are still being
written behind, and restarts on its folder (see its docstring for what that does and does not
prove). Both compare with one server without a prompt cache, started once for the module.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from redis_server import RedisServer, require_redis
from test_server import QUESTIONS, Server, require_model
from turnkv.cache.serialize import (
    BLOCK_MAGIC,
    CORRUPT,
    MISSING_BLOCK,
    MODEL_MISMATCH,
    NAMESPACE_MISMATCH,
    PAYLOAD_MISMATCH,
    VERSION_MISMATCH,
    Manifest,
    decode,
    unseal,
)

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


@pytest.fixture(scope="module")
def cold():
    """The oracle: a server without a prompt cache (every turn prefilled cold)."""
    require_model(MODEL)
    server = Server.start(MODEL, "--no-prompt-cache")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_restart_and_replica_serve_turn_two_from_lower_tiers(tmp_path, cold):
    redis = RedisServer(require_redis()).start()
    servers: list[Server] = []
    try:
        a = Server.start(MODEL, "--cache-dir", str(tmp_path / "a"), "--redis-url", redis.url)
        servers += [a]
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
            # the promoted entry ends turn 1, so turn 2 counts as a session resumed from that tier
            resumes = server.get("/v1/cache/stats").json()["resumes"]
            assert resumes == {"memory": 0, "disk": 0, "redis": 0, "prefill": 0, tier: 1}, resumes
        metrics = httpx.get(c.url + "/metrics", timeout=60).text
        assert 'turnkv_cache_tier_hits_total{tier="redis"} 1.0' in metrics
        assert 'turnkv_cache_session_resumes_total{source="redis"} 1.0' in metrics
    finally:
        for s in servers:
            s.stop()
        redis.cleanup()


NAMED_REFUSALS = {CORRUPT, VERSION_MISMATCH, MODEL_MISMATCH, NAMESPACE_MISMATCH, MISSING_BLOCK,
                  PAYLOAD_MISMATCH, "over_budget"}


def whole_entries(folder: Path) -> int:
    """Load every entry left in a disk-tier folder the way a lookup does (every checksum verified,
    every tensor rebuilt); a part that is not whole raises. Returns how many entries there are."""
    n = 0
    for model in folder.iterdir():
        for mpath in (model / "m").iterdir():
            if mpath.name.startswith("."):
                continue
            m = Manifest.from_bytes(mpath.read_bytes())
            payload = (model / "p" / m.id).read_bytes()
            blocks = {k: (model / "b" / k[:2] / k).read_bytes() for k in m.block_keys()}
            for data in blocks.values():
                unseal(BLOCK_MAGIC, data)
            decode(m, payload, blocks)
            n += 1
    return n


def test_kill_9_during_write_behind_then_restart_loads_only_whole_entries(tmp_path, cold):
    """Server A (``--cache-dir``) plays two turns, then five branches of turn 3 at once (five
    more entries on the write-behind queue), and gets SIGKILL the moment the last reply arrives,
    while those writes are most likely still running. Server B starts on the same folder.

    Proves, whatever the kill interrupted (nothing, a block, a payload, a manifest): B starts
    cleanly; every entry B indexed loads whole (every checksum verified and tensor rebuilt here,
    in the test); anything B did not take is refused with a named reason; and turn 4 on B equals
    the cold server's reply, with cached tokens exactly when an entry survived.
    Does not prove: that a particular interleaving was hit (the timing is whatever this machine
    gives; the test prints how many writes were unfinished and how many entries were left), durability after a power cut or an
    OS crash (files are renamed into place without fsync: SIGKILL leaves the page cache, a power
    cut may not; the checksums would refuse such a file, which tests/test_tiers.py's corrupt and
    truncated cases cover), or anything about Redis (its entries are written by one atomic script).
    """
    folder = tmp_path / "crash"
    a = Server.start(MODEL, "--cache-dir", str(folder))
    servers = [a]
    try:
        a.wait_ready()
        history = [{"role": "system", "content": SYSTEM}]
        for question in QUESTIONS[:2]:
            history.append({"role": "user", "content": question})
            reply, _ = chat(a, history)
            history.append({"role": "assistant", "content": reply})
        branches = [history + [{"role": "user", "content": q}] for q in QUESTIONS[2:7]]
        with ThreadPoolExecutor(len(branches)) as pool:
            replies = list(pool.map(lambda msgs: chat(a, msgs)[0], branches))
        pending = tiers(a)["write_behind"]         # one quick GET: what was still queued at the kill
        a.proc.kill()                              # SIGKILL, right after the last reply
        a.proc.wait()
        left = sorted(p.name for p in folder.rglob("*") if p.is_file())
        print(f"SIGKILL with {pending['queued'] - pending['written']} of {pending['queued']} writes "
              f"unfinished; left {sum('/m/' in str(p) for p in folder.rglob('*'))} manifests, "
              f"{sum(n.endswith('.tmp') for n in left)} temporary files")

        b = Server.start(MODEL, "--cache-dir", str(folder))
        servers.append(b)
        b.wait_ready()                     # (a) starts cleanly: serving, /health answers
        disk = tiers(b)["disk"]
        # (b) every entry B indexed is whole; whatever it did not take was refused by name
        assert whole_entries(folder) == disk["entries"], disk
        assert set(disk["refusals"]) <= NAMED_REFUSALS, disk
        assert disk["errors"] == 0 and disk["write_errors"] == 0, disk
        assert not list(folder.rglob(".*.tmp")), "temporaries of the killed writer were left"

        turn4 = branches[0] + [{"role": "assistant", "content": replies[0]},
                               {"role": "user", "content": QUESTIONS[5]}]
        text, usage = chat(b, turn4)
        assert text == chat(cold, turn4)[0]                    # (c) the cold answer
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        after = tiers(b)["disk"]
        if disk["entries"]:     # B's memory is empty: any reuse came from the disk entries that survived
            assert cached > 0 and after["hits"] == 1, (usage, after)
        else:
            assert cached == 0, usage
        assert set(after["refusals"]) <= NAMED_REFUSALS, after
        assert "Traceback" not in b.text()
    finally:
        for s in servers:
            s.stop()
