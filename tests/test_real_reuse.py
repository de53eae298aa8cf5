"""Reuse exactness on the two real bundled models: an 8-turn chat with the prompt cache on gives
the cold run's greedy tokens and logits; Gemma's conversation passes its 512-token window so the
sliding-window rings wrap."""

from __future__ import annotations

import pytest
import torch

from turnkv.engine.engine import Engine
from turnkv.engine.sampling import SamplingParams
from turnkv.prompt_cache.store import PromptCache

# the native 8-turn chats run in `make test` (~1 min for both models on an idle 2-core machine);
# the packed-weights variant is `slow` (make test-all)
pytestmark = [pytest.mark.real]

SYSTEM = (
    "You are a meticulous travel assistant for a small agency that plans walking holidays. "
    "Always answer in short paragraphs, name concrete places, and keep a friendly tone. "
) + " ".join(
    f"Rule {i}: when the traveller mentions day {i}, suggest one museum, one park and one local dish, "
    f"and remind them to carry water and a paper map in case the phone battery runs out."
    for i in range(1, 13)
)
USERS = [
    "I am planning four days in Lisbon in April. Where should I stay if I want to walk everywhere?",
    "Thanks. What should I do on day 1 if I arrive around noon and feel tired from the flight?",
    "For day 2 I would like to see the old town. Can you suggest a route that avoids steep hills?",
    "On day 3 I want a trip outside the city. Is Sintra worth it, and how do I get there by train?",
    "What local dishes should I try, and are there vegetarian options in traditional restaurants?",
    "My partner likes modern art. Which museum would you pick, and how long should we spend there?",
    "Day 4 is my last day and my flight leaves at 8 pm. How can I spend the morning near the river?",
    "Finally, can you summarise the whole plan in a short list so I can print it?",
]
MAX_TOKENS = 24


def load(name: str, weights: str = "native"):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class
    from turnkv.models.weights import load_model

    ckpt = load_checkpoint(name, progress=False)
    model = load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, torch.float32, weights)
    return model, ckpt


def engines(model, ckpt):
    common = dict(fingerprint=ckpt.fingerprint, name=ckpt.name, max_context=4096)
    return (Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(1 << 30), **common),
            Engine(model, ckpt.tokenizer, prompt_cache=PromptCache(0), **common))


def play(engine, messages=None):
    messages = list(messages or [{"role": "system", "content": SYSTEM}])
    results = []
    for user in USERS:
        messages.append({"role": "user", "content": user})
        res = engine.generate(engine.chat_request(messages, SamplingParams(max_tokens=MAX_TOKENS)))
        results.append(res)
        messages.append({"role": "assistant", "content": res.text})
    return results, messages


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request):
    model, ckpt = load(request.param)
    return request.param, model, ckpt


def test_eight_turn_chat_cache_on_equals_off(real):
    name, model, ckpt = real
    on, off = engines(model, ckpt)
    r_on, msgs = play(on)
    r_off, _ = play(off)
    total = r_on[-1].usage.prompt_tokens
    if name == "gemma3-270m":
        assert total > 512 + 256, total        # the rings wrapped well past window + slack
    for turn, (a, b) in enumerate(zip(r_on, r_off), start=1):
        assert a.token_ids == b.token_ids, f"turn {turn}: {a.text!r} != {b.text!r}"
        assert torch.allclose(a.first_logits, b.first_logits, atol=2e-3), (a.first_logits - b.first_logits).abs().max()
        if turn > 1:
            assert a.usage.cached_tokens >= 0.9 * a.usage.prompt_tokens, (turn, a.usage)
    stats = on.prompt_cache.stats()
    assert stats["hits"] >= 7

    # Edit of an earlier user message: restores from a boundary before the edit, same output as cold.
    edited = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]},
              {"role": "assistant", "content": r_on[0].text},
              {"role": "user", "content": "Actually, make it five days in Porto instead."}]
    a = on.generate(on.chat_request(edited, SamplingParams(max_tokens=MAX_TOKENS)))
    b = off.generate(off.chat_request(edited, SamplingParams(max_tokens=MAX_TOKENS)))
    assert a.token_ids == b.token_ids
    assert a.usage.cached_tokens > 0

    # Regenerate the last turn: same prompt again, same answer, (almost) nothing prefilled.
    last = msgs[:-1]
    a = on.generate(on.chat_request(last, SamplingParams(max_tokens=MAX_TOKENS)))
    assert a.token_ids == r_on[-1].token_ids
    assert a.usage.prompt_tokens - a.usage.cached_tokens <= 1


