"""``bench/realsize.py run``: turnkv against llama.cpp and ik_llama.cpp on the same GGUF files.

Each engine runs alone (``flock /tmp/turnkv-bench.lock``; turnkv in a child process, so its
resident memory and load time are its own), with the same thread count. Each file is read once
before its engines run (``warm``), so the first engine's load time is not the disk's: session 19's
quiet run had IQ4_XS loading in 7.9 s against Q4_K_M's 0.8 s, and both load alike from the page
cache (docs/measurements/2026-12-07-decode-zen2.md)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.machine import cpu_model, describe_kernel
from bench.realsize_models import LLAMA_CPP, PEERS

ROOT = Path(__file__).resolve().parent.parent
LOCK = "/tmp/turnkv-bench.lock"
IK_BENCH = PEERS / "ik" / "src" / "build" / "bin" / "llama-bench"
PROMPT, DECODE = 512, 128

# turnkv in a child: load, RSS after load, one 512-token prefill + 128 decoded tokens (twice: the
# first run warms the kernels and allocator, the second is reported)
_TURNKV = r'''
import json, os, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
from turnkv.engine.engine import Engine
from turnkv.engine.sequence import GenerationRequest
from turnkv.engine.sampling import SamplingParams
from bench.machine import kernel_counters, kernel_delta
t1 = time.perf_counter()
rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
k0 = kernel_counters()
# K/V in `turnkv serve`'s default mode ("auto": float16 under the GGUF weights), as llama.cpp's f16
eng = Engine.load({path!r}, weights=None, progress=False, max_context=1024, kv_mode="auto")
t2 = time.perf_counter()
load_kernel = kernel_delta(k0, kernel_counters())
# what `turnkv serve` does on a background thread once it answers: the weights to huge pages
from turnkv.kernels.weight_memory import collapse
moved = collapse()
t3 = time.perf_counter()
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
out = {{}}
# the K/V bytes a decode step reads, at the decode's mean context (a sliding or chunked layer's at most its window)
ctx = {prompt} + {decode} / 2
kv = sum(p.store.bytes_per_token() * min(ctx, spec.window or spec.chunk or ctx)
         for spec, p in zip(eng.specs, eng.pool.block_pools) if p is not None)
vocab = eng.requests.model.vocab_size
for i, seed in enumerate((11, 12)):
    ids = torch.randint(vocab // 50, vocab * 4 // 5, ({prompt},), generator=torch.Generator().manual_seed(seed)).tolist()
    req = GenerationRequest(ids, SamplingParams(max_tokens={decode}, ignore_eos=True))
    r = eng.generate(req)
    s = r.stats
    out = dict(prefill_tps={prompt} / (s.prefill_ms / 1e3), decode_tps=s.decode_tokens_per_s,
               prefilled=s.prefilled_tokens, generated=len(r.token_ids))
print(json.dumps(dict(out, kv_step_bytes=kv, import_s=t1 - t0, load_s=t2 - t1, rss=rss, rss_load=rss - rss0, huge_mb=moved / 1e6,
                      collapse_s=t3 - t2, load_kernel=load_kernel)))
'''


def _locked(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["flock", LOCK, *cmd], capture_output=True, text=True, **kw)


def run_turnkv(path: Path, threads: int) -> dict:
    code = _TURNKV.format(path=str(path), threads=threads, prompt=PROMPT, decode=DECODE)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = _locked([sys.executable, "-c", code], cwd=ROOT, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama_bench(exe: Path, path: Path, threads: int, extra=()) -> dict:
    """llama-bench's prompt-processing and generation rates (tokens/s), from its JSON output."""
    cmd = [str(exe), "-m", str(path), "-p", str(PROMPT), "-n", str(DECODE), "-t", str(threads), "-o", "json", *extra]
    t0 = time.perf_counter()
    r = _locked(cmd)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    rows = json.loads(r.stdout[r.stdout.index("["):])
    out = {"wall_s": time.perf_counter() - t0}
    for row in rows:
        key = "prefill_tps" if row.get("n_prompt") else "decode_tps"
        out[key] = row["avg_ts"]
    return out


def warm(path: Path, chunk: int = 16 << 20) -> float:
    """Read the file once, into the page cache (every engine then loads it from memory); seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def bandwidth_probe(threads: int, mb: int = 512) -> float:
    """Bytes per second ``threads`` threads read from memory: a torch sum over ``mb`` MB of float32
    (a read-only stream, as a decode step's weights are; far from the adds' limit), best of 5,
    under the bench lock as the engines' runs are."""
    import fcntl

    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mb << 18, dtype=torch.float32)
    best = float("inf")
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(5):
            t0 = time.perf_counter()
            src.sum()
            best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best


def _mratio(tks: list[dict], peers: list[dict], key: str) -> str:
    """The median over rounds of turnkv's ``key`` over the peer's in the same round."""
    got = [t[key] / p[key] for t, p in zip(tks, peers) if t.get(key) and p.get(key)]
    return f"{statistics.median(got):.2f}x" if got else "-"


