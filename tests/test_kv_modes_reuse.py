"""KV storage modes through the engine: reuse stays exact in every mode (cache on == cache off
with the mode fixed), and a snapshot never crosses mode tables."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import VOCAB, engine, request, tiny_gemma3, tiny_llama
from turnkv.cache.base import KV_MODE_MISMATCH, SnapshotMismatch
from turnkv.engine.generate import Engine
from turnkv.engine.sampling import SamplingParams
from turnkv.prompt_cache.snapshot import restore_snapshot
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
    b.generate(request([rand_msg(rng, 20)], 2))         # b's live caches hold something else
    before = [c.offset for c in b.caches], [c.nbytes for c in b.caches]
    with pytest.raises(SnapshotMismatch) as err:
        restore_snapshot(b.caches, hit.snapshot, hit.usable, b.family, b.fingerprint, b.modes)
    assert err.value.reason == KV_MODE_MISMATCH
    assert ([c.offset for c in b.caches], [c.nbytes for c in b.caches]) == before


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
        nbytes[mode] = sum(c.nbytes for c in eng.caches)
    assert not torch.equal(results["native"], results["int4"])
    assert (results["native"] - results["int8"]).abs().max() < (results["native"] - results["int4"]).abs().max()
    assert nbytes["int8"] * 3 < nbytes["native"] and nbytes["int4"] * 5 < nbytes["native"]


# --- real bundled models: 8 turns per mode, cache on == cache off ---------------------------------

SYSTEM = "You are a concise assistant. " + " ".join(
    f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 16))
USERS = [f"Question {i}: what is {i} plus {i + 3}? Answer in one short sentence." for i in range(1, 9)]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real_model(request):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    ckpt = load_checkpoint(request.param, progress=False)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    return model, ckpt


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_real_eight_turns_exact_in_mode(real_model, mode):
    model, ckpt = real_model
    common = dict(fingerprint=ckpt.fingerprint, name=ckpt.name, max_context=4096, kv_mode=mode)
    on = Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(1 << 30), **common)
    off = Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(0), **common)
    msgs = [{"role": "system", "content": SYSTEM}]
    for turn, user in enumerate(USERS, start=1):
        msgs.append({"role": "user", "content": user})
        a = on.generate(on.chat_request(msgs, SamplingParams(max_tokens=6)))
        b = off.generate(off.chat_request(msgs, SamplingParams(max_tokens=6)))
        assert a.token_ids == b.token_ids, (mode, turn, a.text, b.text)
        if turn > 1:
            assert a.usage.cached_tokens >= 0.8 * a.usage.prompt_tokens
        msgs.append({"role": "assistant", "content": a.text})
