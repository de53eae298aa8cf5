"""A/B a native-kernel switch over whole decode steps of a bundled model, in one process.

    python bench/decode_ab.py --model smollm2-135m --seqs 1,8 --switch pair
    python bench/decode_ab.py --model gemma3-270m --seqs 16 --switch fused_rows --values 8,31
    python bench/decode_ab.py --model F.gguf --seqs 1 --switch prefetch_fused --qtype Q8_0 --values 8192,0

Loads the model as `turnkv serve` does (its default weights, the GGUF's own blocks on the native
kernels, its default KV mode, glibc's heap and the weights on huge pages), starts N greedy sequences with
distinct prompts of ``--context`` tokens of the bench text, steps the engine until every one
decodes, then times ``Engine.step`` in blocks of ``--block`` steps with the switch at A and at B alternating (A B,
B A, A B, ...) for ``--rounds`` rounds. Prints the median step time of each value and the median
over rounds of B's time / A's (the machine's drift hits both alike); the CPU model first, the load
average beside each count. More than two values (``--values 0,1024,8192``) take turns the same
way (each round's order the last one's rotated by one), each compared with the first. The
switches change how a kernel runs, never its bits (tests/test_kernels.py and
tests/test_attention_kernel.py hold them to that), so both values decode the same tokens.

Switches (turnkv.kernels' native module): ``pair`` (the fused decode path pairs activation rows
in 512-bit vectors, 0/1; TURNKV_KERNEL_PAIR), ``fused_rows`` (the paired path's row limit, 8..31;
TURNKV_KERNEL_FUSED_ROWS), ``attn_spread`` (decode attention's next-block prefetches for K/V
rows of up to 128 bytes spread over the P.V pass, 1, or in bursts, 0; -1 by row size;
TURNKV_ATTN_SPREAD), ``attn_split`` (decode attention splits a unit's key blocks between the
threads when the units are fewer than this many a thread; 0 never; TURNKV_ATTN_SPLIT),
``prefetch_fused`` (the fused decode paths' prefetch distance in bytes, 0 = off, of the weights of
one type, ``--qtype``; TURNKV_KERNEL_PREFETCH_FUSED sets every type's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere
from bench.machine import cpu_model  # noqa: E402

# name -> (where its setter lives, the setter's name; default A,B). A setter returns the previous value.
SWITCHES = {"pair": ("gguf", "set_pair", "0,1"), "fused_rows": ("gguf", "set_fused_rows", "8,31"),
            "attn_spread": ("attn", "set_spread", "0,1"), "attn_split": ("attn", "set_split", "2,0"),
            "prefetch_fused": ("gguf", "set_prefetch_fused", "8192,0")}


def _ext():
    import turnkv.kernels as tk
    return tk._ext


def setter_for(name: str, qtype: str = "Q8_0"):
    where, fn, _ = SWITCHES[name]
    if name == "prefetch_fused":
        from gguf import GGMLQuantizationType
        qt = int(GGMLQuantizationType[qtype])
        return lambda v: _ext().set_prefetch_fused(qt, v)
    if where == "gguf":
        return getattr(_ext(), fn)
    import torch
    import turnkv.kernels.attention  # noqa: F401  (loads the build that registers torch.ops.turnkv_attn)
    return getattr(torch.ops.turnkv_attn, fn)


def ints_of(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) < 2 or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"want two or more distinct integers A,B[,C...], got {text!r}")
    return vals


def time_values(eng, setter, vals: list[int], rounds: int, block: int, clock=time.perf_counter):
    """Median step ms of each value per round, and each later value's time / the first's per round."""
    times = {v: [] for v in vals}
    ratios = {v: [] for v in vals[1:]}
    before = setter(vals[0])
    for r in range(rounds):
        order = vals[r % len(vals):] + vals[:r % len(vals)]
        med = {}
        for v in order:
            setter(v)
            ts = []
            for _ in range(block):
                t0 = clock()
                eng.step()
                ts.append(clock() - t0)
            med[v] = statistics.median(ts) * 1e3
            times[v].append(med[v])
        for v in vals[1:]:
            ratios[v].append(med[v] / med[vals[0]])
    setter(before)
    return times, ratios


def counts_of(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want positive counts like 1,8, got {text!r}")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a bundled name or a .gguf file")
    ap.add_argument("--seqs", type=counts_of, default=[1, 8],
                    help="comma-separated counts of sequences decoding at once")
    ap.add_argument("--context", type=int, default=800, help="prompt tokens of each sequence")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="pair")
    ap.add_argument("--values", type=ints_of, default=None,
                    help="A,B (default: pair 0,1; fused_rows 8,31; attn_spread 0,1; attn_split 2,0; "
                    "prefetch_fused 8192,0)")
    ap.add_argument("--qtype", default="Q8_0", help="prefetch_fused: the weights' type it sets (a GGUF type name)")
    ap.add_argument("--block", type=int, default=24, help="steps timed per value per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kv-cache-mode", default="auto", help="as `turnkv serve`'s (default auto: float16 or "
                    "bfloat16 K/V on the GGUF path)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="time steps in the main thread's CPU time (with "
                    "--threads 1: what a loaded machine's scheduler does not distort)")
    args = ap.parse_args(argv)

    from turnkv.launch import configure_process, ensure_hugepages, hugepages_state
    if argv is None:
        ensure_hugepages()    # as `turnkv serve` runs (turnkv/launch.py)
    configure_process(args.threads)
    from turnkv.engine.engine import Engine, GenerationRequest
    from turnkv.engine.sampling import SamplingParams
    if _ext() is None:
        print("decode_ab: the native kernels are not built (make setup)", file=sys.stderr)
        return 2
    setter = setter_for(args.switch, args.qtype)
    vals = args.values or ints_of(SWITCHES[args.switch][2])
    counts = args.seqs
    what = f"{args.switch} ({args.qtype})" if args.switch == "prefetch_fused" else args.switch
    print(f"CPU: {cpu_model()}; {args.model}, switch {what} values {vals}, {args.context}-token "
          f"prompts, {args.rounds} rounds of {args.block} steps a value", flush=True)

    eng = Engine.load(args.model, weights=None, progress=False, kv_mode=args.kv_cache_mode, max_seqs=max(counts),
                      max_batch_tokens=max(512, args.context))
    from turnkv.kernels.weight_memory import collapse
    collapse()    # what `turnkv serve` does once it answers: the weights to huge pages
    from turnkv.cache.specs import describe_modes
    print(f"weights {eng.weights}, KV {describe_modes(list(eng.modes), eng.specs)}, {hugepages_state()}", flush=True)
    text = (Path(__file__).resolve().parent.parent / "turnkv" / "data" / "coriolanus.txt").read_text()
    ids = eng.tokenizer.encode(text)
    need = len(vals) * args.rounds * args.block + 8
    for n in counts:
        sinks = [[] for _ in range(n)]
        seqs = []
        for i in range(n):
            start = (i * 997) % max(1, len(ids) - args.context)
            prompt = ids[start:start + args.context]
            params = SamplingParams(max_tokens=need, temperature=0.0, ignore_eos=True)
            seqs.append(eng.submit(GenerationRequest(prompt, params, [len(prompt)]), sinks[i].append))
        while not all(len(s) >= 2 for s in sinks):    # every prompt prefilled, one token decoded
            eng.step()
        load0 = os.getloadavg()[0]
        clock = time.thread_time if args.cpu_time else time.perf_counter
        times, ratios = time_values(eng, setter, vals, args.rounds, args.block, clock)
        load1 = os.getloadavg()[0]
        for s in seqs:
            s.cancel()
        while eng.step():
            pass
        ctx = args.context + need
        a = vals[0]
        print(f"{n:3d} sequences (context {args.context}-{ctx}, load {load0:.1f}-{load1:.1f}): step "
              f"{statistics.median(times[a]):.2f} ms at {args.switch}={a}")
        for v, rs in ratios.items():
            print(f"    {statistics.median(times[v]):.2f} ms at {args.switch}={v}; /A {statistics.median(rs):.3f} "
                  f"(rounds {min(rs):.3f}-{max(rs):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
