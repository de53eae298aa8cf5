"""``bench/realsize.py long``: long prompts on a real-size GGUF, turnkv beside ik_llama.cpp.

turnkv (a child process, under the benchmark lock) prefills a random prompt of each length and
decodes 32 tokens after it, so decode is timed at that context; ik_llama.cpp's ``llama-bench -rtr 1``
times ``-p 8192 -r 1`` (prefill) and ``-gp N,32`` (32 tokens generated after an N-token prompt) for the
lengths asked with ``--ik-lengths``. The issue's goals: prefill at 8192 >= 1.0x ik_llama.cpp, decode
at 32k >= 0.6x decode at 1k, and a 32k prompt that prefills without running out of memory."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.machine import cpu_model
from bench.realsize_run import IK_BENCH, ROOT, _locked

DECODE = 32

_TURNKV = r'''
import json, os, time
import torch
torch.set_num_threads({threads})
from turnkv.engine.engine import Engine
from turnkv.engine.sequence import GenerationRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.kernels.weight_memory import collapse
# K/V in `turnkv serve`'s default mode unless asked ("auto": float16 under the GGUF weights, as llama.cpp's f16)
eng = Engine.load({path!r}, weights=None, progress=False, max_context={ctx}, kv_mode={kv_mode!r})
collapse()
vocab = eng.requests.model.vocab_size
warm = GenerationRequest(list(range(1000, 1256)), SamplingParams(max_tokens={decode}, ignore_eos=True))
eng.generate(warm)    # the kernels' and allocator's first calls are not timed
for n in {lengths!r}:
    ids = torch.randint(vocab // 50, vocab * 4 // 5, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    t0 = time.perf_counter()
    r = eng.generate(GenerationRequest(ids, SamplingParams(max_tokens={decode}, ignore_eos=True)))
    s = r.stats
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(json.dumps(dict(n=n, prefill_tps=n / (s.prefill_ms / 1e3), decode_tps=s.decode_tokens_per_s,
                          prefilled=s.prefilled_tokens, wall_s=time.perf_counter() - t0, rss=rss)), flush=True)
'''


def run_turnkv_long(path: Path, threads: int, lengths: list[int], kv_mode: str = "auto") -> list[dict]:
    code = _TURNKV.format(path=str(path), threads=threads, ctx=max(lengths) + DECODE + 64,
                          lengths=lengths, decode=DECODE, kv_mode=kv_mode)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = _locked([sys.executable, "-c", code], cwd=ROOT, env=env)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0:
        rows.append({"error": (r.stderr.strip().splitlines() or ["failed"])[-1]})
    return rows


def run_ik_long(path: Path, threads: int, prefill: int, lengths: list[int]) -> dict:
    out = {}
    runs = [(f"prefill {prefill}", ["-p", str(prefill), "-n", "0"])]
    runs += [(f"decode at {n}", ["-p", "0", "-n", "0", "-gp", f"{n},{DECODE}"]) for n in lengths]
    for name, args in runs:
        # one repetition: llama-bench's default five take minutes a long prompt
        cmd = [str(IK_BENCH), "-m", str(path), "-t", str(threads), "-rtr", "1", "-r", "1", "-o", "json", *args]
        t0 = time.perf_counter()
        r = _locked(cmd)
        if r.returncode != 0:
            out[name] = {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
            continue
        rows = json.loads(r.stdout[r.stdout.index("["):])
        out[name] = {"tps": rows[-1]["avg_ts"], "wall_s": time.perf_counter() - t0}
        print(f"  ik_llama.cpp {name}: {out[name]}", flush=True)
    return out


def run_long(path: Path, threads: int, lengths: list[int], ik_lengths: list[int]) -> None:
    print(f"CPU: {cpu_model()}, {threads} threads; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{path.name}: turnkv, prompts of {lengths} tokens, {DECODE} decoded after each ...", flush=True)
    tk = run_turnkv_long(path, threads, lengths)
    for row in tk:
        print(f"  turnkv {row}", flush=True)
    ik = run_ik_long(path, threads, 8192, ik_lengths) if IK_BENCH.exists() else {}
    base = next((r["decode_tps"] for r in tk if r.get("n") == min(lengths)), None)
    print(f"\n| prompt | turnkv prefill tok/s | turnkv decode tok/s | decode vs at {min(lengths)} | RSS MB |")
    print("|---|---|---|---|---|")
    for r in tk:
        if "error" in r:
            print(f"| - | turnkv failed: {r['error']} |")
            continue
        print(f"| {r['n']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.1f} "
              f"| {r['decode_tps'] / base:.2f}x | {r['rss'] / 1e6:.0f} |")
    for name, v in ik.items():
        mine = next((r for r in tk if "error" not in r and name.endswith(f" {r['n']}")), None)
        if mine and "tps" in v:
            key = "prefill_tps" if name.startswith("prefill") else "decode_tps"
            print(f"ik_llama.cpp {name}: {v['tps']:.1f} tok/s; turnkv / ik {mine[key] / v['tps']:.2f}x")
        else:
            print(f"ik_llama.cpp {name}: {v}")
