"""Llama 4 (text) against transformers' Llama4ForCausalLM on a tiny random config: chunked RoPE
layers + global NoPE layers with temperature tuning, MoE with a shared expert on alternate layers.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

from ssm_family_checks import PARITY_TOL, REUSE_TOL, check_parity, fresh, perturb_vectors, run_chunks, save_and_load
from tiny import prompt
from turnkv.cache.base import DIVERGED_UNTRIMMABLE, SnapshotMismatch, check_all_restorable
from turnkv.cache.specs import CHUNKED, FULL
from turnkv.models.llama4 import interleaved_to_half

VOCAB = 256
CHUNK = 16


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              attention_chunk_size=CHUNK, no_rope_layer_interval=2,
              floor_scale=8, attn_scale=0.5,  # small floor so the temperature changes within the prompt
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    hf = Llama4ForCausalLM(Llama4TextConfig(**kw)).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


def test_cache_specs_chunked_rope_layers_full_nope_layers(pair):
    model, hf = pair
    assert hf.config.no_rope_layers == [1, 0, 1, 0]  # 1 = uses RoPE
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [CHUNKED, FULL, CHUNKED, FULL]
    assert specs[0].chunk == CHUNK and (specs[0].heads, specs[0].head_dim) == (2, 16)


def test_interleaved_rope_permutation_is_a_per_head_reordering():
    w = torch.arange(2 * 8, dtype=torch.float32)[:, None]  # 2 heads of head_dim 8
    out = interleaved_to_half(w, 2, 8)[:, 0].tolist()
    assert out == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def test_parity_chunk_aligned_pieces(pair):
    model, hf = pair
    check_parity(model, hf, prompt(60, seed=5), chunk=CHUNK, decode=CHUNK + 2)


def test_parity_variant_top2_bias_no_qk_norm_no_temperature(tmp_path):
    model, hf = tiny(tmp_path, seed=1, num_experts_per_tok=2, attention_bias=True, use_qk_norm=False,
                     attn_temperature_tuning=False, interleave_moe_layer_step=1)
    check_parity(model, hf, prompt(50, seed=9), chunk=9, decode=6)


def _restored(model, snaps, length=None):
    caches = fresh(model)
    check_all_restorable(caches, snaps, snaps[0].length if length is None else length)
    for c, s in zip(caches, snaps):
        c.restore(s, length)
    return caches


def run_pieces(model, caches, tokens, bounds):
    """Prefill ``tokens`` cut at ``bounds`` (so two runs with the same cuts compute identical K/V)."""
    with torch.no_grad():
        for s, e in zip(bounds, bounds[1:]):
            if e > s:
                model.step(tokens[s:e], caches, logits="none")


def test_reuse_is_exact_including_truncation(pair):
    model, _ = pair
    tokens, L = prompt(120, seed=11), 100
    cuts = [0, 20, 40, 60, 64, 80, 96, 99, 100]
    caches = fresh(model)
    run_pieces(model, caches, tokens, cuts)
    snaps = [c.snapshot() for c in caches]
    run_chunks(model, caches, tokens[L:], 5)  # the live caches move on; the snapshots must not

    # The snapshot of a chunked layer holds positions from the block boundary at or before the
    # start of its last chunk ([96, 112) -> 64): it restores to any t whose chunk starts at >= 64.
    for t in (L, 99, 96, 80, 64):
        warm = run_chunks(model, _restored(model, snaps, t), tokens[t:], 120)
        cold_caches = fresh(model)
        run_pieces(model, cold_caches, tokens, [c for c in cuts if c <= t])
        cold = run_chunks(model, cold_caches, tokens[t:], 120)
        diff = (warm - cold).abs().max().item()
        assert diff <= REUSE_TOL, f"restore to {t}: differs from the cold run by {diff:.3g}"
        steps = run_chunks(model, _restored(model, snaps, t), tokens[t:t + 3], 1)
        assert (steps - cold[:3]).abs().max().item() < PARITY_TOL

    chunked = [i for i, s in enumerate(model.cache_specs()) if s.kind == CHUNKED]
    for t in (63, 40, 0):
        with pytest.raises(SnapshotMismatch) as e:
            _restored(model, snaps, t)
        assert e.value.reason == DIVERGED_UNTRIMMABLE
        assert all(not snaps[i].can_restore_to(t) for i in chunked)
        assert all(snaps[i].can_restore_to(t) for i in range(len(snaps)) if i not in chunked)