# Packed weights (bfloat16 matmuls): a reused run equals the cold run to bfloat16 precision, not
# float32 (docs/weights.md). Greedy tokens must match except where the cold run itself is a
# near-tie at that precision and the reused run took the runner-up.
PACKED_NEAR_TIE = 0.5    # logits; SmolLM2/Gemma logits reach ~30, where a bfloat16 step is 0.125


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def packed(request):
    model, ckpt = load(request.param, "auto")
    return request.param, model, ckpt


@pytest.mark.slow
def test_eight_turn_chat_in_packed_weights(packed):
    from turnkv.engine.engine import GenerationRequest

    name, model, ckpt = packed
    on, off = engines(model, ckpt)
    messages = [{"role": "system", "content": SYSTEM}]
    diverged = 0
    for turn, user in enumerate(USERS, start=1):
        messages.append({"role": "user", "content": user})
        req = on.chat_request(messages, SamplingParams(max_tokens=MAX_TOKENS))
        a, b = on.generate(req), off.generate(req)
        # the head of the distribution (rescored in float32 in both runs; the tail keeps the int4
        # head's values, and a token near the 256th may be rescored in one run only)
        top = b.first_logits.topk(64).indices
        scale = b.first_logits.abs().max().item()
        assert (a.first_logits[top] - b.first_logits[top]).abs().max().item() < 0.03 * scale, turn
        if turn > 1:
            assert a.usage.cached_tokens >= 0.9 * a.usage.prompt_tokens, (turn, a.usage)
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is not None:   # the cold run's logits where they part: a near-tie, a took the runner-up
            diverged += 1
            probe = off.generate(GenerationRequest(req.prompt_ids + b.token_ids[:k], SamplingParams(max_tokens=1)))
            top2 = probe.first_logits.topk(2)
            gap = (top2.values[0] - top2.values[1]).item()
            assert gap < PACKED_NEAR_TIE, (turn, k, gap, a.text, b.text)
            assert a.token_ids[k] in top2.indices.tolist(), (turn, k)
        messages.append({"role": "assistant", "content": b.text})   # both continue the cold history
    assert diverged <= 2, diverged


def test_int4_head_nominates_the_true_argmax(real):
    """The int4 formats' lm_head is single-pass int4 and only nominates RESCORE_TOP candidates for
    the float32 rescoring: over ~700 positions of a real chat, the float32 argmax must rank well
    inside them (a margin of 4x), and the rescored head's pick must be the float32 pick."""
    from turnkv.cache.specs import make_caches
    from turnkv.models.base import linear
    from turnkv.models.packed import INT4_HEAD_GROUP, RESCORE_TOP, Int4Weight, PackedWeight, RescoredHead

    name, model, ckpt = real
    table = model.lm_head.detach()
    seen = []

    class Probe(PackedWeight):      # records the head's inputs, multiplies by the float32 table
        def matmul(self, x):
            seen.append(x.detach().clone())
            return x @ table.t()

    engine = engines(model, ckpt)[1]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(USERS)}]
    ids = torch.tensor(engine.chat_request(messages, SamplingParams(max_tokens=1)).prompt_ids)
    saved = model._parameters.pop("lm_head")
    model.lm_head = Probe()
    try:
        with torch.inference_mode():
            model.step(ids, make_caches(model.cache_specs()), logits="all")
    finally:
        del model._modules["lm_head"]
        model.lm_head = saved
    x = torch.cat(seen)
    assert x.shape[0] == len(ids) >= 600
    exact = x @ table.t()
    best = exact.argmax(-1)
    head = RescoredHead(Int4Weight(table, dense=False, group=INT4_HEAD_GROUP), table)
    ranks, picks = [], []
    for i in range(0, len(x), 8):
        rows = x[i:i + 8]
        approx = head.inner.matmul(rows).float()
        ranks.append((approx > approx.gather(1, best[i:i + 8, None])).sum(1))
        picks.append(linear(rows, head).argmax(-1))
    worst = int(torch.cat(ranks).max())
    assert worst < RESCORE_TOP // 4, (name, worst)
    assert torch.equal(torch.cat(picks), best)
