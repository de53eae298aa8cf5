"""Sampling and scoring in the engine (tiny random models, in-process): the penalties, logit_bias
and min_p against reference computations on fixed logits (transformers' own processors where they
exist), logprobs against log_softmax of a cold transformers forward, greedy decoding with every
penalty against a step-by-step reference loop, seeded reproducibility with and without other
sequences in the batch, stop_token_ids, and n > 1 forking from one prefill of the prompt."""

from __future__ import annotations

import math

import pytest
import torch

from tiny import VOCAB, engine, tiny_gemma3, tiny_llama
from turnkv.engine.engine import GenerationRequest, Result, TokenEvent
from turnkv.engine.sampling import GREEDY_TEMPERATURE, ParamError, Sampler, SamplingParams, greedy_token

PROMPT = [5, 17, 42, 17, 99, 3, 250, 42, 8, 8, 61, 200, 13, 77, 5, 140]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=3)


def req(prompt=PROMPT, **params) -> GenerationRequest:
    params.setdefault("max_tokens", 12)
    params.setdefault("ignore_eos", True)
    return GenerationRequest(list(prompt), SamplingParams(**params))


def cold_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of ``tokens`` (one cold forward)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


# --------------------------------------------------------------------------- maths on fixed logits


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.5, -0.5])


