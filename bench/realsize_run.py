"""``bench/realsize.py run``: turnkv against llama.cpp and ik_llama.cpp on the same GGUF files.

Each engine runs alone (``flock /tmp/turnkv-bench.lock``; turnkv in a child process, so its
resident memory and load time are its own), with the same thread count. Each file is read once
before its engines run (``warm``), so the first engine's load time is not the disk's: session 19's
quiet run had IQ4_XS loading in 7.9 s against Q4_K_M's 0.8 s, and both load alike from the page
cache (docs/measurements/2026-12-07-decode-zen2.md)."""

from __future__ import annotations

import json
import os
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


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def run_all(preset: str, files: dict[str, Path], threads: int) -> None:
    """Times each file on each engine and prints one table."""
    print(f"CPU: {cpu_model()}, {threads} threads; load average {os.getloadavg()[0]:.1f}", flush=True)
    llama_bench = LLAMA_CPP / "build" / "bin" / "llama-bench"
    if not IK_BENCH.exists():
        print(f"ik_llama.cpp: {IK_BENCH} not built, skipped", flush=True)
    rows = []
    for qtype, path in files.items():
        size = path.stat().st_size
        print(f"{path.name} ({size / 1e6:.0f} MB): read once in {warm(path):.1f} s; turnkv ...", flush=True)
        # the machine's memory speed moves by a third within half an hour (a VM): a probe right
        # before and right after turnkv's run, the decode's share taken against their mean
        before = bandwidth_probe(threads)
        tk = run_turnkv(path, threads)
        after = bandwidth_probe(threads)
        tk["probe_gbs"] = (before + after) / 2e9
        print(f"  read bandwidth probe (torch sum, {threads} threads) before / after turnkv: "
              f"{before / 1e9:.1f} / {after / 1e9:.1f} GB/s", flush=True)
        print(f"  turnkv {tk}\n  llama.cpp ...", flush=True)
        lc = run_llama_bench(llama_bench, path, threads)
        print(f"  llama.cpp {lc}", flush=True)
        ik = run_llama_bench(IK_BENCH, path, threads, ("-rtr", "1")) if IK_BENCH.exists() else {}
        if ik:
            print(f"  ik_llama.cpp {ik}", flush=True)
        rows.append((qtype, size, tk, lc, ik, path))
    _table(preset, rows)


def _experts(path: Path) -> int:
    """The GGUF's expert count (0 for a dense model)."""
    from gguf import GGUFReader
    for name, field in GGUFReader(path).fields.items():
        if name.endswith(".expert_count"):
            return int(field.parts[field.data[0]][0])
    return 0


def _table(preset: str, rows) -> None:
    print(f"\n{preset}: {PROMPT}-token prefill, {DECODE} decoded tokens (tok/s)")
    # RSS: the process after the load; "load" what the load added to the process (torch's own
    # libraries are resident before it). Load: wall seconds (the process's CPU seconds); a wall far
    # above the CPU waited on something, which the kernel's counters below each table name
    print("| file | turnkv prefill | decode | vs llama.cpp (p / d) | vs ik -rtr (p / d) | load s (CPU) "
          "| RSS (load) / file MB | decode GB/s, weights + K/V (share of the probes' mean) |")
    print("|---|---|---|---|---|---|---|---|")
    moe = any(_experts(path) for _, _, _, _, _, path in rows)
    for qtype, size, tk, lc, ik, _ in rows:
        if "error" in tk:
            print(f"| {qtype} | turnkv failed: {tk['error']} |")
            continue
        # weights read once per token (the file: a tied embedding is the head; an untied table counts
        # whole though a step reads one row of it) and the K/V at the decode's mean context
        # (Qwen3-4B's 576 tokens of float16: 85 MB, 3.7% of its weights)
        gbs = (size + tk.get("kv_step_bytes", 0)) * tk["decode_tps"] / 1e9
        bw = tk["probe_gbs"]
        share = "- (MoE: a token reads its experts only)" if moe else f"{gbs:.1f} ({gbs / bw:.0%} of {bw:.1f})"
        print(f"| {qtype} | {tk['prefill_tps']:.1f} | {tk['decode_tps']:.1f} "
              f"| {_ratio(tk['prefill_tps'], lc.get('prefill_tps'))} / {_ratio(tk['decode_tps'], lc.get('decode_tps'))} "
              f"| {_ratio(tk['prefill_tps'], ik.get('prefill_tps'))} / {_ratio(tk['decode_tps'], ik.get('decode_tps'))} "
              f"| {tk['load_s']:.1f} ({tk['load_kernel'].get('cpu_s', 0):.1f}) "
              f"| {tk['rss'] / 1e6:.0f} ({tk['rss_load'] / 1e6:.0f}) / {size / 1e6:.0f} "
              f"| {share} |")
    for qtype, size, tk, lc, ik, _ in rows:
        print(f"{qtype}: llama.cpp {lc}; ik_llama.cpp {ik or 'not built'}")
        if "load_kernel" in tk:
            print(f"{qtype}: during turnkv's load: {describe_kernel(tk['load_kernel'])}")
