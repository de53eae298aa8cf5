"""Speculative decoding off against on (``--mode``: ngram, cache or auto; docs/speculative.md), in
process, on the bundled models:
decode speed, acceptance, and a check that every run's token ids are the same both ways; beside
it llama.cpp's llama-server on the same GGUF without and with each of its n-gram draft types.

    flock /tmp/turnkv-bench.lock python bench/speculative.py --model gemma3-270m smollm2-135m \\
        --llama-server PATH/llama-server

Workloads (greedy, ``--max-tokens`` each):
- ``code_edit``: the model is given a source file (turnkv/engine/text.py, 51 lines) and asked to
  rewrite it whole with one small change (a renamed class), so most of the reply copies text
  already in the prompt;
- ``regenerate``: a second turn asks for the previous answer again, that answer (the plain run's
  reply to the first turn) being in the conversation;
- ``prose``: a short story, nothing to copy (the drafter's back-off is what is measured);
- ``retry``: the first turn's question sent again, the same request a second time (a regenerate
  button, a client's retry) on an engine with the prompt cache on, after the first request ran
  (untimed): the ``cache`` drafter drafts the whole earlier reply (ngram: only what the reply
  repeats of itself);
- ``agent``: the steps of one recorded agent session (bench/agent_traces/small.jsonl, the OpenAI
  Agents SDK: forced tool calls whose arguments name files, then a text answer), each body as
  recorded (tools, tool_choice's grammar, max_tokens) under the shipped chatml-tools template,
  one after another on one engine with the prompt cache on, as the server would run them (the
  tokens the call's grammar forces are drafts too: their counts print apart).

Each (model, workload) runs ``--rounds`` rounds, off and on (``--mode``) alternating in order (off, on, on,
off, ...), each run on a fresh engine (the model loaded once), so runs see the same prefill.
Every run uses ``--threads`` compute threads (default 1: the machine is shared; a descheduled
partner thread costs more than the second core gives). Prints the median decode tok/s of each
by wall time and by the engine thread's CPU time (at one thread its compute, without the waits
for a core that a loaded machine adds: the figure to go by at load),
the speedup (median of the rounds' on/off ratios), the acceptance rate, the tokens per
forward pass and the step costs the last on run's engine measured (``StepCosts``, what its draft
lengths went by); exits non-zero if any on run's tokens differ.

``--llama-server``: for each of ``--llama-types`` (``none`` and llama.cpp's n-gram types, each
at its defaults) a fresh server (``-t``/``-tb`` ``--threads``, one slot) gets the same prompt
token ids as turnkv, once per workload (bench/speculative_peer.py); its decode tok/s
(``timings.predicted_per_second``; by CPU time, the server process's CPU time over each request,
its decode's share taken as the server's own decode time's share of prompt + decode) and
acceptance are printed beside turnkv's, and the ratio of turnkv's speculative speed to the best
type's, by each clock. Its replies may differ from turnkv's in length
(numerics, and the agent steps run without turnkv's tool-call grammar), so compare tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE = (ROOT / "turnkv" / "engine" / "text.py").read_text()
TRACE = ROOT / "bench" / "agent_traces" / "small.jsonl"
QUESTION = "Explain in a few sentences how a sourdough starter works and how to keep one alive."
AGENT_MAX_TOKENS = 96        # the recorded bodies without max_tokens (pydantic-ai's) get this


def chats(first_reply: str) -> dict[str, list[dict]]:
    return {
        "code_edit": [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + SOURCE + "```\n\n"
                       "Rewrite the whole file with one change: rename the class StopMatcher to StopStrings "
                       "everywhere. Reply with the complete file only."}],
        "regenerate": [{"role": "user", "content": QUESTION},
                       {"role": "assistant", "content": first_reply},
                       {"role": "user", "content": "Please give me exactly that answer again, word for word."}],
        "prose": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
                   "message in a bottle."}],
        "retry": [{"role": "user", "content": QUESTION}],
    }


def agent_bodies(trace: Path, session: str | None) -> list[dict]:
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    session = session or rows[0]["session"]
    return [r["body"] for r in sorted((r for r in rows if r["session"] == session), key=lambda r: r["step"])]


def decode_cpu(engine, req) -> tuple:
    """``engine.generate(req)`` and the thread CPU time from its first token to its end: at one
    compute thread the engine computes on this thread, so this is its decode's work without the
    waits for a core that a loaded machine adds to the wall time."""
    gen = engine.stream(req)
    t0 = None
    try:
        while True:
            next(gen)
            t0 = time.thread_time() if t0 is None else t0
    except StopIteration as stop:
        return stop.value, time.thread_time() - t0 if t0 is not None else 0.0


class Bench:
    """The model loaded once; each run gets a fresh engine on it (nothing carried between runs)."""

    def __init__(self, model: str, args):
        from turnkv.engine.engine import auto_kv_mode
        from turnkv.loading.model import load_model
        from turnkv.loading.tokenizer import chat_template_source

        self.loaded = load_model(model, weights=None, progress=False)
        self.kv_mode = auto_kv_mode(self.loaded.weights, self.loaded.net.dtype)
        self.tools_tokenizer = self.loaded.tokenizer.with_template(chat_template_source("chatml-tools"),
                                                                   note="chatml-tools")
        self.args = args
        self.agent = agent_bodies(Path(args.trace), args.session)

    def engine(self, mode: str, tools: bool = False, cache: bool = False):
        from turnkv.engine.engine import Engine
        from turnkv.engine.speculative import DEFAULT_DRAFT_MAX
        from turnkv.prompt_cache.store import PromptCache

        lm = self.loaded
        return Engine(lm.net, self.tools_tokenizer if tools else lm.tokenizer, fingerprint=lm.fingerprint,
                      name=lm.name, weights=lm.weights, kv_mode=self.kv_mode, max_context=lm.max_context,
                      prompt_cache=PromptCache(1 << 30 if tools or cache else 0), speculative=mode,
                      draft_max=self.args.draft_max or DEFAULT_DRAFT_MAX)

    def requests(self, engine, name: str, messages: list[dict] | None) -> list:
        from turnkv.engine.sampling import SamplingParams

        if name != "agent":
            return [engine.chat_request(messages, SamplingParams(max_tokens=self.args.max_tokens, temperature=0.0))]
        from turnkv.server.requests import build_chat_request
        from turnkv.server.schemas import ChatCompletionRequest

        out = []
        for body in self.agent:
            params = SamplingParams(max_tokens=body.get("max_tokens") or AGENT_MAX_TOKENS, temperature=0.0)
            out.append(build_chat_request(engine, ChatCompletionRequest(**body), params, ""))
        return out

    def run(self, name: str, messages: list[dict] | None, mode: str) -> dict:
        """One run of a workload: its token ids, decode tok/s over all its requests (wall and
        CPU time), drafts."""
        engine = self.engine(mode, tools=name == "agent", cache=name == "retry")
        if name == "retry":      # the earlier request, which the timed one repeats
            engine.generate(self.requests(engine, name, messages)[0])
        ids, decode_s, cpu_s, decoded, drafted, accepted, prompts, forced = [], 0.0, 0.0, 0, 0, 0, [], [0, 0]
        kinds: dict[str, list[int]] = {}
        for req in self.requests(engine, name, messages):
            prompts.append((list(req.prompt_ids), req.params.max_tokens))
            result, cpu = decode_cpu(engine, req)
            ids.append(result.token_ids)
            decode_s += result.stats.decode_ms / 1000
            cpu_s += cpu
            decoded += max(0, len(result.token_ids) - 1)
            drafted += result.stats.drafted
            accepted += result.stats.accepted
            forced = [forced[0] + result.stats.forced_drafted, forced[1] + result.stats.forced_accepted]
            for kind, got in result.stats.drafts.items():
                kinds[kind] = [a + b for a, b in zip(kinds.get(kind, (0, 0)), (got["drafted"], got["accepted"]))]
        return {"ids": ids, "kinds": kinds, "tok_s": decoded / decode_s if decode_s else 0.0,
                "cpu_tok_s": decoded / max(cpu_s, 1e-9),
                "drafted": drafted,
                "accepted": accepted, "forced": forced, "tokens": sum(len(i) for i in ids), "prompts": prompts,
                "costs": engine.spec.costs.as_dict()}


def bench_workload(bench: Bench, name: str, messages, rounds: int) -> dict:
    spec = bench.args.mode
    speeds = {(mode, clock): [] for mode in ("off", spec) for clock in ("tok_s", "cpu_tok_s")}
    ratios, cpu_ratios, rate, per_pass, ids, same = [], [], [], [], {}, True
    for r in range(rounds):
        got = {}
        for mode in (("off", spec) if r % 2 == 0 else (spec, "off")):
            got[mode] = out = bench.run(name, messages, mode)
            for clock in ("tok_s", "cpu_tok_s"):
                speeds[mode, clock].append(out[clock])
            ids.setdefault(mode, out["ids"])
            same &= out["ids"] == ids[mode] == ids.get("off", out["ids"])
        on = got[spec]
        ratios.append(on["tok_s"] / max(got["off"]["tok_s"], 1e-9))
        cpu_ratios.append(on["cpu_tok_s"] / max(got["off"]["cpu_tok_s"], 1e-9))
        rate.append(on["accepted"] / on["drafted"] if on["drafted"] else 0.0)
        per_pass.append(on["tokens"] / max(1, on["tokens"] - on["accepted"]))
    same &= ids["off"] == ids[spec]
    med = {key: statistics.median(v) for key, v in speeds.items()}
    row = {"tokens": sum(len(i) for i in ids["off"]), "mode": spec, "off": med["off", "tok_s"],
           "on": med[spec, "tok_s"],
           "cpu_off": med["off", "cpu_tok_s"], "cpu_on": med[spec, "cpu_tok_s"],
           "speedup": statistics.median(ratios), "cpu_speedup": statistics.median(cpu_ratios),
           "acceptance": statistics.median(rate), "per_pass": statistics.median(per_pass), "same": same,
           "prompts": got["off"]["prompts"]}
    print(f"  {name:<11} {row['tokens']:>4} tok  off {row['off']:6.1f} tok/s  {spec} {row['on']:6.1f} tok/s  "
          f"speedup {row['speedup']:.2f}x  accepted {row['acceptance']:.0%} of drafts  {row['per_pass']:.2f} tok/pass  "
          f"{'same tokens' if same else 'TOKENS DIFFER'}  (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"  {'':<11} by CPU time: off {row['cpu_off']:6.1f}  {spec} {row['cpu_on']:6.1f} tok/s  speedup "
          f"{row['cpu_speedup']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in cpu_ratios)})", flush=True)
    if on["kinds"]:      # "forced": the tokens a grammar forced
        print(f"  {'':<11} the last on run's drafts by kind, accepted of drafted: "
              + ", ".join(f"{k} {a} of {d}" for k, (d, a) in sorted(on["kinds"].items())), flush=True)
    measured = dict(on["costs"])
    head = "  ".join(f"{m} {c:.2f}" for m, c in measured.pop("head").items())
    costs = "  ".join(f"{m} rows {c:.2f}" for m, c in measured.items())
    print(f"  {'':<11} step costs at the end of the last on run (one row = 1): {costs}; head calls: {head}",
          flush=True)
    return row


def bench_model(model: str, args) -> bool:
    from turnkv.engine.sampling import SamplingParams

    bench = Bench(model, args)
    plain = bench.engine("off")
    first = plain.generate(plain.chat_request([{"role": "user", "content": QUESTION}],
                                              SamplingParams(max_tokens=args.max_tokens, temperature=0.0)))
    print(f"\n{model} ({bench.loaded.weights} weights, KV {plain.modes[0]}, {args.threads} thread(s))", flush=True)
    work = {**chats(first.text), "agent": None}
    rows = {name: bench_workload(bench, name, work[name], args.rounds)
            for name in args.workloads}
    if args.llama_server:
        from bench.speculative_peer import compare
        from turnkv.loading import gguf_path
        compare(args, str(gguf_path(model)), rows)
    return all(r["same"] for r in rows.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    p.add_argument("--workloads", nargs="+", default=["code_edit", "regenerate", "prose", "agent", "retry"])
    p.add_argument("--mode", default="auto", choices=["ngram", "cache", "auto"],
                   help="the speculative mode run against off (default auto, serve's default)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft-max", type=int, default=None, help="default: the engine's")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trace", default=str(TRACE), help="agent trace (bench/agent_replay.py record)")
    p.add_argument("--session", default=None, help="the trace's session to run (default: its first)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--llama-types", nargs="+",
                   default=["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"])
    args = p.parse_args()
    from bench.machine import cpu_model
    from turnkv.launch import configure_process
    configure_process(args.threads)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start")
    ok = all([bench_model(m, args) for m in args.model])
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
