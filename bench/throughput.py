"""Prefill and decode throughput: turnkv (each weight format) against transformers, side by side.

    python bench/throughput.py [--models smollm2-135m,gemma3-270m] [--reps 3]
                               [--prompt-tokens 1000] [--decode-tokens 32]
                               [--formats float32:native,bfloat16:native,bfloat16:int8,bfloat16:int4]

For every model it loads the bundled GGUF once with turnkv's loader (float32 tensors), builds one
turnkv model per format (``dtype:weights[:kv-cache-mode]``, see turnkv/models/weights.py) and transformers' model
(``from_pretrained(dir, gguf_file=..., dtype=float32)``, or ``--hf-load tensors``: the same
tensors put into ``from_config``, which skips transformers' slow GGUF dequantization). Then, for
each repetition, every engine in turn:

- prefill: one forward over a ``--prompt-tokens`` prompt from an empty cache, last-token logits
  only (transformers: ``logits_to_keep=1``), tok/s = prompt tokens / seconds;
- decode: ``--decode-tokens`` greedy steps continuing that prompt, one token per forward with the
  engine's own KV cache (transformers: its DynamicCache), tok/s = tokens / seconds.

Medians over the repetitions are printed with the ratio to transformers and the goals
(prefill >= 1.5x, decode >= 3x). Both engines run in this one process under the same thread and
malloc settings (``turnkv.launch.configure_process``; ``--no-tune`` leaves glibc's defaults).
The last two columns compare each format with transformers float32 on the prompt's last-token
logits (max |diff|) and on the greedy continuation (tokens equal before the first mismatch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turnkv.cache.specs import default_modes, make_caches  # noqa: E402
from turnkv.launch import RECOMMENDED_MALLOC, configure_process  # noqa: E402
from turnkv.loading import load_checkpoint  # noqa: E402
from turnkv.models import family_class  # noqa: E402
from turnkv.models.weights import load_model  # noqa: E402

PREFILL_GOAL, DECODE_GOAL = 1.5, 3.0
DEFAULT_FORMATS = "float32:native,bfloat16:native,float32:auto,bfloat16:auto"


@dataclass
class Sample:
    prefill: list[float] = field(default_factory=list)   # tok/s per repetition
    decode: list[float] = field(default_factory=list)
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    load_s: float = 0.0


def parse_format(spec: str) -> tuple[torch.dtype, str, str]:
    """``dtype:weights[:kv-mode]``, e.g. ``float32:int4:int8``"""
    dtype, _, rest = spec.partition(":")
    weights, _, kv = rest.partition(":")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], weights or "native", kv or "native"


def run_turnkv(model, dtype: torch.dtype, kv: str, prompt: torch.Tensor, steps: int):
    specs = model.cache_specs()
    caches = make_caches(specs, dtype=dtype, modes=default_modes(specs, kv))
    t0 = time.perf_counter()
    logits = model.step(prompt, caches, logits="last")
    t1 = time.perf_counter()
    first = logits.float().clone()
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        logits = model.step(torch.tensor([tokens[-1]]), caches, logits="last")
        tokens.append(int(logits.argmax()))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, first, tokens


def run_transformers(hf, prompt: torch.Tensor, steps: int):
    t0 = time.perf_counter()
    out = hf(prompt[None], use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    first = out.logits[0, -1].float().clone()
    cache = out.cache
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        cache = out.cache
        tokens.append(int(out.logits[0, -1].argmax()))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, first, tokens


def load_transformers(ckpt, how: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if how == "gguf":
        src = Path(ckpt.source)
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    else:
        cfg = dict(ckpt.config)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf.load_state_dict(ckpt.tensors, strict=False)  # tied lm_head is absent from the tensors
    return hf.eval()


def bench_model(name: str, args) -> list[tuple]:
    t = time.perf_counter()
    ckpt = load_checkpoint(name, dtype=torch.float32, progress=False)
    print(f"[{name}] turnkv checkpoint loaded in {time.perf_counter() - t:.1f}s", flush=True)
    engines: dict[str, tuple] = {}
    samples: dict[str, Sample] = {}
    cls = family_class(ckpt.architecture)
    for spec in args.formats.split(","):
        dtype, weights, kv = parse_format(spec)
        t = time.perf_counter()
        engines[spec] = (load_model(cls, ckpt.config, ckpt.tensors, dtype, weights), dtype, kv)
        samples[spec] = Sample(load_s=time.perf_counter() - t)
    t = time.perf_counter()
    hf = load_transformers(ckpt, args.hf_load)
    samples["transformers"] = Sample(load_s=time.perf_counter() - t)
    print(f"[{name}] transformers loaded ({args.hf_load}) in {samples['transformers'].load_s:.1f}s", flush=True)

    gen = torch.Generator().manual_seed(0)
    vocab = min(int(ckpt.config["vocab_size"]), 32000)
    prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=gen)
    with torch.inference_mode():
        # warm-up: one short pass each (first-call allocations, oneDNN primitive creation)
        for spec, (model, dtype, kv) in engines.items():
            run_turnkv(model, dtype, kv, prompt[:64], 2)
        run_transformers(hf, prompt[:64], 2)
        for rep in range(args.reps):
            for key in ["transformers", *engines]:
                if key == "transformers":
                    p, d, first, toks = run_transformers(hf, prompt, args.decode_tokens)
                else:
                    p, d, first, toks = run_turnkv(*engines[key], prompt, args.decode_tokens)
                s = samples[key]
                s.prefill.append(args.prompt_tokens / p)
                s.decode.append((args.decode_tokens - 1) / d)
                s.last_logits, s.tokens = first, toks
            print(f"[{name}] repetition {rep + 1}/{args.reps} done", flush=True)
    ref = samples["transformers"]
    rows = []
    for key, s in samples.items():
        pf, dc = statistics.median(s.prefill), statistics.median(s.decode)
        rpf, rdc = pf / statistics.median(ref.prefill), dc / statistics.median(ref.decode)
        diff = (s.last_logits - ref.last_logits).abs().max().item()
        agree = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b), len(ref.tokens))
        rows.append((name, key, pf, rpf, dc, rdc, diff, agree, len(ref.tokens), s.load_s))
    del engines, hf
    return rows


def print_table(rows: list[tuple], args) -> None:
    print()
    print(f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens at that context, "
          f"median of {args.reps}; threads={torch.get_num_threads()}")
    head = (f"{'model':14s} {'engine':18s} {'prefill tok/s':>13s} {'x hf':>6s} {'decode tok/s':>12s} "
            f"{'x hf':>6s}  {'goals':7s} {'max|dlogit|':>11s} {'greedy=hf':>9s} {'build s':>7s}")
    print(head)
    print("-" * len(head))
    for name, key, pf, rpf, dc, rdc, diff, agree, n, load_s in rows:
        goals = "" if key == "transformers" else (
            ("P" if rpf >= PREFILL_GOAL else "-") + ("D" if rdc >= DECODE_GOAL else "-"))
        print(f"{name:14s} {key:18s} {pf:13.0f} {rpf:6.2f} {dc:12.1f} {rdc:6.2f}  {goals:7s} "
              f"{diff:11.2e} {agree:>5d}/{n:<3d} {load_s:7.1f}")
    print(f"goals: P = prefill >= {PREFILL_GOAL}x transformers, D = decode >= {DECODE_GOAL}x transformers")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--formats", default=DEFAULT_FORMATS,
                    help="comma list of dtype:weights[:kv-cache-mode], e.g. float32:auto:int8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="default: one per core")
    ap.add_argument("--hf-load", choices=("gguf", "tensors"), default="gguf",
                    help="gguf: transformers' own GGUF loader (slow); tensors: same weights via from_config")
    ap.add_argument("--no-tune", action="store_true", help="leave glibc malloc at its defaults")
    args = ap.parse_args(argv)
    settings = configure_process(args.threads, malloc=None if args.no_tune else RECOMMENDED_MALLOC)
    print(f"threads={settings.threads} malloc tuned={settings.malloc_applied}", flush=True)
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args)
    print_table(rows, args)


if __name__ == "__main__":
    main()
