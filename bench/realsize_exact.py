"""``bench/realsize.py exact``: the exactness contract on real-size GGUFs, in the default path.

The tests hold reuse == cold, chunk 64 == chunk 512 and batched == alone on tiny models; this
checks the same three on a real-size file (issue: real-size models, "exactness stays"), where the
kernels take their large-shape paths (more tiles per thread, the fused decode rows, every K-quant
type a Q4_K_M mixes). Per file, in a child process each:

- engine A (prefill chunk 512): turn 1 (prompt P1, 24 greedy tokens), turn 2 (P2 = P1 + reply +
  ~300 new tokens) which must restore turn 1's state (prefilled < prompt), then P2 cold under
  another tenant (nothing to restore): token ids and first-token logits must be the same bits;
- engine B (prefill chunk 64): P2 alone, then P2 batched with two other prompts (submitted
  together, stepped as one batch): each must equal engine A's cold P2 bit for bit.
Prompt lengths pass Gemma 3's 512-token window, and LFM2's conv state restores at the turn's end
(a message boundary). Prints one line per check and exits non-zero when any differs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench.machine import cpu_model
from bench.realsize_run import ROOT

_CHILD = r'''
import json, sys, torch
torch.set_num_threads({threads})
from turnkv.engine.engine import Engine
from turnkv.engine.sequence import GenerationRequest, Result
from turnkv.engine.sampling import SamplingParams
from turnkv.prompt_cache.store import PromptCache

PATH, CHUNK = {path!r}, {chunk}
# the K/V mode and a prompt cache as `turnkv serve` makes them (its default budget)
eng = Engine.load(PATH, weights=None, progress=False, max_context=4096, prefill_chunk=CHUNK,
                  kv_mode="auto", prompt_cache=PromptCache(2048 << 20))
vocab = eng.requests.model.vocab_size

def ids(n, seed):
    return torch.randint(vocab // 50, vocab * 4 // 5, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

def req(prompt, tenant, bounds=()):
    return GenerationRequest(prompt, SamplingParams(max_tokens=24, ignore_eos=True), boundaries=list(bounds), tenant=tenant)

def record(r, name):
    torch.save(r.first_logits, f"{out}/{{name}}.pt")
    return dict(ids=r.token_ids, prefilled=r.stats.prefilled_tokens, cached=r.usage.cached_tokens)

out = {out!r}
p1 = ids(700, 1)
rows = {{}}
if CHUNK == 512:
    r1 = eng.generate(req(p1, "a", [len(p1)]))
    p2 = p1 + r1.token_ids + ids(300, 2)
    json.dump(p2, open(f"{{out}}/p2.json", "w"))
    rows["turn2_reused"] = record(eng.generate(req(p2, "a", [len(p1), len(p1) + len(r1.token_ids)])), "turn2_reused")
    rows["p2_cold"] = record(eng.generate(req(p2, "b")), "p2_cold")
else:
    p2 = json.load(open(f"{{out}}/p2.json"))
    rows["p2_chunk64"] = record(eng.generate(req(p2, "c")), "p2_chunk64")
    got = {{}}
    sinks = []
    for i, (p, t) in enumerate(((p2, "d"), (ids(900, 3), "e"), (p1, "f"))):
        sink = []
        eng.submit(req(p, t), sink.append)
        sinks.append(sink)
    while not all(any(isinstance(x, Result) for x in s) for s in sinks):
        eng.step()
    rows["p2_batched"] = record(next(x for x in sinks[0] if isinstance(x, Result)), "p2_batched")
print(json.dumps(rows))
'''


def _child(path: Path, chunk: int, out: Path, threads: int) -> dict:
    import subprocess
    code = _CHILD.format(path=str(path), chunk=chunk, out=str(out), threads=threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{path.name} (chunk {chunk}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_exact(path: Path, threads: int) -> bool:
    import tempfile

    import torch
    print(f"{path.name}: CPU {cpu_model()}, {threads} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = _child(path, 512, out, threads)
        rows.update(_child(path, 64, out, threads))
        logits = {k: torch.load(out / f"{k}.pt") for k in rows}
    ref = rows["p2_cold"]
    ok = True
    reused = ref["prefilled"] - rows["turn2_reused"]["prefilled"]
    print(f"  turn 2 restored {rows['turn2_reused']['cached']} tokens, prefilled {rows['turn2_reused']['prefilled']} "
          f"of {ref['prefilled']} (cold)", flush=True)
    if reused <= 0:
        print("  FAIL: turn 2 restored nothing")
        ok = False
    for name, what in (("turn2_reused", "reuse == cold"), ("p2_chunk64", "chunk 64 == chunk 512"),
                       ("p2_batched", "batched == alone")):
        same_ids = rows[name]["ids"] == ref["ids"]
        same_logits = torch.equal(logits[name], logits["p2_cold"])
        diff = (logits[name] - logits["p2_cold"]).abs().max().item()
        print(f"  {what}: ids {'equal' if same_ids else 'DIFFER'} ({len(ref['ids'])} tokens), first-token logits "
              f"{'bit-equal' if same_logits else f'DIFFER (max |d| {diff:.3g})'}", flush=True)
        ok &= same_ids and same_logits
    return ok
