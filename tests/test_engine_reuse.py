"""Reuse exactness through the engine on tiny random models: every cached run must equal the
cold run of the same tokens (same greedy tokens, first-token logits within float tolerance)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny import VOCAB, engine, request, tiny_gemma3, tiny_llama

ATOL = 1e-4


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_llama()[0], "gemma3": tiny_gemma3()[0]}


def same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.allclose(a.first_logits, b.first_logits, atol=ATOL), (a.first_logits - b.first_logits).abs().max()


def rand_msg(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def conversation(rng, turns: int, sys_len: int = 40, user_len: int = 12):
    return [rand_msg(rng, sys_len)] + [rand_msg(rng, user_len) for _ in range(turns)]


def run_chat(eng, system, users, max_tokens=6):
    """Plays a chat: each turn re-sends the history plus the reply and a new user message."""
    history, results = [system], []
    for user in users:
        history.append(user)
        res = eng.generate(request(history, max_tokens))
        results.append(res)
        history.append(res.token_ids[:-1] if len(res.token_ids) > 1 else res.token_ids)
    return results


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eight_turns_cache_on_equals_off(models, family):
    rng = random.Random(1)
    conv = conversation(rng, 8)
    on, off = engine(models[family]), engine(models[family], budget=0)
    r_on, r_off = run_chat(on, conv[0], conv[1:]), run_chat(off, conv[0], conv[1:])
    for i, (a, b) in enumerate(zip(r_on, r_off)):
        same(a, b)
        if i > 0:
            assert a.usage.cached_tokens >= 0.8 * a.usage.prompt_tokens, (i, a.usage)
        assert b.usage.cached_tokens == 0
    stats = on.prompt_cache.stats()
    assert stats["hits"] >= 7 and stats["tokens_reused"] > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_one_and_two_generated_tokens(models, family, max_tokens):
    rng = random.Random(2 + max_tokens)
    conv = conversation(rng, 4, sys_len=30)
    on, off = engine(models[family]), engine(models[family], budget=0)
    for a, b in zip(run_chat(on, conv[0], conv[1:], max_tokens), run_chat(off, conv[0], conv[1:], max_tokens)):
        same(a, b)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_regenerate_same_prompt(models, family):
    rng = random.Random(5)
    conv = conversation(rng, 2)
    on, off = engine(models[family]), engine(models[family], budget=0)
    req = request(conv, 5)
    first, again, cold = on.generate(req), on.generate(req), off.generate(req)
    same(first, cold)
    same(again, cold)
    assert again.usage.cached_tokens >= len(req.prompt_ids) - 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stop_on_eos_then_continue(models, family):
    rng = random.Random(6)
    conv = conversation(rng, 3)
    probe = engine(models[family], budget=0).generate(request(conv[:2], 8))
    eos = probe.token_ids[3]                        # make the 4th generated token the end-of-sequence id
    on, off = engine(models[family]), engine(models[family], budget=0)
    a, b = on.generate(request(conv[:2], 8, [eos])), off.generate(request(conv[:2], 8, [eos]))
    same(a, b)
    assert a.finish_reason == "stop" and a.token_ids[-1] == eos
    follow = conv[:2] + [a.token_ids[:-1], conv[2]]
    same(on.generate(request(follow, 5)), off.generate(request(follow, 5)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_edit_earlier_user_message(models, family):
    rng = random.Random(7)
    conv = conversation(rng, 5)
    on, off = engine(models[family]), engine(models[family], budget=0)
    run_chat(on, conv[0], conv[1:4])
    edited = [conv[0], rand_msg(rng, 12)]           # user message 1 edited
    same(on.generate(request(edited, 5)), off.generate(request(edited, 5)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_edit_last_assistant_reply(models, family):
    rng = random.Random(8)
    conv = conversation(rng, 3)
    on, off = engine(models[family]), engine(models[family], budget=0)
    res = run_chat(on, conv[0], conv[1:3], max_tokens=6)
    reply = res[-1].token_ids[:-1]
    edited_reply = reply[:2] + rand_msg(rng, 4)      # the user rewrote the end of the last reply
    hist = [conv[0], conv[1], res[0].token_ids[:-1], conv[2], edited_reply, rand_msg(rng, 10)]
    same(on.generate(request(hist, 5)), off.generate(request(hist, 5)))


def test_sliding_divergence_inside_and_beyond_slack(models):
    """Gemma 3 tiny: window 16, slack 8. A divergence within the slack truncates the stored
    snapshot; one beyond it must fall back to an earlier checkpoint, never restore wrongly."""
    model = models["gemma3"]
    rng = random.Random(9)
    sys_msg, user = rand_msg(rng, 40), rand_msg(rng, 40)
    for back in (3, 8, 9, 20, 39):
        on, off = engine(model, slack=8), engine(model, budget=0, slack=8)
        on.generate(request([sys_msg, user], 4))
        diverged = user[:len(user) - back] + rand_msg(rng, back)
        a, b = on.generate(request([sys_msg, diverged], 4)), off.generate(request([sys_msg, diverged], 4))
        same(a, b)
        assert a.usage.cached_tokens >= len(sys_msg)       # at worst the system-prompt checkpoint


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompt_is_strict_prefix_of_stored(models, family):
    rng = random.Random(10)
    conv = conversation(rng, 3)
    on, off = engine(models[family]), engine(models[family], budget=0)
    run_chat(on, conv[0], conv[1:])
    same(on.generate(request(conv[:2], 4)), off.generate(request(conv[:2], 4)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_budget_eviction_mid_conversation(models, family):
    rng = random.Random(11)
    conv = conversation(rng, 6)
    tiny_budget = 60_000                       # a few entries at most: evictions happen
    on, off = engine(models[family], budget=tiny_budget), engine(models[family], budget=0)
    for a, b in zip(run_chat(on, conv[0], conv[1:]), run_chat(off, conv[0], conv[1:])):
        same(a, b)
    st_ = on.prompt_cache.stats()
    assert st_["bytes"] <= tiny_budget
    assert st_["evictions"] > 0 or st_["refusals"].get("over_budget", 0) > 0


def test_tenants_never_share(models):
    rng = random.Random(12)
    conv = conversation(rng, 1)
    on = engine(models["llama"])
    on.generate(request(conv, 3, tenant="a"))
    assert on.generate(request(conv, 3, tenant="b")).usage.cached_tokens == 0
    assert on.generate(request(conv, 3, tenant="a")).usage.cached_tokens > 0


ACTIONS = st.sampled_from(["next", "regenerate", "edit_user", "edit_reply", "truncate"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), actions=st.lists(ACTIONS, min_size=3, max_size=7),
       budget=st.sampled_from([0, 40_000, 200_000, 1 << 30]), slack=st.sampled_from([0, 4, 8]),
       chunk=st.sampled_from([5, 16, 64]))
def test_random_conversations_never_change_output(models, seed, actions, budget, slack, chunk):
    rng = random.Random(seed)
    model = models["gemma3"]
    on = engine(model, budget=budget, slack=slack, chunk=chunk)
    off = engine(model, budget=0, slack=slack, chunk=chunk)
    history = [rand_msg(rng, rng.randrange(5, 30))]
    for action in actions:
        if action == "next" or len(history) < 3:
            history = history + [rand_msg(rng, rng.randrange(1, 20))]
        elif action == "edit_user":
            i = rng.randrange(1, len(history), 2) if len(history) > 1 else 0
            history = history[:i] + [rand_msg(rng, rng.randrange(1, 20))]
        elif action == "edit_reply" and len(history) >= 3:
            history = history[:-2] + [history[-2][: rng.randrange(0, len(history[-2]) + 1)] + rand_msg(rng, 2),
                                      rand_msg(rng, 5)]
        elif action == "truncate":
            history = history[: max(2, len(history) - 2)]
        max_tokens = rng.randrange(1, 6)
        a, b = on.generate(request(history, max_tokens)), off.generate(request(history, max_tokens))
        same(a, b)
        if action != "regenerate":
            history = history + [a.token_ids[:-1] or a.token_ids]
        if history and sum(map(len, history)) > 300:
            break
