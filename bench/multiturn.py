"""Multi-turn chat benchmark: the fixed 8-turn conversation (bench/conversation.py), one table row
per turn: prompt tokens, cached tokens, TTFT and decode speed.

    python bench/multiturn.py --url http://127.0.0.1:8000/v1            # turnkv serve
    python bench/multiturn.py --url http://127.0.0.1:8080/v1            # llama.cpp's llama-server
    python bench/multiturn.py --url http://127.0.0.1:8001/v1 --model m  # llama-cpp-python's server
    python bench/multiturn.py --engine smollm2-135m [--plot ttft.png]    # in-process, cache on vs off

``--url`` mode speaks the OpenAI API (streaming, ``stream_options.include_usage``) to any
compatible server, so the same numbers can be put side by side. TTFT is measured here, from the
request to the first streamed text; decode tok/s is (completion tokens - 1) over the time from the
first to the last streamed text. Cached tokens come from ``usage.prompt_tokens_details`` (or
llama-server's ``timings.cache_n``); '-' means the server does not say.

A mode is a function from a turn's messages to a ``TurnResult``; modes share the conversation
loop (``run_conversation``) and the table (``format_table``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench.conversation import MAX_TOKENS, SYSTEM_PROMPT, TEMPERATURE, USER_TURNS, messages_for_turn  # noqa: E402


@dataclass
class TurnResult:
    reply: str
    prompt_tokens: int | None          # None: the server did not report it
    cached_tokens: int | None
    completion_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float | None  # None with fewer than two streamed pieces
    total_ms: float


ChatFn = Callable[[list[dict]], TurnResult]


def run_conversation(chat: ChatFn, turns: int = len(USER_TURNS),
                     on_turn: Callable[[int, TurnResult], None] | None = None) -> list[TurnResult]:
    """Replay the conversation through ``chat``, appending each reply to the history."""
    replies: list[str] = []
    results: list[TurnResult] = []
    for turn in range(turns):
        result = chat(messages_for_turn(turn, replies))
        replies.append(result.reply)
        results.append(result)
        if on_turn is not None:
            on_turn(turn, result)
    return results


# ------------------------------------------------------------------------------------ the table

COLUMNS = (("turn", 4), ("prompt", 7), ("cached", 7), ("cached%", 7), ("gen", 4), ("TTFT ms", 8),
           ("decode tok/s", 12), ("total ms", 9))


def _cell(value, width: int) -> str:
    return f"{'-' if value is None else value:>{width}}"


def table_header() -> str:
    return "  ".join(f"{name:>{width}}" for name, width in COLUMNS)


def table_row(turn: int, r: TurnResult) -> str:
    share = (f"{100 * r.cached_tokens / r.prompt_tokens:.0f}%"
             if r.cached_tokens is not None and r.prompt_tokens else None)
    values = (turn + 1, r.prompt_tokens, r.cached_tokens, share, r.completion_tokens, f"{r.ttft_ms:.0f}",
              None if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}", f"{r.total_ms:.0f}")
    return "  ".join(_cell(v, width) for v, (_, width) in zip(values, COLUMNS))


def table_summary(results: list[TurnResult]) -> str:
    later = results[1:] or results
    ttft = sum(r.ttft_ms for r in later) / len(later)
    known = [r for r in results if r.prompt_tokens is not None and r.cached_tokens is not None]
    reuse = (f"{sum(r.cached_tokens for r in known)}/{sum(r.prompt_tokens for r in known)} prompt tokens cached"
             if known else "cached tokens not reported")
    return f"mean TTFT turns 2-{len(results)}: {ttft:.0f} ms; {reuse}; wall {sum(r.total_ms for r in results) / 1000:.1f} s"


def format_table(results: list[TurnResult]) -> str:
    return "\n".join([table_header(), *(table_row(i, r) for i, r in enumerate(results)), table_summary(results)])


# ---------------------------------------------------------------------------- --url: any server


def _cached_from(usage, extra: dict | None) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    if details is not None and getattr(details, "cached_tokens", None) is not None:
        return int(details.cached_tokens)
    timings = (extra or {}).get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]          # llama.cpp's llama-server
    return None


def openai_chat(url: str, model: str | None, api_key: str | None, max_tokens: int = MAX_TOKENS,
                temperature: float = TEMPERATURE) -> ChatFn:
    """A ChatFn that streams from an OpenAI-compatible server."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=600)
    if model is None:
        model = client.models.list().data[0].id

    def chat(messages: list[dict]) -> TurnResult:
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True})
        pieces: list[str] = []
        first = last = None
        usage, cached = None, None
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                last = time.perf_counter()
                first = first or last
                pieces.append(text)
            if chunk.usage is not None:
                usage = chunk.usage
                cached = _cached_from(usage, chunk.model_extra)
            elif cached is None:
                cached = _cached_from(None, chunk.model_extra)
        end = time.perf_counter()
        n = usage.completion_tokens if usage is not None else len(pieces)
        span = (last - first) if first is not None and last is not None else 0.0
        return TurnResult(
            reply="".join(pieces),
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            cached_tokens=cached,
            completion_tokens=n,
            ttft_ms=((first or end) - t0) * 1000,
            decode_tokens_per_s=(n - 1) / span if n > 1 and span > 0 else None,
            total_ms=(end - t0) * 1000,
        )

    return chat


# ------------------------------------------------------------------ --engine: in-process turnkv


