"""Where one agent step's time to first token goes, inside one process (no server).

An agent step restores the previous prompt from the prompt cache and prefills the new tool
result (~700 tokens) at a long context. This takes a recorded request of the agent trace
(bench/agent_replay.py), renders it as the server does (template, tokenizer, the forced call's
grammar), stores the state of the tokens the previous step had already sent (one cold prefill),
then runs the step ``--reps`` times from that same cache content and reports each phase:
request building, lookup + restore, every prefill chunk's forward, the checkpoint snapshots
taken before the first token, the first token's sampling (grammar mask) and what the engine
does after it (prompt-end snapshot).

    flock /tmp/turnkv-bench.lock nice -n 10 python bench/step_ttft.py --threads 2 --step 17

``--ops`` splits the prefill forwards by op instead: the layers run one at a time as the fused
path's three native calls (q/k/v: norm, matmul, QK-norm, RoPE; attention with the K/V write; the
rest: wo, norms, gate/up, GELU, down), the same bits as the whole-stack call, each timed and
summed per kind of layer (global / sliding), with the embedding and the final norm + lm_head and
what is left (Python between the calls, the batch, RoPE tables). The layer-at-a-time path costs
the Python between layers that the whole-stack call saves: compare its total with a plain run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

TRACE = Path(os.environ.get("TURNKV_TRACE_DIR", Path.home() / ".cache" / "turnkv-agent-traces")) / "agents-4x21.jsonl"


class Timers:
    """Time per named phase of the current run (``clock`` around the wrapped calls: wall time,
    or with time.process_time the CPU time of all the process's threads, which a busy machine
    disturbs less at one thread)."""

    def __init__(self, clock=time.perf_counter):
        self.rows: list[tuple[str, float]] = []
        self.clock = clock

    def wrap(self, obj, name: str, label) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                self.rows.append((label(*a, **kw) if callable(label) else label, (self.clock() - t0) * 1000))
        setattr(obj, name, timed)


def build_engine(threads: int, chunk: int, batch_tokens: int):
    import torch

    from turnkv.engine.engine import Engine, AUTO_KV
    from turnkv.launch import configure_process
    from turnkv.loading.tokenizer import chat_template_source
    from turnkv.prompt_cache.store import PromptCache

    configure_process(threads)
    engine = Engine.load("gemma3-270m", dtype=torch.float32, weights=None, progress=False, kv_mode=AUTO_KV,
                         prompt_cache=PromptCache(2 << 30), prefill_chunk=chunk, max_batch_tokens=batch_tokens,
                         max_context=32768)
    engine.tokenizer = engine.tokenizer.with_template(chat_template_source("chatml-tools"))
    return engine


def time_ops(engine, timers: Timers) -> None:
    """Time each native call of the layer-at-a-time fused path (see ``--ops``)."""
    from turnkv.models import fused
    from turnkv.models.fused import FusedBlock

    FusedBlock.one_call = False      # every layer as qkv, attention_spans, out_mlp (the same bits)
    model = engine.model
    kinds = ["sliding" if layer.sliding else "global" for layer in model.layers]
    timers.wrap(fused, "attention_spans", lambda batch, i, *a, **kw: f"{kinds[i]}: attention")
    timers.wrap(FusedBlock, "qkv", lambda self, x, rope: f"{self.kind}: qkv")
    timers.wrap(FusedBlock, "out_mlp", lambda self, x, a: f"{self.kind}: out + mlp")
    timers.wrap(model, "final_logits", "final norm + lm_head")
    for layer, kind in zip(model.layers, kinds):
        layer.fused.kind = kind


def op_table(runs: list[dict]) -> str:
    """Per op, the median over runs of its summed ms in the first token's forwards."""
    totals = []
    for r in runs:
        t: dict[str, float] = {}
        for name, ms in r["rows"]:
            key = "prefill forwards (all)" if name.startswith("forward ") else name
            t[key] = t.get(key, 0.0) + ms
        named = sum(ms for k, ms in t.items() if ":" in k or k.startswith("final"))
        t["rest of the forwards (Python, batch, RoPE rows, embedding)"] = t.get("prefill forwards (all)", 0.0) - named
        totals.append(t)
    keys = sorted({k for t in totals for k in t if ":" in k or k.startswith(("final", "prefill", "rest"))})
    whole = statistics.median(t.get("prefill forwards (all)", 0.0) for t in totals)
    lines = ["| op | ms (median) | share of the forwards |", "|---|---|---|"]
    for k in keys:
        ms = statistics.median(t.get(k, 0.0) for t in totals)
        lines.append(f"| {k} | {ms:.0f} | {100 * ms / whole:.1f}% |")
    return "\n".join(lines)


def chat_request(engine, body: dict):
    from turnkv.engine.sampling import SamplingParams
    from turnkv.server.requests import build_chat_request, sampling_params
    from turnkv.server.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(body)
    params = sampling_params(req, SamplingParams(max_tokens=48), engine.max_context)
    return build_chat_request(engine, req, params, tenant="")


def first_token(engine, gen, timers: Timers, ctl: str = "") -> dict:
    """Runs ``gen`` to its first token, then to its end; the phases of the first part."""
    if ctl:
        Path(ctl).write_text("enable\n")
    t0 = time.perf_counter()
    stream = engine.stream(gen)
    next(stream)
    ttft = (time.perf_counter() - t0) * 1000
    if ctl:
        Path(ctl).write_text("disable\n")
    first_rows = list(timers.rows)
    while True:
        try:
            next(stream)
        except StopIteration as stop:
            result = stop.value
            break
    return {"ttft": ttft, "rows": first_rows, "after": timers.rows[len(first_rows):], "stats": result.stats,
            "text": result.text}


