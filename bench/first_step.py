"""Start-up and the first step of an agent session, as a user of a fresh server sees them.

    python bench/first_step.py [--runs 3] [--model gemma3-270m] [CHECKOUT ...]

Per run and checkout (default: this one; several are alternated, so a busy machine's drift falls
on all alike): starts ``turnkv serve -m MODEL --chat-template chatml-tools --threads 2`` from that
checkout, times process start to the first 200 on ``GET /v1/models``, then at once sends the first
recorded request of the agent trace's first session (bench/agent_replay.py; streamed, a forced
tool call: the grammar engine's vocabulary view must be ready for it) and times its first delta
with content or a tool call (TTFT) and its end (wall). Run it under ``flock /tmp/turnkv-bench.lock``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = Path(os.environ.get("TURNKV_TRACE_DIR", Path.home() / ".cache" / "turnkv-agent-traces")) / "agents-4x21.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"turnkv serve exited with status {proc.returncode}")


def first_step(port: int, body: bytes) -> tuple[float, float]:
    """(TTFT, wall) of one streamed request."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp, ttft = conn.getresponse(), None
    for line in iter(resp.readline, b""):
        if ttft is None and line.startswith(b"data: {") and (b'"content":"' in line or b'"tool_calls"' in line):
            ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - t0


def run_once(checkout: Path, model: str, body: bytes) -> tuple[float, float, float]:
    port, t0 = free_port(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "turnkv.cli", "serve", "-m", model, "--port", str(port),
                             "--chat-template", "chatml-tools", "--threads", "2"], cwd=checkout,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        up = time.perf_counter() - t0
        return (up, *first_step(port, body))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs="*", type=Path, default=[ROOT])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    body = json.dumps(json.loads(args.trace.read_text().splitlines()[0])["body"]).encode()
    sys.path.insert(0, str(ROOT))
    from bench.machine import cpu_model

    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}")
    results: dict[Path, list[tuple[float, float, float]]] = {c: [] for c in args.checkouts}
    for _ in range(args.runs):
        for checkout in args.checkouts:
            row = run_once(checkout, args.model, body)
            results[checkout].append(row)
            print(f"{checkout}: start-up {row[0]:.2f} s, first step TTFT {row[1]:.2f} s, wall {row[2]:.2f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for checkout, rows in results.items():
        print(f"{checkout} medians: start-up {statistics.median(r[0] for r in rows):.2f} s, first step TTFT "
              f"{statistics.median(r[1] for r in rows):.2f} s, wall {statistics.median(r[2] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