def test_greedy_token_is_torch_argmax():
    """The greedy pick (NumPy's argmax on CPU rows) equals torch.argmax: random rows of both
    vocabulary sizes, ties (the first wins), NaN (counts as maximal, the first one), all -inf,
    +inf, float64, a strided view, and bfloat16 (torch's own path)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=g) for n in (49152, 262144, 7)]
    tie = torch.randn(1000, generator=g)
    tie[[17, 400, 999]] = tie.max() + 1
    nan = torch.randn(1000, generator=g)
    nan[[5, 600]] = float("nan")
    inf = torch.randn(100, generator=g)
    inf[[3, 9]] = float("inf")
    rows += [tie, nan, inf, torch.full((50,), float("-inf")), torch.full((9,), float("nan")),
             torch.randn(300, generator=g, dtype=torch.float64), torch.randn(2, 500, generator=g)[:, 3],
             torch.randn(500, generator=g).to(torch.bfloat16)]
    for r in rows:
        assert greedy_token(r) == int(torch.argmax(r)), r.shape
    assert greedy_token(tie) == 17 and greedy_token(nan) == 5


def test_frequency_and_presence_penalties_match_openai_formula():
    # OpenAI: mu[j] - c[j] * frequency_penalty - [c[j] > 0] * presence_penalty, c over generated tokens
    s = Sampler(SamplingParams(frequency_penalty=0.7, presence_penalty=0.4), prompt=[1, 2, 2])
    s.adjust(LOGITS)                           # allocates the counts (prompt tokens do not count)
    for t in (3, 3, 0, 3, 6):
        s.observe(t)
    counts = torch.zeros(8)
    for t in (3, 3, 0, 3, 6):
        counts[t] += 1
    want = LOGITS - 0.7 * counts - 0.4 * (counts > 0).float()
    torch.testing.assert_close(s.adjust(LOGITS), want, rtol=0, atol=1e-6)
    assert s.adjust(LOGITS)[1] == LOGITS[1]     # a prompt-only token is not penalized


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, generated = [1, 4, 4], [3, 6]
    s = Sampler(SamplingParams(repetition_penalty=1.3), prompt=prompt)
    s.adjust(LOGITS)
    for t in generated:
        s.observe(t)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), LOGITS[None].clone())[0]
    torch.testing.assert_close(s.adjust(LOGITS), ref, rtol=0, atol=1e-6)
    # by hand: positive logits divided, negative multiplied, others untouched
    assert math.isclose(float(s.adjust(LOGITS)[3]), 3.0 / 1.3, rel_tol=1e-6)
    assert math.isclose(float(s.adjust(LOGITS)[4]), -2.5 * 1.3, rel_tol=1e-6)
    assert s.adjust(LOGITS)[0] == LOGITS[0]


def test_logit_bias_min_p_and_the_input_is_never_modified():
    from transformers import MinPLogitsWarper

    logits = LOGITS.clone()
    s = Sampler(SamplingParams(logit_bias={1: 5.0, 3: -100.0}, temperature=0.7, min_p=0.2))
    adjusted = s.adjust(logits)
    want = LOGITS.clone()
    want[1] += 5.0
    want[3] -= 100.0
    torch.testing.assert_close(adjusted, want)
    warped = s.warp(adjusted)
    ref = MinPLogitsWarper(0.2)(torch.zeros(1, 1, dtype=torch.long), (adjusted / 0.7)[None])[0]
    assert torch.equal(torch.isinf(warped), torch.isinf(ref))
    torch.testing.assert_close(warped[~torch.isinf(warped)], ref[~torch.isinf(ref)])
    assert torch.equal(logits, LOGITS)


def test_tiny_temperatures_are_greedy_and_finite():
    for t in (1e-40, 1e-300, 5e-324, GREEDY_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        p.validate()
        s = Sampler(p)
        assert s.generator is None and s(LOGITS) == 3
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_validation_names_the_field():
    bad = [(dict(logit_bias={300: 1.0}), "logit_bias"), (dict(logit_bias={3: 101.0}), "logit_bias"),
           (dict(stop_token_ids=[VOCAB]), "stop_token_ids"), (dict(repetition_penalty=0.0), "repetition_penalty"),
           (dict(min_p=1.5), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
           (dict(logprobs=21), "logprobs"), (dict(temperature=float("nan")), "temperature"),
           (dict(frequency_penalty=float("inf")), "frequency_penalty"), (dict(n=0), "n")]
    for fields, param in bad:
        with pytest.raises(ParamError) as err:
            SamplingParams(**fields).validate(VOCAB)
        assert err.value.param == param, fields


# ------------------------------------------------------------------------------ in the engine


def test_logprobs_are_log_softmax_of_the_models_logits(tiny):
    model, hf = tiny
    res = engine(model).generate(req(logprobs=5, max_tokens=8))
    assert len(res.logprobs) == len(res.token_ids) == 8
    ref = torch.log_softmax(cold_logits(hf, PROMPT + res.token_ids), dim=-1)[len(PROMPT) - 1:]
    for i, entry in enumerate(res.logprobs):
        assert entry.token_id == res.token_ids[i]
        assert math.isclose(entry.logprob, float(ref[i, entry.token_id]), abs_tol=1e-4), i
        values, ids = ref[i].topk(5)
        assert [t for t, _ in entry.top] == ids.tolist(), i
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), values, rtol=0, atol=1e-4)
        assert entry.top[0][0] == entry.token_id          # greedy: the chosen token is the most likely
    # sampled with a temperature and penalties: still the raw distribution's logprobs
    res = engine(model).generate(req(logprobs=0, temperature=1.5, seed=7, presence_penalty=1.0, max_tokens=6))
    ref = torch.log_softmax(cold_logits(hf, PROMPT + res.token_ids), dim=-1)[len(PROMPT) - 1:]
    for i, entry in enumerate(res.logprobs):
        assert entry.top == [] and math.isclose(entry.logprob, float(ref[i, res.token_ids[i]]), abs_tol=1e-4)


def test_greedy_with_penalties_and_bias_matches_a_reference_loop(tiny):
    model, hf = tiny
    params = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3, logit_bias={7: 2.5, 9: -1.0})
    got = engine(model).generate(req(max_tokens=10, **params)).token_ids
    tokens, counts = list(PROMPT), torch.zeros(VOCAB)
    for _ in range(10):
        scores = cold_logits(hf, tokens)[-1]
        scores[7] += 2.5
        scores[9] -= 1.0
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[torch.tensor(tokens)] = True
        scores = torch.where(seen & (scores > 0), scores / 1.4, torch.where(seen, scores * 1.4, scores))
        scores = scores - 0.6 * counts - 0.3 * (counts > 0).float()
        t = int(scores.argmax())
        tokens.append(t)
        counts[t] += 1
    assert got == tokens[len(PROMPT):]
    assert got != engine(model).generate(req(max_tokens=10)).token_ids    # the penalties changed something


class Collector:
    def __init__(self):
        self.results: dict[int, Result] = {}
        self.tokens: dict[int, list[int]] = {}

    def __call__(self, item):
        if isinstance(item, TokenEvent):
            self.tokens.setdefault(item.index, []).append(item.token_id)
        elif isinstance(item, Result):
            self.results[item.index] = item
        else:
            raise AssertionError(item)


def run_together(eng, reqs) -> list[Collector]:
    sinks = [Collector() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, s)
    for _ in range(10_000):
        if all(len(s.results) == r.params.n for r, s in zip(reqs, sinks)):
            return sinks
        eng.step()
    raise AssertionError("requests did not end")


def test_seed_gives_the_same_tokens_alone_and_batched(tiny):
    model, _ = tiny
    seeded = dict(temperature=1.0, top_p=0.95, min_p=0.02, seed=1234, max_tokens=16)
    first = engine(model).generate(req(**seeded)).token_ids
    assert engine(model).generate(req(**seeded)).token_ids == first
    others = [req([9, 8, 7, 6] * 5, temperature=1.0, max_tokens=20), req(PROMPT[:9], temperature=0.8, max_tokens=5),
              req(PROMPT, temperature=1.0, seed=99, max_tokens=16)]
    sinks = run_together(engine(model, max_batch_tokens=16), [others[0], req(**seeded), others[1], others[2]])
    assert sinks[1].results[0].token_ids == first
    assert sinks[3].results[0].token_ids != first      # another seed, same prompt: another draw
    assert engine(model).generate(req(**{**seeded, "seed": 1235})).token_ids != first


def test_stop_token_ids_end_the_sequence(tiny):
    model, _ = tiny
    free = engine(model).generate(req(max_tokens=10)).token_ids
    stop = free[3]
    cut = free.index(stop)
    res = engine(model).generate(req(max_tokens=10, stop_token_ids=[stop]))
    assert res.finish_reason == "stop" and res.token_ids == free[:cut + 1]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_n_choices_share_one_prefill(tiny, family):
    # gemma3: sliding-window ring layers fork from the snapshot too (window 16 < prompt + reply)
    model = tiny[0] if family == "llama" else tiny_gemma3(seed=1, window=8)[0]
    single = engine(model, budget=0).generate(req(max_tokens=10))
    eng = engine(model)
    results = eng.generate_choices(req(max_tokens=10, n=3))
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.token_ids == single.token_ids for r in results)        # temperature 0: all equal
    stats = eng.prompt_cache.stats()
    assert stats["tokens_prefilled"] == len(PROMPT) and stats["lookups"] == 1     # the prompt once
    assert results[0].stats.prefilled_tokens == len(PROMPT)
    assert [r.stats.prefilled_tokens for r in results[1:]] == [0, 0]
    assert [r.stats.reuse_from for r in results[1:]] == ["fork", "fork"]


def test_n_choices_seeded_are_reproducible_and_decode_together(tiny):
    model, _ = tiny
    sampled = dict(temperature=1.0, seed=42, max_tokens=12)
    eng = engine(model, max_seqs=4)
    steps0 = eng.steps
    results = eng.generate_choices(req(n=4, **sampled))
    steps = eng.steps - steps0
    assert steps <= 1 + 12 + 1, steps      # one prefill step, then the four choices decode in the same steps
    # choice i uses seed + i: it equals an n = 1 request with that seed, alone or again with n = 4
    for i, r in enumerate(results):
        assert r.token_ids == engine(model, budget=0).generate(req(**{**sampled, "seed": 42 + i})).token_ids, i
    assert len({tuple(r.token_ids) for r in results}) > 1
    again = engine(model, max_seqs=2).generate_choices(req(n=4, **sampled))   # fewer slots: forks wait
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def test_n_choices_with_logprobs_and_a_cancel_before_the_fork(tiny):
    model, hf = tiny
    results = engine(model).generate_choices(req(n=2, temperature=1.0, seed=5, logprobs=2, max_tokens=5))
    for r in results:
        ref = torch.log_softmax(cold_logits(hf, PROMPT + r.token_ids), dim=-1)[len(PROMPT) - 1:]
        for i, entry in enumerate(r.logprobs):
            assert math.isclose(entry.logprob, float(ref[i, r.token_ids[i]]), abs_tol=1e-4)
    # the leader cancelled while it prefills: every choice ends ("cancelled"), no slot is leaked
    eng = engine(model, chunk=4, max_seqs=3)
    sink = Collector()
    seq = eng.submit(req(n=3, max_tokens=5), sink)
    eng.step()
    seq.cancel()
    for _ in range(5):
        eng.step()
    assert sorted(sink.results) == [0, 1, 2] and {r.finish_reason for r in sink.results.values()} == {"cancelled"}
    assert not eng.scheduler.running and not eng.scheduler.waiting and len(eng.pool.free) == len(eng.pool.slots)
