"""Bailing hybrid (Ling 3) against transformers' BailingHybridForCausalLM on a tiny random config:
Kimi Delta Attention with the bounded forget gate on the linear layers, MLA with interleaved RoPE and
a per-head output gate on every second layer (latent KV cache), a dense first layer and DeepSeek-V3's
sigmoid-routed MoE after it; the recurrent state's restore rule one token inside and outside.
(The 8-turn chat with reuse == cold, edits, regenerate and three conversations at once:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import BailingHybridConfig, BailingHybridForCausalLM

from ssm_family_checks import (PARITY_TOL, check_parity, check_restore_at_its_length, fresh, nudge_score_biases,
                               perturb_vectors, saved_pair)
from tiny import prompt
from turnkv.cache.specs import FULL, RECURRENT, make_caches
from turnkv.models.bailing_hybrid import BailingHybridModel, deinterleave

VOCAB = 256


def config(**overrides):
    # layer_group_size 2: KDA, MLA, KDA, MLA; kda_lower_bound -1 keeps the state alive over a long prompt
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              n_group=1, topk_group=1, head_dim=16, short_conv_kernel_size=4, layer_group_size=2,
              first_k_dense_replace=1, kda_lower_bound=-1.0, rope_theta=10000.0, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return BailingHybridConfig(**kw)


def build(**overrides):
    """The tiny Bailing hybrid with every vector nudged and the routers' score-correction biases set
    (shared with tests/test_family_reuse.py and tests/test_batching.py)."""
    hf = BailingHybridForCausalLM(config(**overrides)).eval()
    perturb_vectors(hf)
    nudge_score_biases(hf)
    return hf


def tiny(tmp_path, seed=0, **overrides):
    return saved_pair(tmp_path, seed, lambda: build(**overrides))


def test_cache_specs(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [RECURRENT, FULL, RECURRENT, FULL]
    # conv over q|k|v (3 * 4 heads * 16), recurrent [heads, k dim, v dim]
    assert dict(specs[0].fields) == {"conv": (3, 192), "recurrent": (4, 16, 16)}
    # MLA: the latent [kv_lora_rank 24 | rope 8] as one head, split in halves as K and V
    assert (specs[1].heads, specs[1].head_dim) == (1, 16)
    # the KDA state is held in float32 under a bfloat16 cache, as transformers holds it
    caches = make_caches(specs, torch.bfloat16)
    assert caches[0].state["recurrent"].dtype == torch.float32 and caches[1].dtype == torch.bfloat16


def test_deinterleave_reorders_only_the_rope_rows():
    w = torch.arange(2 * 6, dtype=torch.float32)[:, None]        # two groups of 6 rows, rope 4
    assert deinterleave(w, 6, 4)[:, 0].tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_restore_boundary_one_token_inside_and_outside(pair):
    """The KDA state's rule is ``t == length``: a snapshot after 50 tokens restores to 50 (== a cold
    prefill of 50, continued), and 49 or 51 are refused as diverged_untrimmable / out of range;
    the MLA latent cache alone could go back to 49."""
    check_restore_at_its_length(pair[0], prompt(60, seed=13), 50)


def test_variant_default_gate_q_lora_grouped_router_bias(tmp_path):
    # the released default forget-gate bound (-5), the q LoRA path, grouped top-k routing (2 groups,
    # 1 kept), biases on the MLA projections, an odd latent width (padded to split in halves), v head
    # wider than q/k, two dense layers
    model, hf = tiny(tmp_path, seed=1, kda_lower_bound=-5.0, q_lora_rank=20, num_local_experts=8, n_group=2,
                     topk_group=1, attention_bias=True, kv_lora_rank=23, v_head_dim=32, first_k_dense_replace=2)
    assert model.cache_specs()[1].head_dim == 16
    d = check_parity(model, hf, prompt(70, seed=9), chunk=11, decode=5)
    assert max(d.values()) < PARITY_TOL


def test_variant_unbounded_gate(tmp_path):
    # kda_safe_gate off: g = -exp(A_log) * softplus(f + dt_bias), as Kimi Linear
    model, hf = tiny(tmp_path, seed=2, kda_safe_gate=False)
    d = check_parity(model, hf, prompt(70, seed=4), chunk=9, decode=4)
    assert max(d.values()) < PARITY_TOL


def calm(tmp_path):
    return tiny(tmp_path, initializer_range=0.02)


def test_released_config_spelling_and_mtp_layer_load(pair, tmp_path):
    """The released config.json has the KDA head dim as ``head_dim`` (transformers' saved config
    rewrites it to qk_rope_head_dim and adds ``linear_head_dim``) and no ``linear_*`` keys, and the
    weights carry an MTP layer after the last decoder layer: the same model loads."""
    import json

    from turnkv.loading import load_checkpoint
    model, hf = pair
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        cfg.pop(key)
    cfg["head_dim"] = 16
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    tensors = dict(ckpt.tensors)
    n = cfg["num_hidden_layers"]
    tensors[f"model.layers.{n}.attention.q_proj.weight"] = torch.zeros(3, 3)   # an MTP tensor, never read
    released = BailingHybridModel.from_checkpoint(cfg, tensors, torch.float32)
    tokens = prompt(40, seed=21)
    with torch.no_grad():
        a = released.step(tokens, fresh(released), logits="all")
        b = model.step(tokens, fresh(model), logits="all")
    assert torch.equal(a, b)
