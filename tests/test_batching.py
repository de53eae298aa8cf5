"""Batched forward == each sequence alone, for every family (models/batch.py).

Several sequences of different lengths run through one ``model.forward(Batch)`` per step (prefill
chunks, single decode tokens and ``none`` / ``last`` / ``all`` logits mixed in the same call), and
every logit row they asked for is compared with the same sequence run alone through ``model.step``
with the same chunking: greedy argmax equal and logits within ATOL (float32). The sequences cross
the 16-token windows of Gemma 3, RecurrentGemma, EXAONE 4, Ministral 3 / Ministral and gpt-oss,
Llama 4's 16-token attention chunk and the SSM scan chunks. A sequence that read another's rows or another span's caches would get another history, so
its logits would move by far more than ATOL; test_the_check_catches_* show that the comparison
does fail for both kinds of bug.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssm_family_checks import fresh, perturb_vectors, save_and_load
from test_family_reuse import BUILDERS
from tiny import VOCAB, tiny_gemma3, tiny_llama
from turnkv.models import decoder as decoder_module
from turnkv.models.batch import Batch

# float32. Measured (1 thread, these schedules): no family is bit-identical here, as PyTorch's
# kernels are not row-count invariant: a lone decode row takes the M=1 GEMV path, MoE experts see
# another number of rows, vectorized transcendental ops round a tail element differently. Max
# |batched - alone| seen: 1.8e-7 (llama) to 1.5e-5 (recurrent_gemma). With multi-row chunks only,
# llama, gemma3, lfm2 and recurrent_gemma come out bit-identical.
ATOL = 1e-4
FAMILIES = ["llama", "gemma3", "llama4_text", "mamba2", "lfm2", "qwen3_next", "granitemoehybrid",
            "recurrent_gemma", "exaone4", "ministral3", "ministral",
            "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "glm4_moe", "afmoe", "gemma4_text", "kimi_linear",
            "bailing_hybrid", "muse_glimmer", "qwen3", "qwen2", "rwkv7", "qwen3_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            if name == "llama":
                built[name] = tiny_llama(seed=3)[0]
            elif name == "gemma3":
                built[name] = tiny_gemma3(seed=3)[0]
            else:
                torch.manual_seed(0)
                hf = BUILDERS[name]().eval()
                perturb_vectors(hf)
                built[name] = save_and_load(hf, tmp_path_factory.mktemp(name))
        return built[name]
    return get


# ------------------------------------------------------------------------------------ running


# a step: (sequence id, first token, end token, logits mode) per span, in span order
Step = list[tuple[int, int, int, str]]


def run_batched(model, seqs: list[list[int]], steps: list[Step], caches=None) -> dict:
    """Every step as one forward over a Batch; returns {(sequence, start): logits [k, V]}."""
    caches = caches or [fresh(model) for _ in seqs]
    got = {}
    with torch.no_grad():
        for step in steps:
            batch = Batch.build([(seqs[i][a:b], caches[i], mode) for i, a, b, mode in step])
            assert [s.position for s in batch.spans] == [a for _, a, _, _ in step]
            out = model.forward(batch)
            counts = batch.logit_counts()
            if sum(counts) == 0:
                assert out is None
                continue
            assert out.shape == (sum(counts), model.vocab_size)
            for (i, a, _, mode), rows in zip(step, out.split(counts)):
                if mode != "none":
                    got[(i, a)] = rows
    return got


def run_alone(model, seqs: list[list[int]], steps: list[Step]) -> dict:
    """The same chunks, each sequence on its own through ``model.step``."""
    got = {}
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            caches = fresh(model)
            for step in steps:
                for j, a, b, mode in step:
                    if j != i:
                        continue
                    out = model.step(torch.tensor(seq[a:b]), caches, mode)
                    if mode == "none":
                        assert out is None
                    else:
                        got[(i, a)] = out[None] if mode == "last" else out
    return got


def compare(batched: dict, alone: dict) -> float:
    """Same rows, same argmax, logits within ATOL; returns the max abs diff."""
    assert batched.keys() == alone.keys()
    worst = 0.0
    for key in alone:
        b, a = batched[key], alone[key]
        assert b.shape == a.shape, key
        assert torch.equal(b.argmax(-1), a.argmax(-1)), f"greedy token differs at {key}"
        worst = max(worst, (b - a).abs().max().item())
    assert worst <= ATOL, f"batched logits differ from the sequence alone by {worst:.3g}"
    return worst


def sequences(lengths: list[int], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


# 4 sequences: a 40-token prompt in two chunks, a 23-token prompt at once, a 9-token prompt in two,
# a 30-token prompt in two; then single decode tokens, all interleaved with each other's prefill
SEQS = sequences([44, 27, 13, 33])
STEPS: list[Step] = [
    [(0, 0, 16, "none"), (1, 0, 23, "last"), (2, 0, 5, "all")],
    [(2, 5, 9, "last"), (0, 16, 40, "all"), (1, 23, 24, "last"), (3, 0, 7, "none")],
    [(1, 24, 25, "all"), (0, 40, 41, "last"), (3, 7, 30, "all"), (2, 9, 10, "last")],
    [(3, 30, 31, "last"), (2, 10, 11, "none"), (0, 41, 42, "last"), (1, 25, 26, "last")],
    [(2, 11, 13, "all"), (3, 31, 33, "last"), (0, 42, 44, "none")],
    [(1, 26, 27, "last")],
]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone(models, family):
    model = models(family)
    diff = compare(run_batched(model, SEQS, STEPS), run_alone(model, SEQS, STEPS))
    print(f"{family}: max |batched - alone| = {diff:.3g}")


@pytest.mark.parametrize("family", FAMILIES)
def test_same_prompt_in_two_spans_over_two_cache_sets(models, family):
    """One prompt twice in one batch, each span over its own caches; then each continues with a
    different token, so a span that wrote into (or read from) the other's caches shows."""
    model = models(family)
    prompt, = sequences([21], seed=11)
    seqs = [prompt + [5, 9], prompt + [77, 9]]
    steps = [[(0, 0, 21, "all"), (1, 0, 21, "all")],
             [(0, 21, 22, "last"), (1, 21, 22, "last")],
             [(1, 22, 23, "last"), (0, 22, 23, "last")]]
    batched = run_batched(model, seqs, steps)
    # the same rows, up to the matmul kernels' rounding at another row offset of the call
    twin = (batched[(0, 0)] - batched[(1, 0)]).abs().max().item()
    assert twin <= ATOL, f"same prompt in one batch differs between its two spans by {twin:.3g}"
    compare(batched, run_alone(model, seqs, steps))


