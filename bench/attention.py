"""Native attention kernel (turnkv/kernels/csrc/attention.cpp) vs torch SDPA, on the bundled
models' head shapes: decode (1 query over 1000 keys) and a causal 512-token prefill chunk.
Median of repeated calls; ``--threads`` (default 1 and 2). See docs/kernels.md."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench.machine import cpu_model  # noqa: E402
from turnkv.kernels import attention as A  # noqa: E402

SHAPES = {"smollm2 (9q/3kv x 64)": (9, 3, 64), "gemma3-270m (4q/1kv x 256)": (4, 1, 256)}


def median_us(f, n: int) -> float:
    f()
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--prefill", type=int, default=512)
    a = ap.parse_args()
    print(f"CPU: {cpu_model()}; attention path: {A.attention_info()}; torch {torch.__version__}")
    print("| threads | shape | decode native us | decode SDPA us | ratio | prefill native ms | prefill SDPA ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for th in a.threads:
        torch.set_num_threads(th)
        for label, (hq, hk, d) in SHAPES.items():
            S, T, sc = a.keys, a.prefill, d ** -0.5
            q, k, v = torch.randn(hq, 1, d), torch.randn(hk, S, d), torch.randn(hk, S, d)
            nat = median_us(lambda: A.attend(q, k, v, S - 1, 0, "full", 0, sc), 300)
            sd = median_us(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], scale=sc,
                                                                  enable_gqa=hk != hq), 300)
            q2, k2, v2 = torch.randn(hq, T, d), torch.randn(hk, T, d), torch.randn(hk, T, d)
            nat2 = median_us(lambda: A.attend(q2, k2, v2, 0, 0, "full", 0, sc), 15) / 1e3
            sd2 = median_us(lambda: F.scaled_dot_product_attention(q2[None], k2[None], v2[None], is_causal=True,
                                                                   scale=sc, enable_gqa=hk != hq), 15) / 1e3
            print(f"| {th} | {label} | {nat:.0f} | {sd:.0f} | {sd / nat:.2f}x | {nat2:.1f} | {sd2:.1f} | {sd2 / nat2:.2f}x |")


if __name__ == "__main__":
    main()
