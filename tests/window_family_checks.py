"""Checks shared by the attention-only families with sliding-window layers (exaone4, ministral,
gpt_oss): parity with transformers on a ~300-token prompt, and the sliding window's truncation rule
one token inside and one token outside its boundary against a cold prefill."""

from __future__ import annotations

import pytest
import torch

from ssm_family_checks import PARITY_TOL, REUSE_TOL, hf_logits, run_chunks
from turnkv.cache.base import DIVERGED_UNTRIMMABLE, SnapshotMismatch, check_all_restorable
from turnkv.cache.kv import DEFAULT_BLOCK
from turnkv.cache.specs import SLIDING, make_caches

SLACK = 8    # the sliding layers' slack in these tests (the engine default is 256)


def caches_for(model, slack: int = SLACK):
    return make_caches(model.cache_specs(), slack=slack)


def check_long_prompt(model, hf_model, tokens: torch.Tensor) -> float:
    """Last-position logits of one prefill of the whole prompt vs transformers (float32)."""
    ref = hf_logits(hf_model, tokens)[-1]
    with torch.no_grad():
        last = model.step(tokens, caches_for(model), logits="last")
    diff = (last - ref).abs().max().item()
    assert diff < PARITY_TOL, f"last-position logits differ from transformers by {diff:.3g}"
    return diff


def boundary(window: int, length: int, slack: int = SLACK) -> int:
    """The smallest ``t`` a sliding snapshot of ``length`` tokens restores to, once wrapped: its
    first block starts at the 64-position boundary at or before ``length - (window - 1 + slack)``,
    and a query at ``t`` needs ``t - window + 1`` onwards."""
    start = (max(0, length - (window - 1 + slack)) // DEFAULT_BLOCK) * DEFAULT_BLOCK
    return start + window - 1


def check_window_boundary(model, tokens: torch.Tensor, length: int, window: int, cont: int = 6) -> int:
    """Snapshot every layer after ``length`` tokens (cut in pieces), then restore truncated to the
    boundary ``t0`` (the first length every sliding layer can serve) and to ``t0 + 1``: both equal a
    cold prefill of ``t`` tokens continued the same way. ``t0 - 1`` is refused as
    diverged_untrimmable by every sliding layer and by the model-level check (the full layers
    alone would allow it). Returns ``t0``."""
    t0 = boundary(window, length)
    assert t0 > window, "pick a length whose sliding snapshots have dropped their first blocks"
    caches = caches_for(model)
    run_chunks(model, caches, tokens[:length], 23)
    snaps = [c.snapshot() for c in caches]
    sliding = [i for i, s in enumerate(model.cache_specs()) if s.kind == SLIDING]
    assert sliding, "family has no sliding layer"
    for t in (t0, t0 + 1):
        warm_caches = caches_for(model)
        check_all_restorable(warm_caches, snaps, t)
        for c, s in zip(warm_caches, snaps):
            c.restore(s, t)
        warm = run_chunks(model, warm_caches, tokens[t:t + cont], cont)
        cold_caches = caches_for(model)
        run_chunks(model, cold_caches, tokens[:t], 23)
        cold = run_chunks(model, cold_caches, tokens[t:t + cont], cont)
        diff = (warm - cold).abs().max().item()
        assert diff <= REUSE_TOL, f"restore to {t}: differs from the cold run by {diff:.3g}"
    bad = t0 - 1
    assert all(not snaps[i].can_restore_to(bad) for i in sliding)
    assert all(snaps[i].can_restore_to(bad) for i in range(len(snaps)) if i not in sliding)
    probe = caches_for(model)
    with pytest.raises(SnapshotMismatch) as err:
        check_all_restorable(probe, snaps, bad)
    assert err.value.reason == DIVERGED_UNTRIMMABLE
    assert all(c.offset == 0 for c in probe)
    return t0


KV_MODES = ["bf16", "fp16", "int8", "int4"]
KV_MODE_ATOL = 1e-3


def check_kv_mode_reuse(model, mode: str, turns: int = 6, atol: float = KV_MODE_ATOL) -> None:
    """A chat longer than the window with the KV stored in ``mode``: the cache on gives the same
    greedy tokens and first-token logits as the cache off (same mode), with most of every later
    prompt restored."""
    import random

    from tiny import engine, request

    rng = random.Random(3)
    on, off = engine(model, kv_mode=mode), engine(model, budget=0, kv_mode=mode)
    history = [[rng.randrange(3, 256) for _ in range(40)]]
    for turn in range(turns):
        history.append([rng.randrange(3, 256) for _ in range(10)])
        a, b = on.generate(request(history, 4)), off.generate(request(history, 4))
        assert a.token_ids == b.token_ids
        # A stored mode rounds K/V, and the ~1e-6 float32 difference between the cached run's
        # short prefill and the cold run's long one (PyTorch's GEMM blocking depends on the row
        # count) can flip one element's bf16 / fp16 / int rounding: measured up to 1.6e-4 on
        # logits of magnitude ~2 (EXAONE 4, bf16), against ~1e-6 with native KV. A wrong restore
        # moves them by O(1).
        diff = (a.first_logits - b.first_logits).abs().max().item()
        assert diff <= atol, f"{mode}: first-token logits differ by {diff:.3g}"
        if turn:
            assert a.usage.cached_tokens >= 0.7 * a.usage.prompt_tokens, (turn, a.usage, a.stats)
        history.append(a.token_ids[:-1])
    assert on.prompt_cache.stats()["hits"] >= turns - 1


WEIGHT_SPECS = ["bfloat16:native", "float32:bf16", "float32:int8"]
WEIGHT_TOLERANCE = {"native": 0.03, "bf16": 0.03, "int8": 0.08}   # as tests/test_weight_formats.py


def check_weight_format(model, hf_model, spec: str, tolerance: dict | None = None) -> float:
    """``--dtype`` / ``--weights`` other than float32 native: the family packs its declared
    projections (experts included) and runs bfloat16 compute (the attention's non-kernel path);
    prefill, chunked prefill and decode stay within the format's tolerance of float32 native.
    Returns the worst relative difference."""
    from turnkv.models.weights import load_model

    dtype_name, weights = spec.split(":")
    dtype = getattr(torch, dtype_name)
    tensors = hf_model.state_dict()
    ref_model = load_model(type(model), hf_model.config.to_dict(), tensors, torch.float32, "native")
    packed = load_model(type(model), hf_model.config.to_dict(), tensors, dtype, weights)
    if weights != "native":   # every declared projection was packed
        from turnkv.models.weights import PackedWeight
        names = set(type(model).packable_weights)
        held = [getattr(m, n) for m in packed.modules() for n in names if hasattr(m, n)]
        assert held and all(isinstance(w, PackedWeight) for w in held)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))

    def run(m, chunk):
        caches = make_caches(m.cache_specs(), dtype if m is packed else torch.float32, slack=SLACK)
        with torch.inference_mode():
            return torch.cat([m.step(ids[a:a + chunk], caches, "all").float() for a in range(0, 40, chunk)])

    ref = run(ref_model, 40)
    scale = ref.abs().max().item()
    worst = 0.0
    for chunk in (40, 7, 1):
        got = run(packed, chunk)
        worst = max(worst, (got - ref).abs().max().item() / scale)
    limit = {**WEIGHT_TOLERANCE, **(tolerance or {})}[weights]
    assert worst < limit, f"{spec}: {worst:.3g} of the logits' scale"
    return worst
