"""KV storage modes through the engine: reuse stays exact in every mode (cache on == cache off
with the mode fixed), and a snapshot never crosses mode tables."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import VOCAB, engine, request, tiny_gemma3, tiny_llama
from turnkv.cache.base import KV_MODE_MISMATCH, SnapshotMismatch
from turnkv.engine.engine import Engine
from turnkv.engine.sampling import SamplingParams
from turnkv.cache.snapshot import restore_snapshot
from turnkv.prompt_cache.store import PromptCache

MODES = ["bf16", "fp16", "int8", "int4"]


def rand_msg(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_models():
    return {"llama": tiny_llama()[0], "gemma3": tiny_gemma3()[0]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_reuse_exact_in_every_mode(tiny_models, family, mode):
    rng = random.Random(3)
    on = engine(tiny_models[family], kv_mode=mode)
    off = engine(tiny_models[family], budget=0, kv_mode=mode)
    history = [rand_msg(rng, 40)]
    for _ in range(6):
        history.append(rand_msg(rng, 10))
        a, b = on.generate(request(history, 4)), off.generate(request(history, 4))
        assert a.token_ids == b.token_ids
        assert torch.allclose(a.first_logits, b.first_logits, atol=1e-4)
        history.append(a.token_ids[:-1] or a.token_ids)
    assert on.prompt_cache.stats()["hits"] >= 5


def test_snapshot_under_one_table_refused_by_another(tiny_models):
    model = tiny_models["gemma3"]
    rng = random.Random(4)
    a, b = engine(model, kv_mode="int8"), engine(model, kv_mode="native")
    prompt = request([rand_msg(rng, 30)], 3)
    a.generate(prompt)
    hit = a.prompt_cache.lookup(a.namespace(), prompt.prompt_ids)
    assert hit is not None
    b.generate(request([rand_msg(rng, 20)], 2))         # b's live slot holds something else
    caches = b.pool.slots[0].caches
    before = [c.offset for c in caches], [c.nbytes for c in caches]
    with pytest.raises(SnapshotMismatch) as err:
        restore_snapshot(caches, hit.snapshot, hit.usable, b.family, b.fingerprint, b.modes)
    assert err.value.reason == KV_MODE_MISMATCH
    assert ([c.offset for c in caches], [c.nbytes for c in caches]) == before


def test_shared_store_counts_kv_mode_mismatch(tiny_models):
    model = tiny_models["llama"]
    rng = random.Random(5)
    store = PromptCache(1 << 30)
    common = dict(fingerprint="tiny-shared", prompt_cache=store, max_context=4096)
    a, b = Engine(model, None, kv_mode="int8", **common), Engine(model, None, kv_mode="int4", **common)
    prompt = request([rand_msg(rng, 30), rand_msg(rng, 8)], 3)
    a.generate(prompt)
    res = b.generate(prompt)
    assert res.usage.cached_tokens == 0
    assert store.stats()["refusals"].get(KV_MODE_MISMATCH, 0) >= 1


def test_modes_really_used(tiny_models):
    model = tiny_models["llama"]
    rng = random.Random(6)
    prompt = request([rand_msg(rng, 200)], 1)
    results, nbytes = {}, {}
    for mode in ["native", "int8", "int4"]:
        eng = engine(model, budget=0, kv_mode=mode)
        results[mode] = eng.generate(prompt).first_logits
        nbytes[mode] = eng.live_bytes
    assert not torch.equal(results["native"], results["int4"])
    assert (results["native"] - results["int8"]).abs().max() < (results["native"] - results["int4"]).abs().max()
    assert nbytes["int8"] * 3 < nbytes["native"] and nbytes["int4"] * 5 < nbytes["native"]


# --- real bundled models --------------------------------------------------------------------------
#
# Why two tests. A stored (restored) snapshot holds exactly the bytes the live cache computed, so the
# cache itself adds no error in any mode. But with cache on, the prompt is prefilled from the reuse
# point on, and the previous turn's generated tokens got their K/V from one-row decode steps, while
# cache off prefills the whole prompt in 512-token chunks. On CPU a row's float result depends (in
# the last bits) on how many rows are computed with it, so native K/V differ between the two by
# ~1e-6. Rounding to a storage format turns that into whole-step differences for the values that sit
# near a rounding boundary, and each layer feeds the next, so over 30 layers cache on and cache off
# end up about as different as two independent quantizations. Measured over the 8 turns below, the
# top-2 logit gap of a greedy step moved by up to (smollm2-135m / gemma3-270m): native 2e-5 / 2e-5,
# fp16 0.009 / 0.013, bf16 0.07 / 0.08, int8 0.31 / 0.82, int4 3.2 / 1.1 nats.
#
# So exactness is tested where it is well defined: with one-token prefill steps every token's K/V
# is computed the same way with cache on and off, and the two runs must agree bit for bit (tokens and
# logits) in every mode. The production chunked run is tested with a stated tolerance: the greedy
# tokens are identical except that a turn may part at a step whose cold top-2 gap is below the
# mode's noise level (``NEAR_TIE``), never at a clear choice.

SYSTEM = "You are a concise assistant. " + " ".join(
    f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 16))
USERS = [f"Question {i}: what is {i} plus {i + 3}? Answer in one short sentence." for i in range(1, 9)]

# nats: a greedy step of the cold (cache off) run whose top-2 logit gap is below this may pick the
# other token with cache on; 1.5-3x the largest gap change measured (see above)
NEAR_TIE = {"native": 1e-3, "fp16": 0.04, "bf16": 0.25, "int8": 2.0, "int4": 5.0}


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real_model(request):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    ckpt = load_checkpoint(request.param, progress=False)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    return model, ckpt


def real_engines(real_model, mode, **kw) -> tuple[Engine, Engine]:
    model, ckpt = real_model
    common = dict(fingerprint=ckpt.fingerprint, name=ckpt.name, max_context=4096, kv_mode=mode, **kw)
    return (Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(1 << 30), **common),
            Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(0), **common))


def record_step_logits(eng: Engine) -> list[torch.Tensor]:
    """Wraps this engine's per-sequence step to keep every next-token logits a token is sampled
    from (test-only; one sequence at a time)."""
    seen: list[torch.Tensor] = []
    advance = eng._advance

    def recording(work, logits):
        if logits is not None:
            seen.append(logits.detach().float().reshape(-1).clone())
        return advance(work, logits)

    eng._advance = recording
    return seen


def step_logits(res, seen: list[torch.Tensor]) -> list[torch.Tensor]:
    """The logits each generated token was picked from: the first (possibly restored) one, then the
    decode steps' (the last ``n - 1`` recorded forwards)."""
    n = len(res.token_ids)
    return [res.first_logits.float().reshape(-1)] + (seen[len(seen) - (n - 1):] if n > 1 else [])


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return (top[0] - top[1]).item()


