"""N users at once, each holding the 8-turn chat of bench/conversation.py (user messages made
distinct per user), streaming, against any OpenAI-compatible server.

    python bench/multiuser.py --users 4 --engine smollm2-135m     # starts `turnkv serve` for the run
    python bench/multiuser.py --users 4 --engine smollm2-135m --serve-args "--max-seqs 1"
    python bench/multiuser.py --users 4 --url http://127.0.0.1:8080/v1   # llama-server, vLLM, ...

Prints, per run: wall time, TTFT p50/p95 over turns 2+, completion tok/s over all users (total
completion tokens / wall), each user's decode speed (median over the requests of (completion
tokens - 1) / the time from the first streamed piece to the last), prompt reuse (cached /
prompt tokens, where the server reports it) and the CPU seconds this process spent meanwhile
(the clients' own cost: the `openai` client parses every streamed piece, ~0.8 ms of CPU a token,
on the same cores as a server started here, and more of it a second the more users stream).
Several ``--engine``/``--url`` targets run one after another in one invocation, so their numbers
come from the same machine minutes apart; the CPU model is printed first.

With several targets the summary also gives each one's aggregate tok/s, wall time and TTFT p95
against the first target's at the same count of users (``--engine smollm2-135m --url VLLM_URL
--url LLAMA_SERVER_URL``: turnkv against the peers, run by run; a ``--url`` server is taken to
serve the first target's model, and two ``--engine`` targets of different models are not compared).

``--users 1,8 --rounds 3`` runs every target with 1 and with 8 users, three rounds, the order of
the counts alternating between rounds (1, 8, 8, 1, 1, 8), and ends with a summary: the median
of each count's runs and two ratios against 1 user, each the median of the rounds' ratios (a
round's runs are minutes apart; a VM's speed can drift over longer): the aggregate completion
tok/s (wall clock: every turn's prefill of the new messages included), and the aggregate decode
speed (users x the per-user decode speed: each user's own prefill left out, but not the other
users' prefill steps that ran while it decoded, which is what a user of a busy server sees). An
``--engine`` target gets a fresh server for every run; a ``--url`` server keeps its prompt cache,
so its runs after the first tag the user messages with the run's number ("(volunteer 3, run
2)"): a run never finds an earlier run's replies cached, only the shared system prompt.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere
from bench.conversation import USER_TURNS, messages_for_turn  # noqa: E402
from bench.machine import cpu_model  # noqa: E402
from bench.multiturn import TurnResult, openai_chat  # noqa: E402




def user_messages(user: int, turn: int, replies: list[str], run: int = 0) -> list[dict]:
    """The shared conversation with user-specific wording, so users share the system prompt only;
    ``run`` > 0 tags the wording with the run too (repeated runs against one server)."""
    messages = messages_for_turn(turn, replies)
    tag = f"volunteer {user + 1}" + (f", run {run + 1}" if run else "")
    for m in messages:
        if m["role"] == "user":
            m["content"] = f"({tag}) {m['content']}"
    return messages


def run_users(url: str, model: str | None, users: int, turns: int, max_tokens: int, run: int = 0) -> dict:
    results: list[list[TurnResult]] = [[] for _ in range(users)]
    errors: list[BaseException] = []

    def one(u: int) -> None:
        try:
            chat = openai_chat(url, model, os.environ.get("OPENAI_API_KEY"), max_tokens=max_tokens)
            replies: list[str] = []
            for turn in range(turns):
                r = chat(user_messages(u, turn, replies, run))
                replies.append(r.reply)
                results[u].append(r)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=one, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors:
        raise errors[0]
    later = sorted(r.ttft_ms for rs in results for r in rs[1:]) or sorted(r.ttft_ms for rs in results for r in rs)
    flat = [r for rs in results for r in rs]
    known = [r for r in flat if r.prompt_tokens is not None and r.cached_tokens is not None]
    return {
        "wall_s": wall,
        "ttft_p50": statistics.median(later),
        "ttft_p95": later[min(len(later) - 1, int(round(0.95 * (len(later) - 1))))],
        "tok_s": sum(r.completion_tokens for r in flat) / wall,
        "reuse": (sum(r.cached_tokens for r in known) / max(1, sum(r.prompt_tokens for r in known))) if known else None,
        "decode_per_user": statistics.median([r.decode_tokens_per_s for r in flat if r.decode_tokens_per_s]),
        "client_cpu_s": client_cpu,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess for one run: ``proc``, ``log`` and ``url`` set by the subclass;
    ``wait`` until its /health answers, ``close`` it."""

    name = "server"
    proc: subprocess.Popen
    url: str

    def wait(self, timeout: float = 600) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not start")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TurnkvServer(ServerProcess):
    """`turnkv serve` in a subprocess for one run (the real server path, as a user runs it)."""

    name = "turnkv serve"

    def __init__(self, model: str, extra: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="turnkv-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "turnkv.cli", "serve", "-m", model, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/v1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", default="4", help="users at once; a comma list (1,8) runs each count")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every count and target (default 1)")
    ap.add_argument("--turns", type=int, default=len(USER_TURNS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--engine", action="append", default=[], help="bundled model to serve with turnkv (repeatable)")
    ap.add_argument("--serve-args", action="append", default=[],
                    help="extra `turnkv serve` flags, one string per --engine (default none)")
    ap.add_argument("--url", action="append", default=[], help="an OpenAI base URL (repeatable)")
    ap.add_argument("--model", default=None, help="model name to send with --url (default: the server's first)")
    args = ap.parse_args()
    if not args.engine and not args.url:
        ap.error("give --engine MODEL or --url URL")
    try:
        counts = [int(x) for x in str(args.users).split(",") if x.strip()]
    except ValueError:
        ap.error("--users takes a number or a comma list of numbers")
    if not counts or min(counts) < 1 or args.rounds < 1:
        ap.error("--users and --rounds must be >= 1")
    print(f"CPU: {cpu_model()}; {args.users} users x {args.turns} turns, {args.max_tokens} tokens a reply"
          + (f", {args.rounds} rounds" if args.rounds > 1 else ""))
    print(f"{'target':48} {'wall s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'tok/s all':>9} "
          f"{'tok/s user':>10} {'reuse':>6} {'client CPU s':>12}")

    def show(name: str, r: dict) -> None:
        reuse = "-" if r["reuse"] is None else f"{100 * r['reuse']:.0f}%"
        print(f"{name[:48]:48} {r['wall_s']:7.1f} {r['ttft_p50']:9.0f} {r['ttft_p95']:9.0f} {r['tok_s']:9.1f} "
              f"{r['decode_per_user']:10.1f} {reuse:>6} {r['client_cpu_s']:12.1f}", flush=True)

    runs: dict[tuple[str, int], list[dict]] = {}      # (target, users) -> one result a round
    served = 0                                            # runs so far against the --url servers
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            for i, model in enumerate(args.engine):
                extra = shlex.split(args.serve_args[i]) if i < len(args.serve_args) else []
                name = f"turnkv {model} {' '.join(extra)}".strip()
                server = TurnkvServer(model, extra)
                try:
                    server.wait()
                    res = run_users(server.url, None, n, args.turns, args.max_tokens)
                finally:
                    server.close()
                runs.setdefault((name, n), []).append(res)
                show(f"{name} ({n} user{'s' if n > 1 else ''})" if len(counts) > 1 else name, res)
            for url in args.url:
                res = run_users(url, args.model, n, args.turns, args.max_tokens, run=served)
                runs.setdefault((url, n), []).append(res)
                show(f"{url} ({n} user{'s' if n > 1 else ''})" if len(counts) > 1 else url, res)
            served += 1
    if args.rounds > 1 or len(counts) > 1:
        summary(runs, args.rounds)
    return 0


def summary(runs: dict[tuple[str, int], list[dict]], rounds: int) -> None:
    """Medians over the rounds, and where 1 user ran too, each count against 1 user (the median
    of the rounds' ratios): aggregate completion tok/s, and users x the per-user decode speed."""
    print(f"\nmedians of {rounds} round(s); x 1 user: against 1 user's, the median of the rounds' ratios, of the "
          "aggregate completion tok/s (all) and of users x the per-user decode speed (decode)")
    print(f"{'target':48} {'users':>5} {'wall s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'tok/s all':>9} "
          f"{'x 1 (all)':>9} {'x 1 (decode)':>12}")
    for (name, n), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "ttft_p50", "ttft_p95", "tok_s")}
        ones = runs.get((name, 1))
        ratio = (f"{statistics.median(a['tok_s'] / b['tok_s'] for a, b in zip(rs, ones)):.2f}"
                 if ones and n != 1 else "-")
        dec = (f"{statistics.median(n * a['decode_per_user'] / b['decode_per_user'] for a, b in zip(rs, ones)):.2f}"
               if ones and n != 1 else "-")
        print(f"{name[:48]:48} {n:5d} {med['wall_s']:7.1f} {med['ttft_p50']:9.0f} {med['ttft_p95']:9.0f} "
              f"{med['tok_s']:9.1f} {ratio:>9} {dec:>12}", flush=True)
    # side by side: the same count of users on every other target against the first, round by
    # round (a --url server is taken to serve the first target's model; two --engine targets of
    # different models are not compared)
    targets = list(dict.fromkeys(name for name, _ in runs))
    first = targets[0]

    def engine_model(name: str) -> str | None:
        return name.split()[1] if name.startswith("turnkv ") else None

    others = [t for t in targets[1:] if None in (engine_model(t), engine_model(first))
              or engine_model(t) == engine_model(first)]
    if not others:
        return
    print(f"\nagainst {first[:60]} with the same users (median of the rounds' ratios): aggregate tok/s, "
          "wall time, TTFT p95")
    print(f"{'target':48} {'users':>5} {'x tok/s':>8} {'x wall':>7} {'x p95':>7}")
    for (name, n), rs in runs.items():
        base = runs.get((first, n))
        if name not in others or not base:
            continue
        ratios = [statistics.median(a[k] / b[k] for a, b in zip(rs, base) if b[k]) for k in ("tok_s", "wall_s", "ttft_p95")]
        print(f"{name[:48]:48} {n:5d} {ratios[0]:8.2f} {ratios[1]:7.2f} {ratios[2]:7.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
