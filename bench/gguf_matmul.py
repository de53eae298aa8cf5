"""GGUF int8-activation matmul (turnkv/kernels) against float32 F.linear of the dequantized weight.

    .venv/bin/python bench/gguf_matmul.py [--isa avx2] [--types Q4_0,Q4_K] [--threads 2]

GEMV (M = 1, 4, 8) on a [32768, 2048] weight (larger than the L3, so it streams from DRAM),
GEMM (M = 64, 512) on [4096, 2048]. Prints the CPU model, the measured read bandwidth
(torch.sum over 256 MB), and per qtype and M: time, weight GB/s, its share of the read
bandwidth, rows/s (tokens/s for one projection of this size) and the ratio to F.linear.
Each timing is the best of repeated calls within ~0.25 s; the whole run takes ~25 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

import turnkv.kernels as tk  # noqa: E402
from bench.machine import cpu_model  # noqa: E402
from turnkv.kernels import GGUFWeight  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16"]
GEMV = (32768, 2048)
GEMM = (4096, 2048)




def random_weight(qtype: Q, n: int, k: int, seed: int = 0) -> GGUFWeight:
    """Valid random blocks (random bits, small finite f16 scales): fast to make at any size."""
    if qtype in (Q.F16, Q.BF16):    # float weights kept as stored: small normal values
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
        w = w.to(torch.float16 if qtype == Q.F16 else torch.bfloat16)
        return GGUFWeight.from_raw(w.view(torch.uint8).reshape(n, 2 * k), qtype, (n, k))
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    half = lambda: rng.uniform(1e-4, 1e-3, size=(n, k // block)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    if qtype == Q.Q6_K:
        b[..., 208:210] = half()
    elif qtype == Q.Q3_K:
        b[..., 108:110] = half()
    elif qtype == Q.Q2_K:
        b[..., 80:82] = half()
        b[..., 82:84] = half()
    elif qtype == Q.MXFP4:   # one E8M0 byte: scales 2^-10 .. 2^-4
        b[..., 0] = rng.integers(118, 125, size=(n, k // block))
    elif qtype in (Q.TQ1_0, Q.TQ2_0):
        b[..., size - 2:] = half()
    elif qtype == Q.IQ1_M:   # d's 4 nibbles in the top of its 4 scale words
        d = half().view(np.uint16)[..., 0]
        for i, byte in enumerate((49, 51, 53, 55)):
            b[..., byte] = (b[..., byte] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    else:
        b[..., 0:2] = half()
        if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
            b[..., 2:4] = half()
    return GGUFWeight.from_raw(b.reshape(n, -1), qtype, (n, k))


def best_time(fn, budget: float = 0.25, min_reps: int = 3) -> float:
    fn()
    best, t_end, reps = float("inf"), time.perf_counter() + budget, 0
    while reps < min_reps or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def read_bandwidth() -> float:
    big = torch.ones(64 * 1024 * 1024)  # 256 MB
    return big.numel() * 4 / best_time(lambda: big.sum(), budget=0.5) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=None, help="native path (default: the best on this CPU)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = read_bandwidth()
    isa = args.isa or (tk.best_isa() if tk.native_available() else None)
    print(f"CPU: {cpu_model()} | threads {args.threads} | kernels: {tk.kernel_info()}"
          f"{' (forced ' + isa + ')' if args.isa else ''} | read bandwidth {bw:.1f} GB/s (torch.sum, 256 MB)")
    print(f"GEMV M=1,4,8 on [N,K]={list(GEMV)}; GEMM M=64,512 on {list(GEMM)}; "
          "GB/s = weight bytes / time; vs F.linear = float32 F.linear time / kernel time")
    print(f"{'qtype':6} {'M':>4} {'ms':>8} {'GB/s':>6} {'%bw':>5} {'rows/s':>9} {'F.linear ms':>11} {'vs F.linear':>11}")
    flin: dict[tuple, float] = {}
    for name in args.types.split(","):
        qt = Q[name]
        for shape, ms in ((GEMV, (1, 4, 8)), (GEMM, (64, 512))):
            w = random_weight(qt, *shape)
            wf = None
            for m in ms:
                x = torch.randn(m, shape[1])
                key = (shape, m)
                if key not in flin:
                    wf = w.dequantize() if wf is None else wf
                    flin[key] = best_time(lambda: F.linear(x, wf))
                use_native = tk.native_available()
                dt = best_time(lambda: w.matmul(x, isa=isa, native=use_native))
                gbs = w.nbytes / dt / 1e9
                print(f"{name:6} {m:4d} {dt * 1e3:8.3f} {gbs:6.1f} {100 * gbs / bw:4.0f}% {m / dt:9.0f} "
                      f"{flin[key] * 1e3:11.3f} {flin[key] / dt:10.2f}x", flush=True)
            del wf


if __name__ == "__main__":
    main()
