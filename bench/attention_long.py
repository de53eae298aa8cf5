"""Decode attention at long context, per KV mode, without prefilling: random K/V of a model's
shape (default Llama-3.2-1B: 32 query / 8 K/V heads of 64, 16 layers) written straight into
buffers of each mode's storage, then one query row attends over all of them, layer after layer
(each layer its own K/V, so a step reads them from memory as a real one does).

Per mode and thread count: ms a layer (median of the rounds' per-layer means), the K/V bytes
read per second and ns a key row (the K and V rows of one kv head, for all its query heads;
times the clock in GHz: cycles a row). One thread is timed in the calling thread's CPU time (steadier than wall time on
a shared machine); more threads in wall time. int4 is read from its packed rows by the kernel (which
widens them to float32 itself); ``int4-copy`` times what a step paid before that: a float32 copy
made in Python (``Int4Store.decode``), then the kernel on it.

    python bench/attention_long.py --keys 32768 --modes fp16 int8 int4 --threads 1 2

``--queries N`` times a prefill chunk instead: N queries at the last N positions attend causally
over the keys (a long prompt's last chunk); ``--block-rows`` sets the kernel's ``set_block_rows``
(int8 / float16 / bfloat16 spans of that many queries or more widen each key block once per tile,
0: never; the same bits either way) for an A/B in one process.

    python bench/attention_long.py --keys 32768 --queries 512 --layers 2 --modes fp16 int8 --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench.machine import cpu_model  # noqa: E402
from turnkv.cache import storage as S  # noqa: E402
from turnkv.kernels import attention as A  # noqa: E402


def layer_kv(mode: str, hk: int, keys: int, d: int, gen: torch.Generator):
    """(k, v, scales or None, decode or None): one layer's K/V as ``mode`` stores it."""
    x = torch.randn(2, hk, keys, d, generator=gen)
    if mode == "fp32":
        return x[0], x[1], None, None
    if mode in ("fp16", "bf16"):
        dt = torch.float16 if mode == "fp16" else torch.bfloat16
        return x[0].to(dt), x[1].to(dt), None, None
    if mode == "int8":
        (kq, ks), (vq, vs) = S.quantize_int8(x[0]), S.quantize_int8(x[1])
        return kq, vq, (ks, vs), None
    store = S.Int4Store(hk, d, torch.float32, "cpu", capacity=0)
    stored = {which: S.quantize_int4(x[i], store.groups[which], store.rotation[which])
              for i, which in enumerate(("k", "v"))}
    parts = {"k": stored["k"][0], "k_scale": stored["k"][1], "v": stored["v"][0], "v_scale": stored["v"][1]}
    if mode == "int4":
        return parts["k"], parts["v"], (parts["k_scale"], parts["v_scale"]), None
    return None, None, None, (store, parts)


def kv_bytes(layer) -> int:
    k, v, sc, dec = layer
    ts = [k, v, *(sc or ())] if dec is None else list(dec[1].values())
    return sum(t.numel() * t.element_size() for t in ts)


def step(q, layers, keys: int, scale: float) -> None:
    for k, v, sc, dec in layers:
        if dec is not None:
            k, v = dec[0].decode(dec[1])
        A.attend_native(q, k, v, keys - q.shape[1], 0, "full", 0, scale, scales=sc)


def measure(q, layers, keys: int, scale: float, rounds: int, threads: int) -> float:
    """Median over rounds of the mean ms a layer (CPU time of this thread at 1 thread, else wall)."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    step(q, layers, keys, scale)
    ts = []
    for _ in range(rounds):
        t = clock()
        step(q, layers, keys, scale)
        ts.append((clock() - t) / len(layers) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], metavar=("HQ", "HK", "D"))
    ap.add_argument("--modes", nargs="*", default=["fp16", "int8", "int4"])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--queries", type=int, default=1, help="queries a call (1: decode; N: a causal prefill chunk)")
    ap.add_argument("--block-rows", type=int, default=None, help="the kernel's set_block_rows (A/B)")
    a = ap.parse_args()
    if a.block_rows is not None:
        torch.ops.turnkv_attn.set_block_rows(a.block_rows)
    hq, hk, d = a.heads
    print(f"CPU: {cpu_model()}; attention path: {A.attention_info()}; load {os.getloadavg()[0]:.1f}; "
          f"{hq} q / {hk} kv heads x {d}, {a.keys} keys, {a.queries} queries a call, {a.layers} layers"
          + ("" if a.block_rows is None else f", block rows {a.block_rows}"))
    print("| mode | threads | ms a layer | K/V MB a layer | GB/s | ns a key row |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(hq, a.queries, d, generator=gen)
    for mode in a.modes:
        layers = [layer_kv(mode, hk, a.keys, d, gen) for _ in range(a.layers)]
        mb = kv_bytes(layers[0]) / 1e6
        for th in a.threads:
            torch.set_num_threads(th)
            ms = measure(q, layers, a.keys, d ** -0.5, a.rounds, th)
            row_ns = ms * 1e6 / (hk * a.keys) * (th if th > 1 else 1)   # a thread's time a row
            print(f"| {mode} | {th} | {ms:.2f} | {mb:.1f} | {mb / ms:.1f} | {row_ns:.2f} |", flush=True)
        del layers
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
