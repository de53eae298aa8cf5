"""Soak: mixed traffic from many clients against one `turnkv serve`, then a report.

    python bench/soak.py                                  # 10 minutes, 16 clients, bundled SmolLM2
    python bench/soak.py --duration 120 --clients 8       # shorter
    python bench/soak.py --serve-args "--max-seqs 4"

Starts the server itself on loopback (two tenants and an admin in a key file, a small cache budget
with per-tenant shares, a request timeout), then runs ``--clients`` threads for ``--duration``
seconds, each picking at random: a growing multi-turn chat (streamed or not), a long prompt, a
stream it abandons after a few tokens (the client goes away), a completion, or a bad request
(broken JSON, a lone surrogate, too many messages, a wrong key, a negative max_tokens). Bounded in
time and in requests (``--max-requests``); loopback only.

Report: requests by kind and status, 5xx count (goal 0), hangs (a request past its client
timeout; goal 0), p50/p99 latency of successful requests, RSS after warm-up and at the end (goal:
end <= 1.2x warm-up; also given net of the live state slots, which grow until each has held a long
prompt), the prompt cache's bytes against its budget, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere
from bench.conversation import SYSTEM_PROMPT, USER_TURNS  # noqa: E402
from bench.machine import cpu_model  # noqa: E402
from bench.multiuser import TurnkvServer  # noqa: E402

TENANTS = {"soak-a": "key-a", "soak-b": "key-b"}
ADMIN = "soak-admin"
CLIENT_TIMEOUT_S = 180.0


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.status: Counter = Counter()
        self.latency: list[float] = []
        self.hangs = 0
        self.requests = 0
        self.fivexx: list[str] = []

    def add(self, kind: str, status: int | str, seconds: float | None = None, body: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.status[(kind, status)] += 1
            if seconds is not None and status == 200:
                self.latency.append(seconds)
            if isinstance(status, int) and status >= 500:
                self.fivexx.append(f"{kind} {status} {body[:200]}")


def admin_stats(base: str) -> dict:
    return httpx.get(base + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).json()


def client(base: str, seed: int, stop_at: float, max_requests: int, tally: Tally, max_tokens: int) -> None:
    rng = random.Random(seed)
    key = list(TENANTS.values())[seed % len(TENANTS)]
    headers = {"Authorization": f"Bearer {key}"}
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    http = httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S)

    def post(kind: str, path: str, **kw) -> None:
        t0 = time.perf_counter()
        try:
            r = http.post(path, headers=kw.pop("headers", headers), **kw)
            tally.add(kind, r.status_code, time.perf_counter() - t0, r.text)
            return r
        except httpx.TimeoutException:
            with tally.lock:
                tally.hangs += 1
            tally.add(kind, "timeout")
        except httpx.HTTPError as err:
            tally.add(kind, type(err).__name__)
        return None

    while time.monotonic() < stop_at and tally.requests < max_requests:
        pick = rng.random()
        if pick < 0.40:                                         # the next turn of this client's chat
            if len(history) > 12:
                history = history[:1]
            history.append({"role": "user", "content": f"(client {seed}) {rng.choice(USER_TURNS)}"})
            r = post("chat", "/v1/chat/completions", json={"messages": history, "max_tokens": max_tokens,
                                                           "temperature": 0.7, "seed": rng.randrange(1000)})
            if r is not None and r.status_code == 200:
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            else:
                history.pop()
        elif pick < 0.50:                                       # a long prompt, once
            text = " ".join(rng.choice(USER_TURNS) for _ in range(40))
            post("long", "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 4})
        elif pick < 0.65:                                       # a stream abandoned after a few tokens
            t0 = time.perf_counter()
            try:
                with http.stream("POST", "/v1/chat/completions", headers=headers, json={
                        "messages": history + [{"role": "user", "content": "Tell me a long story."}],
                        "max_tokens": 200, "stream": True}) as r:
                    status = r.status_code
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 3:
                            break
                tally.add("abandoned-stream", status, time.perf_counter() - t0)
            except httpx.TimeoutException:
                with tally.lock:
                    tally.hangs += 1
                tally.add("abandoned-stream", "timeout")
        elif pick < 0.75:
            post("completion", "/v1/completions", json={"prompt": f"Garden note {rng.randrange(50)}:",
                                                        "max_tokens": max_tokens, "stream": rng.random() < 0.5})
        else:                                                   # a client mistake
            bad = rng.choice([
                ("broken-json", dict(content=b'{"messages": [', headers={**headers, "Content-Type": "application/json"})),
                ("surrogate", dict(content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                                   headers={**headers, "Content-Type": "application/json"})),
                ("too-many-messages", dict(json={"messages": [{"role": "user", "content": "x"}] * 5000})),
                ("wrong-key", dict(json={"messages": history}, headers={"Authorization": "Bearer nope"})),
                ("negative-max-tokens", dict(json={"messages": history, "max_tokens": -1})),
            ])
            post(bad[0], "/v1/chat/completions", **bad[1])
    http.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="smollm2-135m")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the warm-up RSS is taken")
    ap.add_argument("--max-requests", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--cache-budget-mb", type=float, default=256.0)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args()

    keys = Path(tempfile.mkdtemp(prefix="turnkv-soak-")) / "keys"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANTS.items()))
    server = TurnkvServer(args.engine, ["--api-keys", str(keys), "--admin-key", ADMIN,
                                        "--cache-budget-mb", str(args.cache_budget_mb),
                                        "--tenant-budget-mb", str(args.cache_budget_mb / 2),
                                        "--request-timeout", "120", *shlex.split(args.serve_args)])
    try:
        server.wait()
        base = server.url.removesuffix("/v1")
        tally = Tally()
        start = time.monotonic()
        stop_at = start + args.duration
        threads = [threading.Thread(target=client, args=(base, i, stop_at, args.max_requests, tally, args.max_tokens))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(min(args.warmup, args.duration))
        warm = admin_stats(base)
        for t in threads:
            t.join(args.duration + CLIENT_TIMEOUT_S + 60)
        end = admin_stats(base)
        alive = httpx.get(base + "/health", timeout=30).status_code
        elapsed = time.monotonic() - start
    finally:
        server.close()

    lat = sorted(tally.latency)
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan"))
    report = {
        "cpu": cpu_model(), "clients": args.clients, "seconds": round(elapsed, 1), "requests": tally.requests,
        "by_kind_and_status": {f"{k} {s}": n for (k, s), n in sorted(tally.status.items(), key=str)},
        "5xx": len(tally.fivexx), "hangs": tally.hangs, "health_after": alive,
        "latency_ok_s": {"p50": round(statistics.median(lat), 3) if lat else None, "p99": round(pct(0.99), 3)},
        "rss_warm_mb": round(warm["memory"]["rss_bytes"] / 2**20, 1),
        "rss_end_mb": round(end["memory"]["rss_bytes"] / 2**20, 1),
        "live_state_warm_mb": round(warm["memory"]["live_state_bytes"] / 2**20, 1),
        "cache_bytes_warm_mb": round(warm["bytes"] / 2**20, 1),
        "cache_bytes_end_mb": round(end["bytes"] / 2**20, 1), "cache_budget_mb": round(end["budget_bytes"] / 2**20, 1),
        "live_state_mb": round(end["memory"]["live_state_bytes"] / 2**20, 1),
        "kv_pool_mb": round(end["memory"]["kv_pool_bytes"] / 2**20, 1),
        "engine_restarts": end.get("engine_restarts", 0),
    }
    report["rss_growth"] = round(report["rss_end_mb"] / report["rss_warm_mb"], 3)
    # the state slots grow (bounded: --max-seqs x the longest sequence each has held) until every
    # slot has seen a long prompt; what grows outside them is what a leak would look like
    report["rss_growth_outside_live_state"] = round(
        (report["rss_end_mb"] - report["live_state_mb"]) / (report["rss_warm_mb"] - report["live_state_warm_mb"]), 3)
    # ... and outside the prompt cache too (it fills up to its budget): the rest is what a leak grows
    rest_end = report["rss_end_mb"] - report["live_state_mb"] - report["cache_bytes_end_mb"]
    rest_warm = report["rss_warm_mb"] - report["live_state_warm_mb"] - report["cache_bytes_warm_mb"]
    report["rss_growth_outside_state_and_cache"] = round(rest_end / rest_warm, 3)
    report["goals_met"] = (report["5xx"] == 0 and report["hangs"] == 0 and report["rss_growth"] <= 1.2
                           and end["bytes"] <= end["budget_bytes"] and alive == 200)
    print(json.dumps(report, indent=2))
    for line in tally.fivexx[:10]:
        print("5xx:", line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
