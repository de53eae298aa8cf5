"""Start-up as a user sees it: process start to the server's first successful HTTP answer
(``GET /v1/models`` answering 200), for ``turnkv serve`` and ``llama-server`` on the same GGUF,
same thread count, one at a time. Run it under ``flock /tmp/turnkv-bench.lock`` on a shared machine.

    python bench/startup.py [--model FILE] [--threads 2] [--runs 3] [--engines turnkv,llama]
                            [--before CHECKOUT] [--source]

``--before`` adds ``turnkv serve`` run from another checkout (e.g. main before a change), its runs
interleaved with the others' so a busy machine's drift falls on all alike.

Each checkout's ``turnkv`` package is byte-compiled first (``compileall``, into its
``__pycache__``), as ``pip install`` leaves an installed package: this environment sets
``PYTHONDONTWRITEBYTECODE=1``, under which a source checkout compiles its ~125 modules again on
every start (~0.1-0.2 s of the start on a 2-core Zen 2). ``--source`` deletes the checkouts'
``turnkv`` byte code instead and times the source-only start (how runs before 2026-12-07 04:30
were made).

Both servers bind their port before loading and answer only once the model is loaded (turnkv
accepts connections early and answers when uvicorn starts; llama-server answers 503 while
loading), so the time to the first 200 is the time to a server that can take a request.

Beside each time, the CPU seconds the server had used when it first answered (user + system from
``/proc``, all threads) and its main thread's: on a shared machine these move far less than wall
times do, so they say whether a change removed work."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_model  # noqa: E402
from bench.realsize_models import CACHE, LLAMA_CPP  # noqa: E402

DEFAULT_MODEL = CACHE / "llama-3.2-1b" / "llama-3.2-1b-Q4_K_M.gguf"
LLAMA_SERVER = LLAMA_CPP / "build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v1/models")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except (OSError, http.client.HTTPException):
        return False


def command(engine: str, model: Path, port: int, threads: int) -> list[str]:
    if engine.startswith("turnkv"):
        return [sys.executable, "-m", "turnkv.cli", "serve", "-m", str(model), "--port", str(port),
                "--threads", str(threads)]
    return [str(LLAMA_SERVER), "-m", str(model), "--port", str(port), "-t", str(threads), "-c", "4096"]


def byte_compile(checkout: Path, source: bool = False) -> None:
    """``source``: delete the package's byte code (what an earlier run compiled) instead."""
    if source:
        for cache in list((checkout / "turnkv").rglob("__pycache__")):
            shutil.rmtree(cache)
        return
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(checkout / "turnkv")], check=True)


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """user + system CPU seconds of process ``pid`` (all its threads), or of its thread ``tid``."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_start(engine: str, model: Path, threads: int, cwd: Path = ROOT,
               timeout: float = 120.0) -> tuple[float, float, float]:
    """Seconds from spawning the server to its first 200 on /v1/models, and the CPU seconds the
    server had used by then: all its threads', and its main thread's (where turnkv imports and
    loads; the work that holds the GIL is there and on threads that wait for it)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(engine, model, port, threads), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if answers(port):
                return time.perf_counter() - t0, cpu_seconds(proc.pid), cpu_seconds(proc.pid, proc.pid)
            if proc.poll() is not None:
                raise RuntimeError(f"{engine} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        raise RuntimeError(f"{engine} did not answer within {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engines", default="turnkv,llama")
    p.add_argument("--before", type=Path, default=None, help="a checkout whose turnkv serve runs too")
    p.add_argument("--source", action="store_true", help="delete the checkouts' turnkv byte code, do not compile it")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}, {args.threads} threads; {args.model.name}; turnkv "
          f"{'from source' if args.source else 'byte-compiled'}; load average {os.getloadavg()[0]:.1f}", flush=True)
    engines = {e: ROOT for e in args.engines.split(",")}
    if args.before is not None:
        engines = {"turnkv-before": args.before.resolve(), **engines}
    for checkout in {cwd for engine, cwd in engines.items() if engine.startswith("turnkv")}:
        byte_compile(checkout, args.source)
    runs: dict[str, list[tuple[float, float, float]]] = {e: [] for e in engines}
    for _ in range(args.runs):
        for engine, cwd in engines.items():
            runs[engine].append(time_start(engine, args.model, args.threads, cwd))
    result = {}
    for engine, starts in runs.items():
        times, cpu, main_cpu = ([s[i] for s in starts] for i in range(3))
        result[engine] = {"median_s": statistics.median(times), "runs_s": [round(t, 3) for t in times],
                          "cpu_s": [round(c, 2) for c in cpu], "main_thread_cpu_s": [round(c, 2) for c in main_cpu]}
        print(f"{engine:>7}: start to first answer {statistics.median(times):.2f} s (median of {len(times)}: "
              f"{', '.join(f'{t:.2f}' for t in times)}); CPU by then {statistics.median(cpu):.2f} s, main thread "
              f"{statistics.median(main_cpu):.2f} s", flush=True)
    if "turnkv" in result and "llama" in result:
        print(f"turnkv / llama-server: {result['turnkv']['median_s'] / result['llama']['median_s']:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
