"""Continuous batching through the engine: a sequence's tokens are the same whatever else runs in
its steps (other lengths, shared prefixes, cancellations), reuse still equals the cold run, and the
scheduler's limits hold (queue bound, cancellation within one step)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from tiny import VOCAB, engine, request, tiny_gemma3, tiny_llama
from turnkv.cache.kv import KVCache
from turnkv.engine.engine import QueueFull, Result, TokenEvent

ATOL = 1e-4      # float32 GEMMs may round differently with another number of rows


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_llama()[0], "gemma3": tiny_gemma3()[0]}


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def alone(model, req) -> Result:
    """The reference: the request on a fresh engine with the prompt cache off, nothing beside it."""
    return engine(model, budget=0).generate(req)


class Collector:
    def __init__(self):
        self.tokens: list[int] = []
        self.result: Result | None = None
        self.failure = None

    def __call__(self, item):
        if isinstance(item, TokenEvent):
            self.tokens.append(item.token_id)
        elif isinstance(item, Result):
            self.result = item
        else:
            self.failure = item


def run_all(eng, reqs, cancel_after: dict[int, int] | None = None, max_steps: int = 10_000):
    """Submit every request at once and step until all have ended; ``cancel_after[i] = k`` cancels
    request i once it has produced k tokens."""
    sinks = [Collector() for _ in reqs]
    seqs = [eng.submit(r, s) for r, s in zip(reqs, sinks)]
    for _ in range(max_steps):
        for i, k in (cancel_after or {}).items():
            if len(sinks[i].tokens) >= k:
                seqs[i].cancel()
        if all(s.result is not None or s.failure is not None for s in sinks):
            break
        eng.step()
    assert all(s.failure is None for s in sinks)
    return sinks, seqs


def assert_same(got: Result, want: Result):
    assert got.token_ids == want.token_ids
    diff = (got.first_logits - want.first_logits).abs().max().item()
    assert diff <= ATOL, diff


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_requests_equal_each_alone(models, family):
    model, rng = models[family], random.Random(3)
    system = rand_tokens(rng, 50)
    reqs = [request([system, rand_tokens(rng, 9)], 12),           # two share a system prompt
            request([system, rand_tokens(rng, 30)], 7),
            request([rand_tokens(rng, 140)], 10),                  # a long prompt: several chunks
            request([rand_tokens(rng, 3)], 15),
            request([rand_tokens(rng, 70), rand_tokens(rng, 5)], 1)]   # one token only
    eng = engine(model, budget=0, max_seqs=4, max_batch_tokens=40)
    sinks, _ = run_all(eng, reqs)
    for req, sink in zip(reqs, sinks):
        assert_same(sink.result, alone(model, req))
        assert sink.tokens == sink.result.token_ids
    assert eng.steps < sum(len(r.prompt_ids) + 15 for r in reqs)   # sequences really shared steps


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reuse_from_a_sequence_still_running(models, family):
    """A second conversation turn is served while another sequence decodes: it restores the first
    turn's stored state (cached tokens > 0) and equals the cold run."""
    model, rng = models[family], random.Random(4)
    system, u1, u2 = rand_tokens(rng, 60), rand_tokens(rng, 10), rand_tokens(rng, 10)
    eng = engine(model, max_seqs=3, max_batch_tokens=48)
    first = eng.generate(request([system, u1], 8))
    other = request([rand_tokens(rng, 90)], 30)
    turn2 = request([system, u1, first.token_ids[:-1], u2], 8)
    sinks, _ = run_all(eng, [other, turn2])
    assert sinks[1].result.usage.cached_tokens > 0
    assert_same(sinks[1].result, alone(model, turn2))
    assert_same(sinks[0].result, alone(model, other))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_many_users_run_in_the_reserved_pools(models, family):
    """The engine's block pools are reserved for --max-seqs sequences of its context (cache/slots.py
    ``reserve_plan``): four users through three turns each (restores, shared prefixes, copy-on-
    write) open blocks inside the stores the engine started with, never reallocating one, and each
    user's turns equal their cold runs (reuse happened)."""
    model, rng = models[family], random.Random(21)
    eng = engine(model, max_seqs=4, max_batch_tokens=48)
    pools = [p for p in eng.pool.block_pools if p is not None]
    start = [{n: t.data_ptr() for n, t in p.store.parts.items()} for p in pools]
    full = [p for p, spec in zip(eng.pool.block_pools, eng.specs) if spec.kind == "full"]
    assert full and all(p.reserved >= 4 * (eng.max_context // p.block) for p in full)
    assert all(p.reserved > 0 for p in pools)
    system = rand_tokens(rng, 70)
    history = [[system, rand_tokens(rng, 12 + u)] for u in range(4)]
    cached = 0
    for turn in range(3):
        reqs = [request(h, 6) for h in history]
        sinks, _ = run_all(eng, reqs)
        for req, h, sink in zip(reqs, history, sinks):
            assert_same(sink.result, alone(model, req))
            cached += sink.result.usage.cached_tokens
            h += [sink.result.token_ids[:-1], rand_tokens(rng, 9)]
    assert cached > 0
    assert all(p.blocks > 0 for p in pools)
    assert [{n: t.data_ptr() for n, t in p.store.parts.items()} for p in pools] == start


def test_cancel_mid_prefill_takes_effect_within_one_step(models):
    model, rng = models["llama"], random.Random(5)
    eng = engine(model, max_seqs=2, max_batch_tokens=16, chunk=16)
    long = request([rand_tokens(rng, 200)], 5)
    sink = Collector()
    seq = eng.submit(long, sink)
    eng.step()
    eng.step()
    assert 0 < seq.pos < 200
    seq.cancel()
    eng.step()
    assert seq.done and sink.result is not None and sink.result.finish_reason == "cancelled"
    assert sink.tokens == [] and eng.pending() == 0
    assert len(eng.pool.free) == 1       # its slot is back
    # what it had computed is stored: a retry restores it and equals the cold run
    again = eng.generate(long)
    assert again.usage.cached_tokens == seq.pos
    assert_same(again, alone(model, long))


def prefill_steps(eng, seq) -> list[int]:
    """The tokens of ``seq``'s prompt each step computed, stepping until its prompt is done."""
    out, pos = [], 0
    while seq.pos < len(seq.prompt) and not seq.done:
        eng.step()
        out.append(seq.pos - pos)
        pos = seq.pos
    return out


def test_a_prompt_no_stream_waits_on_takes_whole_prefill_chunks(models):
    """A step that decodes nothing holds up no stream: its prompt chunk takes --prefill-chunk tokens
    even past --max-batch-tokens (the same tokens in fewer forwards); beside a decoding sequence the
    step keeps under --max-batch-tokens."""
    model, rng = models["llama"], random.Random(8)
    long = request([rand_tokens(rng, 150)], 3)
    eng = engine(model, budget=0, max_seqs=2, max_batch_tokens=16, chunk=64)
    sink = Collector()
    assert prefill_steps(eng, eng.submit(long, sink)) == [64, 64, 22]
    while sink.result is None:
        eng.step()
    assert_same(sink.result, engine(model, budget=0, max_seqs=2, max_batch_tokens=16, chunk=16).generate(long))
    eng = engine(model, budget=0, max_seqs=2, max_batch_tokens=16, chunk=64)
    talker = eng.submit(request([rand_tokens(rng, 5)], 200), Collector())
    while talker.pos < len(talker.prompt):
        eng.step()
    steps = prefill_steps(eng, eng.submit(long, Collector()))
    assert sum(steps) == 150 and max(steps) <= 15 and not talker.done


def test_cancelled_sequence_does_not_disturb_the_others(models):
    model, rng = models["gemma3"], random.Random(6)
    reqs = [request([rand_tokens(rng, 40)], 20), request([rand_tokens(rng, 25)], 20),
            request([rand_tokens(rng, 33)], 20)]
    eng = engine(model, budget=0, max_seqs=3, max_batch_tokens=64)
    sinks, _ = run_all(eng, reqs, cancel_after={1: 4})
    assert sinks[1].result.finish_reason == "cancelled" and 4 <= len(sinks[1].tokens) < 20
    for i in (0, 2):
        assert_same(sinks[i].result, alone(model, reqs[i]))


def test_queue_bound_refuses_with_queue_full(models):
    model, rng = models["llama"], random.Random(7)
    eng = engine(model, max_seqs=1, max_queue=1)
    eng.submit(request([rand_tokens(rng, 5)], 3), Collector())   # takes the slot at the next step
    eng.submit(request([rand_tokens(rng, 5)], 3), Collector())   # waits
    with pytest.raises(QueueFull):
        eng.submit(request([rand_tokens(rng, 5)], 3), Collector())
    while eng.pending():
        eng.step()
    eng.submit(request([rand_tokens(rng, 5)], 3), Collector())   # room again


def test_bad_request_is_refused_at_submit(models):
    eng = engine(models["llama"])
    with pytest.raises(ValueError):
        eng.submit(request([[VOCAB + 5]], 3), Collector())
    assert eng.pending() == 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_interleavings(models, data):
    model = models["llama"]
    seed = data.draw(st.integers(0, 10_000))
    rng = random.Random(seed)
    n = data.draw(st.integers(2, 6))
    lens = [data.draw(st.integers(1, 80)) for _ in range(n)]
    outs = [data.draw(st.integers(1, 8)) for _ in range(n)]
    reqs = [request([rand_tokens(rng, k)], m) for k, m in zip(lens, outs)]
    eng = engine(model, budget=0, max_seqs=data.draw(st.integers(1, 4)),
                 max_batch_tokens=data.draw(st.integers(8, 64)), chunk=data.draw(st.integers(4, 32)))
    sinks, _ = run_all(eng, reqs)
    for req, sink in zip(reqs, sinks):
        assert_same(sink.result, alone(model, req))



@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_requests_arriving_together_share_their_common_prefix(models, family):
    """Three requests with one 150-token system prompt arrive in the same instant: the first
    computes it, the others wait for its checkpoint there and restore it (cached tokens = the
    shared prefix) instead of computing it three times; each still equals its run alone."""
    model, rng = models[family], random.Random(9)
    system = rand_tokens(rng, 150)
    reqs = [request([system, rand_tokens(rng, 12 + i)], 5) for i in range(3)]
    eng = engine(model, max_seqs=3, max_batch_tokens=64, chunk=64)
    sinks, _ = run_all(eng, reqs)
    assert sinks[0].result.usage.cached_tokens == 0
    for sink in sinks[1:]:
        assert sink.result.usage.cached_tokens == 150, sink.result.usage
        assert sink.result.stats.prefilled_tokens < 20
    for req, sink in zip(reqs, sinks):
        assert_same(sink.result, alone(model, req))
    stats = eng.prompt_cache.stats()
    assert stats["tokens_prefilled"] < 150 + 3 * 20, stats
    # and they held the prefix's KV as the same pool blocks (references, no copy): every
    # full-attention layer of the three slots starts with the same two 64-position blocks
    full = [i for i, c in enumerate(eng.pool.slots[0].caches) if isinstance(c, KVCache) and c.kind == "full"]
    assert full and len(eng.pool.slots) == 3
    for i in full:
        heads = {tuple(slot.caches[i].block_ids()[:2]) for slot in eng.pool.slots}
        assert len(heads) == 1 and len(next(iter(heads))) == 2, (i, heads)


# --- the bundled SmolLM2 under the default gguf weights: bit-identical through the engine -----------

@pytest.fixture(scope="module")
def gguf_smollm2():
    from turnkv import kernels
    from turnkv.loading.bundled import find_bundled

    if not kernels.native_available():
        native.missing("the native kernels")
    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("needs the bundled SmolLM2")
    from turnkv.engine.engine import Engine
    return Engine.load("smollm2-135m", weights="gguf", progress=False).model


@pytest.mark.real
def test_gguf_chat_reuse_and_concurrency_are_bit_identical(gguf_smollm2):
    """Under gguf weights (batch-invariant matmul and attention kernels) the engine's results do
    not depend on reuse, chunking or who else is in the step: cache on == cache off == four users
    at once, with torch.equal on the logits each first token was sampled from."""
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache

    model = gguf_smollm2

    def make(budget, **kw):
        return Engine(model, None, fingerprint="smollm2-gguf", prompt_cache=PromptCache(budget), max_context=2048,
                      **kw)

    rng = random.Random(10)
    system = rand_tokens(rng, 120)
    on, off = make(1 << 30, prefill_chunk=64), make(0, prefill_chunk=512)
    history = [system]
    for turn in range(3):
        history.append(rand_tokens(rng, 15))
        a, b = on.generate(request(history, 6)), off.generate(request(history, 6))
        assert a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits), turn
        if turn:
            assert a.usage.cached_tokens > 0
        history.append(a.token_ids[:-1])
    users = [request([system, rand_tokens(rng, 10 + u)], 5) for u in range(4)]
    many = make(1 << 30, max_seqs=4, max_batch_tokens=48, prefill_chunk=32)
    sinks, _ = run_all(many, users)
    for req, sink in zip(users, sinks):
        ref = make(0).generate(req)
        assert sink.result.token_ids == ref.token_ids
        assert torch.equal(sink.result.first_logits, ref.first_logits)


@pytest.mark.parametrize("mode", ["bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_kv_mode_batched_equals_alone_and_reuse_equals_cold(models, family, mode):
    """Quantized and half-precision KV under batching: each request equals its run alone in the
    same mode (other chunk boundaries, other rows beside it), and the next turn restores the
    stored state in that mode and equals the cold run."""
    model, rng = models[family], random.Random(11)
    system, u1 = rand_tokens(rng, 50), rand_tokens(rng, 9)
    reqs = [request([system, u1], 10), request([rand_tokens(rng, 120)], 6), request([rand_tokens(rng, 4)], 12)]
    eng = engine(model, max_seqs=3, max_batch_tokens=40, kv_mode=mode)

    def solo(req):
        return engine(model, budget=0, kv_mode=mode).generate(req)

    sinks, _ = run_all(eng, reqs)
    for req, sink in zip(reqs, sinks):
        assert_same(sink.result, solo(req))
    turn2 = request([system, u1, sinks[0].result.token_ids[:-1], rand_tokens(rng, 6)], 8)
    sinks2, _ = run_all(eng, [turn2, request([rand_tokens(rng, 60)], 20)])
    assert sinks2[0].result.usage.cached_tokens >= len(system) + len(u1)
    assert_same(sinks2[0].result, solo(turn2))