def store_previous(engine, rows: list[dict], step: int, threads: int) -> list[tuple]:
    """What the previous step had sent (its prompt, and the start of this step's that follows
    it: its reply as this request renders it), stored by one cold prefill; the cache's entries."""
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.sequence import GenerationRequest

    t0 = time.perf_counter()
    gen = chat_request(engine, rows[step - 1]["body"])
    build_ms = (time.perf_counter() - t0) * 1000
    prev = chat_request(engine, rows[step - 2]["body"])
    same = next((i for i, (a, b) in enumerate(zip(gen.prompt_ids, prev.prompt_ids)) if a != b), len(prev.prompt_ids))
    base = gen.prompt_ids[:max(same, len(prev.prompt_ids))]
    t0 = time.perf_counter()
    engine.generate(GenerationRequest(prompt_ids=base, params=SamplingParams(max_tokens=1)))
    print(f"prompt {len(gen.prompt_ids)} tokens, stored {len(base)} (cold prefill {time.perf_counter() - t0:.1f} s), "
          f"request built in {build_ms:.1f} ms (the first grammar compile included), threads {threads}, "
          f"load {os.getloadavg()[0]:.2f}")
    return [(e.ns, e.tokens, e.snap, e.origin) for e in list(engine.prompt_cache._lru.values())]


def run_variants(engine, body: dict, stored: list[tuple], timers: Timers, variants: dict, args) -> dict:
    """Each rep runs every variant in turn (fused stack on/off, prefill batch tokens), the same
    cache content restored before each: A/B in the same minutes."""
    from turnkv.models.fused import FusedBlock

    cache = engine.prompt_cache
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    out: dict[str, list] = {name: [] for name in variants}
    ctl = os.environ.get("PERF_CTL_FIFO")     # perf record --control fifo:CTL -D -1: the timed runs only
    for _ in range(args.reps):
        for name, (one_call, batch_tokens) in variants.items():
            FusedBlock.one_call = one_call
            engine.scheduler.max_batch_tokens = batch_tokens
            cache.clear()
            for ns, tokens, snap, origin in stored:
                cache.insert(ns, list(tokens), snap, origin)
            timers.rows.clear()
            t0 = time.perf_counter()
            gen = chat_request(engine, body)
            build_ms = (time.perf_counter() - t0) * 1000
            if prof:
                prof.enable()
            out[name].append({**first_token(engine, gen, timers, ctl), "build": build_ms})
            if prof:
                prof.disable()
    if prof:
        prof.dump_stats(args.profile)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--session", type=int, default=0, help="index of the session in the trace")
    p.add_argument("--step", type=int, default=17, help="the step (1-based) to time (17: ~740 new tokens at 10k)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--profile", default="", help="write a cProfile of the timed runs here")
    p.add_argument("--ops", action="store_true", help="also time each op of the prefill forwards (layer at a time)")
    p.add_argument("--cpu-time", action="store_true",
                   help="phases in CPU time of the process (time.process_time) instead of wall time")
    p.add_argument("--alt-batch-tokens", type=int, default=0,
                   help="also run each rep with this --max-batch-tokens (an A/B in the same minutes)")
    args = p.parse_args()

    from bench.replay_run import load_trace
    from turnkv.cache.slots import SeqState

    rows = list(load_trace(Path(args.trace)).values())[args.session]
    engine = build_engine(args.threads, args.prefill_chunk, args.max_batch_tokens)
    stored = store_previous(engine, rows, args.step, args.threads)
    timers = Timers(time.process_time if args.cpu_time else time.perf_counter)
    timers.wrap(engine.model, "forward", lambda batch: f"forward {int(batch.tokens.shape[0])} rows")
    timers.wrap(engine.reuse, "_restore", "lookup + restore")
    timers.wrap(SeqState, "snapshot", lambda self, *a: "snapshot")
    variants = {"plain": (True, args.max_batch_tokens)}
    if args.ops:
        time_ops(engine, timers)
        variants["ops"] = (False, args.max_batch_tokens)
    if args.alt_batch_tokens:
        variants[f"max-batch-tokens {args.alt_batch_tokens}"] = (True, args.alt_batch_tokens)
    by_variant = run_variants(engine, rows[args.step - 1]["body"], stored, timers, variants, args)
    for name, runs in by_variant.items():
        print(f"== {name}")
        for r in runs:
            parts = ", ".join(f"{n} {ms:.0f}" for n, ms in r["rows"] if ":" not in n and not n.startswith("final"))
            after = ", ".join(f"{n} {ms:.0f}" for n, ms in r["after"] if n.startswith(("snapshot", "lookup")))
            st = r["stats"]
            print(f"TTFT {r['ttft']:.0f} ms: {parts}, first token's sampling {st.sample_ms:.1f} | after: {after} | "
                  f"request building before it (template, tokenizer, grammar) {r['build']:.0f}")
        print(f"median TTFT {statistics.median(r['ttft'] for r in runs):.0f} ms over {len(runs)}")
        if name == "ops":
            print(op_table(runs))
    texts = {r["text"] for runs in by_variant.values() for r in runs}
    print(f"replies identical across variants and reps: {len(texts) == 1}; load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
