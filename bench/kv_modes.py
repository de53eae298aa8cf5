"""KV storage modes on the bundled models: memory per token, accuracy (NLL), decode speed.

For each model and mode (native, bf16, fp16, int8, int4 on every attention layer):

* KV bytes per token: what one more token costs in the caches' stores, summed over layers
  (``store.bytes_per_token()``), and the live caches' ``nbytes`` after the NLL pass;
* NLL: mean negative log-likelihood per token of turnkv/data/coriolanus.txt, run as a chunked
  prefill (``--chunk`` tokens, logits="all"), so every chunk attends to the stored (quantized)
  keys and values of the chunks before it, as a cached multi-turn chat does;
* decode tok/s: single-token steps at ``--decode-context`` tokens of context (median step).

    .venv/bin/python bench/kv_modes.py                    # both models, ~5 min on 2 cores
    .venv/bin/python bench/kv_modes.py --max-tokens 1024 --models smollm2-135m   # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnkv.cache.kv import KVCache  # noqa: E402
from turnkv.cache.storage import MODES, NATIVE  # noqa: E402
from turnkv.cache.specs import default_modes, describe_modes, make_caches  # noqa: E402
from turnkv.loading import load_checkpoint  # noqa: E402
from turnkv.models import family_class  # noqa: E402

TEXT = ROOT / "turnkv" / "data" / "coriolanus.txt"
GOALS = {"int8": 0.01, "int4": 0.05}   # allowed NLL increase over native, nats/token


@dataclass
class Row:
    model: str
    mode: str
    layers: str
    bytes_per_token: int
    live_bytes: int
    nll: float
    tokens: int
    decode_tps: float
    read_ms: float
    seconds: float


def load_text() -> str:
    lines = TEXT.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[1:])   # line 1 is the provenance header


def attention_stores(caches) -> list:
    return [c.store for c in caches if isinstance(c, KVCache)]


def chunked_nll(model, caches, ids: torch.Tensor, chunk: int) -> float:
    """Mean NLL of ids[1:] given the prefix, prefilled ``chunk`` tokens at a time."""
    total = 0.0
    for a in range(0, ids.shape[0] - 1, chunk):
        b = min(a + chunk, ids.shape[0] - 1)
        logits = model.step(ids[a:b], caches, "all").float()
        logp = torch.log_softmax(logits, dim=-1)
        total -= logp.gather(-1, ids[a + 1:b + 1, None]).sum().item()
    return total / (ids.shape[0] - 1)


def decode_speed(model, caches, ids: torch.Tensor, context: int, steps: int, chunk: int) -> tuple[float, float]:
    """(median single-token steps per second after prefilling ``context`` tokens, milliseconds one
    step spends reading K/V out of the stores: every layer's ``read`` over the context, the cost a
    quantized mode adds to decode; best of 5, so it holds up on a busy machine)."""
    for a in range(0, context, chunk):
        model.step(ids[a:min(a + chunk, context)], caches, "none")
    times = []
    for i in range(steps):
        tok = ids[context + i:context + i + 1]
        t = time.perf_counter()
        model.step(tok, caches, "last")
        times.append(time.perf_counter() - t)
    reads = []
    for _ in range(5):
        t = time.perf_counter()
        for cache in caches:
            if isinstance(cache, KVCache):
                cache.store.read(0, cache.used)
        reads.append(time.perf_counter() - t)
    return 1.0 / statistics.median(times), 1000 * min(reads)


def run_model(name: str, modes: list[str], args) -> list[Row]:
    t0 = time.perf_counter()
    ckpt = load_checkpoint(name, progress=False)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    ids = torch.tensor(ckpt.tokenizer.encode(load_text()), dtype=torch.int64)
    ids = ids[: args.max_tokens]
    specs = model.cache_specs()
    print(f"# {name}: loaded in {time.perf_counter() - t0:.0f} s; {ids.shape[0]} tokens of {TEXT.name}; "
          f"{len(specs)} layers", flush=True)
    need = args.decode_context + args.decode_steps
    if ids.shape[0] < need:
        raise SystemExit(f"text has {ids.shape[0]} tokens, decode needs {need}: lower --decode-context")
    rows = []
    for mode in modes:
        t = time.perf_counter()
        table = default_modes(specs, mode, args.boundary_layers)
        with torch.inference_mode():
            caches = make_caches(specs, torch.float32, "cpu", table)
            nll = chunked_nll(model, caches, ids, args.chunk)
            live = sum(s.nbytes for s in attention_stores(caches))
            bpt = sum(s.bytes_per_token() for s in attention_stores(caches))
            tps, read_ms = decode_speed(model, make_caches(specs, torch.float32, "cpu", table), ids,
                                        args.decode_context, args.decode_steps, args.chunk)
        rows.append(Row(name, mode, describe_modes(table, specs), bpt, live, nll, ids.shape[0] - 1, tps,
                        read_ms, time.perf_counter() - t))
        r = rows[-1]
        print(f"#   {mode:<6} nll {r.nll:.4f}  {r.bytes_per_token} B/token  {r.decode_tps:.1f} tok/s  "
              f"KV read {r.read_ms:.2f} ms/step  ({r.seconds:.0f} s; {r.layers})", flush=True)
    return rows


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_table(rows: list[Row]) -> list[str]:
    """The results table; returns failed goals."""
    print()
    print(f"{'model':<14} {'mode':<6} {'KV B/tok':>9} {'f32/mode':>9} {'16bit/mode':>10} {'live MiB':>9} "
          f"{'NLL':>8} {'dNLL':>8} {'tok/s':>7} {'vs native':>9} {'KV read ms':>10}")
    failures = []
    for model in dict.fromkeys(r.model for r in rows):
        group = {r.mode: r for r in rows if r.model == model}
        base = group.get(NATIVE)
        half = group.get("bf16") or group.get("fp16")
        for r in group.values():
            d = r.nll - base.nll if base else float("nan")
            print(f"{model:<14} {r.mode:<6} {r.bytes_per_token:>9} "
                  f"{ratio(base.bytes_per_token, r.bytes_per_token) if base else '-':>9} "
                  f"{ratio(half.bytes_per_token, r.bytes_per_token) if half else '-':>10} "
                  f"{r.live_bytes / 2**20:>9.2f} {r.nll:>8.4f} {d:>+8.4f} {r.decode_tps:>7.1f} "
                  f"{ratio(r.decode_tps, base.decode_tps) if base else '-':>9} {r.read_ms:>10.2f}")
            if r.mode in GOALS and base and d > GOALS[r.mode]:
                failures.append(f"{model} {r.mode}: NLL +{d:.4f} > {GOALS[r.mode]}")
    print("\nf32/mode and 16bit/mode: how many times less KV memory per token than float32 (native here) "
          "and than bf16/fp16 storage.\ndNLL: nats/token over native; goals int8 <= 0.01, int4 <= 0.05.\n"
          "tok/s: median decode step at the decode context; KV read ms: what one such step spends reading "
          "K/V from the stores (dequantizing, for int8/int4).")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text scored (NLL)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk for the NLL pass")
    p.add_argument("--decode-context", type=int, default=1000)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--boundary-layers", type=int, default=0, help="first/last attention layers kept native")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default; 1 is steadier on a busy machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    t = time.perf_counter()
    rows = [r for name in args.models.split(",") for r in run_model(name, modes, args)]
    failures = print_table(rows)
    print(f"\ntotal {time.perf_counter() - t:.0f} s, {torch.get_num_threads()} threads")
    for f in failures:
        print("GOAL MISSED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