@pytest.mark.parametrize("family", FAMILIES)
def test_deferred_head_gives_the_same_logits(models, family):
    """``Batch.head`` False: forward returns the final hidden states of the rows that want logits,
    in their order, and ``Model.head`` on them gives forward's logits, bit for bit (the same rows
    in one call). A step with a draft to verify asks for its rows so (docs/speculative.md)."""
    model = models(family)

    def parts():
        return [(SEQS[0][:16], fresh(model), "all"), (SEQS[1][:5], fresh(model), "none"),
                (SEQS[2][:9], fresh(model), "last")]
    with torch.no_grad():
        want = model.forward(Batch.build(parts()))
        hidden = model.forward(Batch.build(parts(), head=False))
        assert want.shape == (17, model.vocab_size) and hidden.shape[0] == 17
        assert torch.equal(model.head(hidden), want)


def test_the_check_catches_shared_caches(models, monkeypatch):
    """A forward that ran every span over span 0's caches must fail the comparison."""
    model = models("lfm2")
    real = type(model).forward

    def span0_caches(self, batch):
        spans = tuple(dataclasses.replace(s, caches=batch.spans[0].caches) for s in batch.spans)
        return real(self, Batch(batch.tokens, spans))
    alone = run_alone(model, SEQS, STEPS)
    monkeypatch.setattr(type(model), "forward", span0_caches)
    with pytest.raises(AssertionError):
        compare(run_batched(model, SEQS, STEPS), alone)


def test_the_check_catches_mixed_rows(models, monkeypatch):
    """A norm with a reduction over all rows of the call (rows mixed) must fail the comparison."""
    model = models("llama")
    alone = run_alone(model, SEQS, STEPS)

    def batch_norm(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps) + 0.01 * x.mean(dim=0)
    monkeypatch.setattr(decoder_module, "rms_norm", batch_norm)   # llama's layer is the skeleton's PreNormBlock
    with pytest.raises(AssertionError):
        compare(run_batched(model, SEQS, STEPS), alone)


# ------------------------------------------------------------------------- random interleavings


@st.composite
def schedules(draw):
    """2-4 sequences of 1-30 tokens, each cut into random chunks; every step takes the next chunk
    of a random non-empty subset of the unfinished sequences, in random order, random logits."""
    lengths = draw(st.lists(st.integers(1, 30), min_size=2, max_size=4))
    pending = []
    for n in lengths:
        cuts, a = [], 0
        while a < n:
            b = a + draw(st.integers(1, n - a))
            cuts.append((a, b))
            a = b
        pending.append(cuts)
    steps = []
    while any(pending):
        live = [i for i, c in enumerate(pending) if c]
        chosen = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        step = []
        for i in chosen:
            a, b = pending[i].pop(0)
            step.append((i, a, b, draw(st.sampled_from(["none", "last", "all"]))))
        steps.append(step)
    return sequences(lengths, seed=draw(st.integers(0, 1000))), steps


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=schedules())
def test_random_interleavings(models, case):
    model = models("lfm2")   # conv state + full attention: both kinds of per-span state, and fast
    seqs, steps = case
    compare(run_batched(model, seqs, steps), run_alone(model, seqs, steps))