def engine_chat(engine, max_tokens: int = MAX_TOKENS) -> ChatFn:
    """A ChatFn running turnkv's engine in this process (no HTTP), timed by the engine itself."""
    from turnkv.engine.sampling import SamplingParams

    def chat(messages: list[dict]) -> TurnResult:
        res = engine.generate(engine.chat_request(messages, SamplingParams(max_tokens=max_tokens,
                                                                           temperature=TEMPERATURE)))
        return TurnResult(reply=res.text, prompt_tokens=res.usage.prompt_tokens,
                          cached_tokens=res.usage.cached_tokens, completion_tokens=res.usage.completion_tokens,
                          ttft_ms=res.stats.ttft_ms, decode_tokens_per_s=res.stats.decode_tokens_per_s or None,
                          total_ms=res.stats.total_ms)

    return chat


def full_kv_bytes(engine, tokens: int) -> int:
    """KV bytes a cold prefill of ``tokens`` holds if every attention layer kept every token
    (recurrent layers: their fixed state) - the yardstick for stored bytes."""
    from turnkv.cache.kv import KVCache
    from turnkv.cache.recurrent import StateCache
    from turnkv.cache.specs import make_caches
    total = 0
    for cache in make_caches(engine.specs, engine.dtype, engine.device, list(engine.modes), engine.slack):
        if isinstance(cache, KVCache):
            total += cache.store.bytes_per_token() * tokens
        elif isinstance(cache, StateCache):
            total += cache.nbytes
    return total


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(args) -> int:
    import torch

    from turnkv.engine.engine import Engine
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class
    from turnkv.prompt_cache.store import PromptCache

    ckpt = load_checkpoint(args.engine, progress=True)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    common = dict(fingerprint=ckpt.fingerprint, name=ckpt.name, max_context=8192,
                  kv_mode=args.kv_cache_mode)
    runs = {}
    for label, budget in (("cache on", 1 << 32), ("cache off", 0)):
        engine = Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(budget), **common)
        print(f"\n{args.engine}, {label}")
        print(table_header(), flush=True)
        results = run_conversation(engine_chat(engine, args.max_tokens), args.turns,
                                   on_turn=lambda i, r: print(table_row(i, r), flush=True))
        print(table_summary(results))
        runs[label] = (engine, results)
    on_engine, on = runs["cache on"]
    off = runs["cache off"][1]
    same = all(a.reply == b.reply for a, b in zip(on, off))
    last = on[-1]
    final_tokens = last.prompt_tokens + last.completion_tokens - 1
    stored = on_engine.prompt_cache.stats()["bytes"]
    kv = full_kv_bytes(on_engine, final_tokens)
    print(f"\nreplies identical with cache on and off: {same}")
    later = on[1:]
    print(f"turns 2-{len(on)}: min cached share {min(r.cached_tokens / r.prompt_tokens for r in later):.1%} "
          f"(goal >= 90%)")
    print(f"turn {len(on)} TTFT: {last.ttft_ms:.0f} ms with cache, {off[-1].ttft_ms:.0f} ms without = "
          f"{last.ttft_ms / off[-1].ttft_ms:.1%} (goal <= 15%)")
    print(f"stored bytes {stored / 2**20:.1f} MiB vs KV bytes of the final {final_tokens}-token sequence "
          f"{kv / 2**20:.1f} MiB = {stored / kv:.2f}x (goal <= 1.25x); peak RSS {peak_rss_mib():.0f} MiB")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        turns = list(range(1, len(on) + 1))
        plt.figure(figsize=(6, 3.5))
        plt.plot(turns, [r.ttft_ms for r in off], "o-", label="prompt cache off")
        plt.plot(turns, [r.ttft_ms for r in on], "o-", label="prompt cache on")
        plt.xlabel("turn")
        plt.ylabel("time to first token (ms)")
        plt.title(f"turnkv, {args.engine}: TTFT per turn")
        plt.legend()
        plt.grid(alpha=0.3)
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    return 0 if same else 1


# ----------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"reply length per turn (default {MAX_TOKENS})")
    p.add_argument("--turns", type=int, default=len(USER_TURNS), choices=range(1, len(USER_TURNS) + 1),
                   metavar=f"1..{len(USER_TURNS)}", help=f"turns to run (default {len(USER_TURNS)})")
    p.add_argument("--show-replies", action="store_true", help="print each reply after the table")
    p.add_argument("--engine", metavar="MODEL", default=None,
                   help="run turnkv in-process on MODEL (bundled name, .gguf or HF folder), cache on and off")
    p.add_argument("--kv-cache-mode", default="native", help="--engine: KV storage mode")
    p.add_argument("--plot", default=None, metavar="PNG", help="--engine: write a TTFT-per-turn plot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine:
        return run_engine(args)
    if not args.url:
        print("multiturn: give --url URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)",
              file=sys.stderr)
        return 2
    chat = openai_chat(args.url, args.model, args.api_key, args.max_tokens)
    print(f"{len(USER_TURNS[:args.turns])} turns against {args.url}; system prompt {len(SYSTEM_PROMPT)} chars, "
          f"max_tokens {args.max_tokens}, temperature {TEMPERATURE}")
    print(table_header(), flush=True)
    results = run_conversation(chat, args.turns, on_turn=lambda i, r: print(table_row(i, r), flush=True))
    print(table_summary(results))
    if args.show_replies:
        for i, r in enumerate(results):
            print(f"\n--- turn {i + 1}\n{r.reply}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
