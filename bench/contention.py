"""Decode speed on cores another process wants, ``--adaptive-threads`` off against on
(engine/threads.py, docs/threads.md).

Each run is a child process (torch's thread count is per process) that loads the model as
``turnkv serve`` does (its default weights and KV mode, ``--threads`` threads) and decodes
``--tokens`` greedy tokens after a short prompt, request after request, through three phases: the
quiet machine, then ``--hogs`` busy processes (a shell loop each, started by the child: the other
work a shared machine has), then quiet again. Off and on alternate (off, on, on, off, ...) for
``--rounds`` rounds; prints the median decode tok/s of each phase, on / off, and the thread count
the governor ended each phase on. Take the lock for the whole run:

    flock /tmp/turnkv-bench.lock python bench/contention.py --model smollm2-135m
    flock /tmp/turnkv-bench.lock python bench/contention.py --model ~/.cache/turnkv-realsize/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.machine import cpu_model  # noqa: E402

PHASES = ("quiet", "busy", "quiet again")

_CHILD = r'''
import json, subprocess, sys, time
import torch
torch.set_num_threads({threads})
from turnkv.engine.engine import AUTO_KV, Engine
from turnkv.engine.threads import threads_dict
from turnkv.engine.sequence import GenerationRequest
from turnkv.engine.sampling import SamplingParams
eng = Engine.load({model!r}, weights=None, progress=False, kv_mode=AUTO_KV, max_context=4096,
                  adaptive_threads={adaptive})
vocab = eng.requests.model.vocab_size
def one(seed):
    ids = torch.randint(vocab // 50, vocab * 4 // 5, (64,), generator=torch.Generator().manual_seed(seed)).tolist()
    r = eng.generate(GenerationRequest(ids, SamplingParams(max_tokens={tokens}, ignore_eos=True)))
    return r.stats.decode_tokens_per_s
one(0)      # warm
for phase, n in zip({phases!r}, ({requests}, {requests}, {requests})):
    # the busy processes end with the phase, or after 15 minutes whatever happens to this one
    hogs = ([subprocess.Popen(["timeout", "900", "sh", "-c", "while :; do :; done"]) for _ in range({hogs})]
            if phase == "busy" else [])
    try:
        time.sleep(0.5 if hogs else 0)
        got = [one(i + 1) for i in range(n)]
    finally:
        for h in hogs:
            h.terminate()       # timeout passes it on to its loop
            h.wait()
    time.sleep(0.5 if hogs else 0)
    print(json.dumps(dict(phase=phase, tok_s=got, threads=threads_dict(eng.threads))), flush=True)
'''


def run_child(args, adaptive: bool) -> dict:
    code = _CHILD.format(threads=args.threads, model=args.model, adaptive=adaptive, tokens=args.tokens,
                         phases=PHASES, requests=args.requests, hogs=args.hogs)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if r.returncode != 0:
        raise SystemExit(f"child failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return {row["phase"]: row for row in map(json.loads, (x for x in r.stdout.splitlines() if x.startswith("{")))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--hogs", type=int, default=1, help="busy processes in the middle phase")
    p.add_argument("--tokens", type=int, default=256, help="decoded tokens a request")
    p.add_argument("--requests", type=int, default=3, help="requests a phase")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; {args.threads} threads, {args.hogs} busy process(es) in the middle phase; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    got: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    ended: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
    for r in range(args.rounds):
        for adaptive in ((False, True) if r % 2 == 0 else (True, False)):
            rows = run_child(args, adaptive)
            for phase in PHASES:
                got[adaptive].setdefault(phase, []).extend(rows[phase]["tok_s"])
                ended[adaptive].setdefault(phase, []).append(rows[phase]["threads"]["current"])
            print(f"  round {r + 1} adaptive {'on ' if adaptive else 'off'}: "
                  + "; ".join(f"{ph} {' '.join(f'{x:.1f}' for x in rows[ph]['tok_s'])} tok/s "
                              f"(threads {rows[ph]['threads']['current']}, trials {rows[ph]['threads'].get('trials', 0)})"
                              for ph in PHASES), flush=True)
    print("\n| phase | off tok/s | on tok/s | on / off | threads at the phase's end (on) |")
    print("|---|---|---|---|---|")
    for phase in PHASES:
        off, on = statistics.median(got[False][phase]), statistics.median(got[True][phase])
        print(f"| {phase} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {ended[True][phase]} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
