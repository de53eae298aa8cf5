"""Speculative decoding off against on (docs/speculative.md), in process, on the bundled models:
decode speed, acceptance, and a check that every run's token ids are the same both ways.

    flock /tmp/turnkv-bench.lock python bench/speculative.py --model gemma3-270m smollm2-135m

Workloads (greedy, ``--max-tokens`` each):
- ``code_edit``: the model is given a source file (turnkv/engine/text.py, 51 lines) and asked to
  rewrite it whole with one small change (a renamed function), so most of the reply copies text
  already in the prompt;
- ``regenerate``: a second turn asks for the previous answer again, that answer (the plain run's
  reply to the first turn) being in the conversation;
- ``prose``: a short story, nothing to copy (the drafter's back-off is what is measured).

Each (model, workload) runs ``--rounds`` rounds, off and on alternating in order (off, on, on,
off, ...), each run on a fresh engine with the prompt cache off, so runs see the same prefill.
Prints the median decode tok/s of each, the speedup (median of the rounds' on/off ratios), the
acceptance rate and the tokens per forward pass; exits non-zero if any on run's tokens differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE = (ROOT / "turnkv" / "engine" / "text.py").read_text()


def workloads(engine, first_reply: str | None) -> dict[str, list[dict]]:
    question = "Explain in a few sentences how a sourdough starter works and how to keep one alive."
    out = {
        "code_edit": [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + SOURCE + "```\n\n"
                       "Rewrite the whole file with one change: rename the class StopMatcher to StopStrings "
                       "everywhere. Reply with the complete file only."}],
        "prose": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
                   "message in a bottle."}],
    }
    if first_reply is not None:
        out["regenerate"] = [{"role": "user", "content": question},
                             {"role": "assistant", "content": first_reply},
                             {"role": "user", "content": "Please give me exactly that answer again, word for word."}]
    return out


def run(model: str, messages: list[dict], mode: str, max_tokens: int, draft_max: int):
    from turnkv.engine.engine import Engine
    from turnkv.engine.sampling import SamplingParams

    engine = Engine.load(model, weights=None, kv_mode="auto", progress=False, speculative=mode, draft_max=draft_max)
    req = engine.chat_request(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    result = engine.generate(req)
    return result, engine.steps


def bench_model(model: str, args) -> bool:
    from turnkv.engine.engine import Engine
    from turnkv.engine.sampling import SamplingParams

    engine = Engine.load(model, weights=None, kv_mode="auto", progress=False)
    q = [{"role": "user", "content": "Explain in a few sentences how a sourdough starter works and how to keep one alive."}]
    first = engine.generate(engine.chat_request(q, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)))
    print(f"\n{model} ({engine.weights} weights, KV {engine.modes[0]})")
    ok = True
    for name, messages in workloads(engine, first.text).items():
        speeds = {"off": [], "ngram": []}
        ratios, rate, per_step, ids = [], [], [], {}
        for r in range(args.rounds):
            order = ("off", "ngram") if r % 2 == 0 else ("ngram", "off")
            got = {}
            for mode in order:
                result, steps = run(model, messages, mode, args.max_tokens, args.draft_max)
                got[mode] = result
                speeds[mode].append(result.stats.decode_tokens_per_s)
                ids.setdefault(mode, result.token_ids)
                if result.token_ids != ids[mode] or result.token_ids != ids.get("off", result.token_ids):
                    ok = False
            on = got["ngram"].stats
            ratios.append(on.decode_tokens_per_s / max(got["off"].stats.decode_tokens_per_s, 1e-9))
            rate.append(on.accepted / on.drafted if on.drafted else 0.0)
            per_step.append(len(got["ngram"].token_ids) / max(1, len(got["ngram"].token_ids) - on.accepted))
        same = ids["off"] == ids["ngram"]
        ok &= same
        print(f"  {name:<11} {len(ids['off']):>4} tok  off {statistics.median(speeds['off']):6.1f} tok/s  "
              f"ngram {statistics.median(speeds['ngram']):6.1f} tok/s  speedup {statistics.median(ratios):.2f}x  "
              f"accepted {statistics.median(rate):.0%} of drafts  {statistics.median(per_step):.2f} tok/pass  "
              f"{'same tokens' if same else 'TOKENS DIFFER'}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from bench.machine import cpu_model
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start")
    ok = all([bench_model(m, args) for m in args.model])
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