@pytest.mark.real
@pytest.mark.parametrize("mode", [pytest.param("int4"), pytest.param("int8", marks=pytest.mark.slow),
                                  pytest.param("bf16", marks=pytest.mark.slow)])
def test_real_reuse_bit_exact_with_one_token_steps(real_model, mode):
    """Cache on == cache off, bit for bit, when no prefill shape differs: every forward is one token."""
    on, off = real_engines(real_model, mode, prefill_chunk=1)
    msgs = [{"role": "system", "content": "You are a concise assistant."}]
    previous = 0
    for turn, user in enumerate(USERS[:3], start=1):
        msgs.append({"role": "user", "content": user})
        a = on.generate(on.chat_request(msgs, SamplingParams(max_tokens=4)))
        b = off.generate(off.chat_request(msgs, SamplingParams(max_tokens=4)))
        assert a.token_ids == b.token_ids, (mode, turn, a.text, b.text)
        assert torch.equal(a.first_logits, b.first_logits), (mode, turn)
        assert a.usage.cached_tokens >= previous      # the whole previous prompt came from the cache
        previous = a.usage.prompt_tokens
        msgs.append({"role": "assistant", "content": a.text})


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["native"] + MODES)
def test_real_eight_turns_in_mode(real_model, mode):
    """Chunked prefill (the default), 8 turns: cache on picks the same greedy tokens as cache off,
    except that a turn may part at a near-tie of the cold run (see NEAR_TIE); the rest of that turn
    is then not compared, and the conversation goes on with the cold run's answer."""
    on, off = real_engines(real_model, mode)
    seen_on, seen_off = record_step_logits(on), record_step_logits(off)
    msgs = [{"role": "system", "content": SYSTEM}]
    parted = []
    for turn, user in enumerate(USERS, start=1):
        msgs.append({"role": "user", "content": user})
        a = on.generate(on.chat_request(msgs, SamplingParams(max_tokens=6)))
        b = off.generate(off.chat_request(msgs, SamplingParams(max_tokens=6)))
        if turn > 1:
            assert a.usage.cached_tokens >= 0.8 * a.usage.prompt_tokens
        if a.token_ids != b.token_ids:
            i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            gap = top2_gap(step_logits(b, seen_off)[i]) if i < len(b.token_ids) else float("inf")
            assert gap < NEAR_TIE[mode], (mode, turn, i, gap, a.text, b.text)
            parted.append((turn, i, gap))
        msgs.append({"role": "assistant", "content": b.text})
    assert len(parted) <= 2, parted