def run_all(preset: str, files: dict[str, Path], threads: int, rounds: int = 1) -> None:
    """Times each file on each engine, ``rounds`` times (each round's engines in the reverse order
    of the last's: turnkv, llama.cpp, ik_llama.cpp, then ik_llama.cpp, llama.cpp, turnkv), and prints
    one table of medians: each ratio the median of the rounds' ratios. A VM's memory speed can move
    1.5x between minutes (docs/measurements/2026-12-07-session25.md), so one round's ratio is only as
    good as the minutes its engines shared; more rounds, alternated, take that out."""
    print(f"CPU: {cpu_model()}, {threads} threads; load average {os.getloadavg()[0]:.1f}", flush=True)
    llama_bench = LLAMA_CPP / "build" / "bin" / "llama-bench"
    if not IK_BENCH.exists():
        print(f"ik_llama.cpp: {IK_BENCH} not built, skipped", flush=True)
    rows = []
    for qtype, path in files.items():
        size = path.stat().st_size
        print(f"{path.name} ({size / 1e6:.0f} MB): read once in {warm(path):.1f} s", flush=True)
        tks, lcs, iks = [], [], []
        for r in range(rounds):
            engines = ["turnkv", "llama.cpp", "ik_llama.cpp"][::-1 if r % 2 else 1]
            for engine in engines:
                print(f"  round {r + 1}/{rounds}: {engine} ...", flush=True)
                if engine == "turnkv":
                    # the machine's memory speed moves between minutes (a VM): a probe right before
                    # and right after turnkv's run, the decode's share taken against their mean
                    before = bandwidth_probe(threads)
                    tk = run_turnkv(path, threads)
                    after = bandwidth_probe(threads)
                    tk["probe_gbs"] = (before + after) / 2e9
                    print(f"  read bandwidth probe (torch sum, {threads} threads) before / after turnkv: "
                          f"{before / 1e9:.1f} / {after / 1e9:.1f} GB/s\n  turnkv {tk}", flush=True)
                    tks.append(tk)
                elif engine == "llama.cpp":
                    lcs.append(run_llama_bench(llama_bench, path, threads))
                    print(f"  llama.cpp {lcs[-1]}", flush=True)
                else:
                    iks.append(run_llama_bench(IK_BENCH, path, threads, ("-rtr", "1")) if IK_BENCH.exists() else {})
                    if iks[-1]:
                        print(f"  ik_llama.cpp {iks[-1]}", flush=True)
        rows.append((qtype, size, tks, lcs, iks, path))
    _table(preset, rows, rounds)


def _experts(path: Path) -> int:
    """The GGUF's expert count (0 for a dense model)."""
    from gguf import GGUFReader
    for name, field in GGUFReader(path).fields.items():
        if name.endswith(".expert_count"):
            return int(field.parts[field.data[0]][0])
    return 0


def _median_run(tks: list[dict]) -> dict:
    """The round whose decode rate is the median (its other figures with it); an error if any failed."""
    bad = [t for t in tks if "error" in t]
    if bad:
        return bad[0]
    return sorted(tks, key=lambda t: t["decode_tps"])[(len(tks) - 1) // 2]


def _table(preset: str, rows, rounds: int = 1) -> None:
    print(f"\n{preset}: {PROMPT}-token prefill, {DECODE} decoded tokens (tok/s)"
          + (f"; medians of {rounds} rounds (ratios: the median of the rounds' ratios)" if rounds > 1 else ""))
    # RSS: the process after the load; "load" what the load added to the process (torch's own
    # libraries are resident before it). Load: wall seconds (the process's CPU seconds); a wall far
    # above the CPU waited on something, which the kernel's counters below each table name
    print("| file | turnkv prefill | decode | vs llama.cpp (p / d) | vs ik -rtr (p / d) | load s (CPU) "
          "| RSS (load) / file MB | decode GB/s, weights + K/V (share of the probes' mean) |")
    print("|---|---|---|---|---|---|---|---|")
    moe = any(_experts(path) for _, _, _, _, _, path in rows)
    for qtype, size, tks, lcs, iks, _ in rows:
        tk = _median_run(tks)
        if "error" in tk:
            print(f"| {qtype} | turnkv failed: {tk['error']} |")
            continue
        # weights read once per token (the file: a tied embedding is the head; an untied table counts
        # whole though a step reads one row of it) and the K/V at the decode's mean context
        # (Qwen3-4B's 576 tokens of float16: 85 MB, 3.7% of its weights)
        gbs = (size + tk.get("kv_step_bytes", 0)) * tk["decode_tps"] / 1e9
        bw = tk["probe_gbs"]
        share = "- (MoE: a token reads its experts only)" if moe else f"{gbs:.1f} ({gbs / bw:.0%} of {bw:.1f})"
        prefill = statistics.median(t["prefill_tps"] for t in tks)
        print(f"| {qtype} | {prefill:.1f} | {tk['decode_tps']:.1f} "
              f"| {_mratio(tks, lcs, 'prefill_tps')} / {_mratio(tks, lcs, 'decode_tps')} "
              f"| {_mratio(tks, iks, 'prefill_tps')} / {_mratio(tks, iks, 'decode_tps')} "
              f"| {tk['load_s']:.1f} ({tk['load_kernel'].get('cpu_s', 0):.1f}) "
              f"| {tk['rss'] / 1e6:.0f} ({tk['rss_load'] / 1e6:.0f}) / {size / 1e6:.0f} "
              f"| {share} |")
    for qtype, size, tks, lcs, iks, _ in rows:
        for r, (tk, lc, ik) in enumerate(zip(tks, lcs, iks)):
            tag = f"{qtype}" + (f" round {r + 1}" if rounds > 1 else "")
            mine = (f"turnkv failed: {tk['error']}" if "error" in tk
                    else f"turnkv prefill / decode {tk['prefill_tps']:.1f} / {tk['decode_tps']:.1f}")
            print(f"{tag}: {mine}; "
                  f"llama.cpp {lc}; ik_llama.cpp {ik or 'not built'}")
            if "load_kernel" in tk:
                print(f"{tag}: during turnkv's load: {describe_kernel(tk['load_kernel'])}")
