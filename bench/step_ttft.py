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
    """Wall time per named phase of the current run (perf_counter around the wrapped calls)."""

    def __init__(self):
        self.rows: list[tuple[str, float]] = []

    def wrap(self, obj, name: str, label) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.rows.append((label(*a, **kw) if callable(label) else label, (time.perf_counter() - t0) * 1000))
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
    return {"ttft": ttft, "rows": first_rows, "after": timers.rows[len(first_rows):], "stats": result.stats}


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
    args = p.parse_args()

    from bench.replay_run import load_trace
    from turnkv.cache.slots import SeqState

    rows = list(load_trace(Path(args.trace)).values())[args.session]
    engine = build_engine(args.threads, args.prefill_chunk, args.max_batch_tokens)
    stored = store_previous(engine, rows, args.step, args.threads)
    cache = engine.prompt_cache
    timers = Timers()
    timers.wrap(engine.model, "forward", lambda batch: f"forward {int(batch.tokens.shape[0])} rows")
    timers.wrap(engine.reuse, "_restore", "lookup + restore")
    timers.wrap(SeqState, "snapshot", lambda self, *a: "snapshot")
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    runs = []
    ctl = os.environ.get("PERF_CTL_FIFO")     # perf record --control fifo:CTL -D -1: the timed runs only
    for _ in range(args.reps):
        cache.clear()
        for ns, tokens, snap, origin in stored:
            cache.insert(ns, list(tokens), snap, origin)
        timers.rows.clear()
        gen = chat_request(engine, rows[args.step - 1]["body"])
        if prof:
            prof.enable()
        runs.append(first_token(engine, gen, timers, ctl))
        if prof:
            prof.disable()
    for r in runs:
        parts = ", ".join(f"{name} {ms:.0f}" for name, ms in r["rows"])
        after = ", ".join(f"{name} {ms:.0f}" for name, ms in r["after"] if name != "forward 1 rows")
        st = r["stats"]
        print(f"TTFT {r['ttft']:.0f} ms: {parts}, first token's sampling {st.sample_ms:.1f} | after: {after}")
    print(f"median TTFT {statistics.median(r['ttft'] for r in runs):.0f} ms over {len(runs)}")
    if prof:
        prof.dump_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
