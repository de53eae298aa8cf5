"""A GGUF weight on its native kernel against the float32 copy a loader without that kernel
makes (F.linear on the dequantized weight), alternated in one process so that a shared
machine's load falls on both; medians of rounds.

    .venv/bin/python bench/native_vs_float.py [--types IQ4_NL,IQ4_XS,F16,BF16] [--threads 1]
        [--shapes 8192x2048,2048x8192] [--rows 1,8]

[N, K] = [8192, 2048] (Llama-3.2-1B's gate / up) by default, M = 1 (decode) and 8 (a decode
batch); each call cycles through 4 random copies so the weights come from memory, not the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

import turnkv.kernels as tk  # noqa: E402
from bench.gguf_matmul import random_weight  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

COPIES = 4


def per_call(fn, items) -> float:
    t = time.perf_counter()
    for it in items:
        fn(it)
    return (time.perf_counter() - t) / len(items)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="IQ4_NL,IQ4_XS,F16,BF16,Q4_0,Q4_K")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="8192x2048", help="N x K of the weight, comma-separated")
    ap.add_argument("--rows", default="1,8", help="activation rows M, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} | threads {args.threads} | kernels: {tk.kernel_info()}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        print(f"[N, K] = [{n}, {k}]")
        for name in args.types.split(","):
            run_type(Q[name], n, k, [int(m) for m in args.rows.split(",")], args.rounds)


def run_type(qtype: Q, n: int, k: int, rows: list[int], rounds: int) -> None:
    ws = [random_weight(qtype, n, k, seed=i) for i in range(COPIES)]
    fs = [w.dequantize() for w in ws]
    for m in rows:
        x = torch.randn(m, k)
        tn, tf = [], []
        for _ in range(rounds):
            tn.append(per_call(lambda w: w.matmul(x), ws))
            tf.append(per_call(lambda f: F.linear(x, f), fs))
        a, b = statistics.median(tn), statistics.median(tf)
        print(f"{qtype.name:7} M={m}: native {a * 1e3:7.3f} ms ({ws[0].nbytes / a / 1e9:5.1f} GB/s), float32 copy "
              f"{b * 1e3:7.3f} ms -> {b / a:5.2f}x; {ws[0].nbytes / 2**20:.1f} vs {fs[0].numel() * 4 / 2**20:.1f} MiB",
              flush=True)


if __name__ == "__main__":
    main()
