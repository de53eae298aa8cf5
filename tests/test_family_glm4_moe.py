"""GLM-4 MoE against transformers' Glm4MoeForCausalLM on tiny random configs: partial RoPE, QK-norm,
biased q/k/v, dense first layer, sigmoid router with score-correction bias and group-limited
selection, routed scaling, shared experts. (8-turn chat reuse == cold, edits, regenerate:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from ssm_family_checks import check_parity, fresh, perturb_vectors, run_chunks, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL
from turnkv.models.glm4_moe import Glm4MoeModel

VOCAB = 256


def config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
              routed_scaling_factor=2.5, max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def build_hf(seed=0, **overrides):
    torch.manual_seed(seed)
    hf = Glm4MoeForCausalLM(config(**overrides)).eval()
    perturb_vectors(hf, scale=0.2)
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():   # a buffer, not a parameter: perturb_vectors leaves it at 0
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    return hf


def tiny(tmp_path, seed=0, **overrides):
    hf = build_hf(seed, **overrides)
    return save_and_load(hf, tmp_path), hf


def test_cache_specs_and_rope(pair):
    model, hf = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [FULL] * 3 and (specs[0].heads, specs[0].head_dim) == (2, 16)
    # partial RoPE: half of each 16-dim head rotates, the same frequencies as transformers
    assert torch.equal(model.rope.inv_freq, hf.model.rotary_emb.inv_freq) and model.rope.inv_freq.numel() == 4


def test_router_matches_transformers_and_group_limit_bites(pair):
    model, hf = pair
    x = torch.randn(500, 64, generator=torch.Generator().manual_seed(9))
    ours_w, ours_e = model.layers[1].mlp.route(x)
    _, ref_w, ref_e = hf.model.layers[1].mlp.gate(x)
    order_o, order_r = ours_e.sort(dim=-1), ref_e.sort(dim=-1)
    assert torch.equal(order_o.values, order_r.values)
    assert torch.allclose(ours_w.gather(1, order_o.indices), ref_w.gather(1, order_r.indices), atol=1e-6)
    assert torch.allclose(ours_w.sum(-1), torch.full((500,), 2.5), atol=1e-5)   # renormalised, then scaled
    # the group limit changes the choice for some tokens (plain top-2 of the biased scores differs)
    gate = hf.model.layers[1].mlp.gate
    plain = (torch.sigmoid(x @ gate.weight.t()) + gate.e_score_correction_bias).topk(2, dim=-1)[1].sort(-1).values
    assert (plain != order_o.values).any(dim=-1).sum() > 10


def test_without_qk_norm_and_biases_one_group(tmp_path):
    hf = build_hf(seed=1, use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, norm_topk_prob=False, n_shared_experts=2, first_k_dense_replace=2)
    model = save_and_load(hf, tmp_path)
    assert model.layers[0].attn.q_norm is None and model.layers[0].attn.bqkv is None
    check_parity(model, hf, prompt(70, seed=2), chunk=9, decode=5)


def test_released_config_spelling_and_mtp_layer_ignored(pair):
    """GLM-4.5's config.json predates rope_parameters (flat rope_theta / partial_rotary_factor) and
    its weights hold one MTP layer after the decoder: both load, the MTP layer is not run."""
    model, hf = pair
    cfg = hf.config.to_dict()
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=0.5, num_nextn_predict_layers=1)
    tensors = dict(hf.state_dict())
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.2."):   # a copy standing in for the MTP layer's weights
            tensors[name.replace("model.layers.2.", "model.layers.3.")] = t
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    other = Glm4MoeModel.from_checkpoint(cfg, tensors, torch.float32)
    assert len(other.layers) == 3 and torch.equal(other.rope.inv_freq, model.rope.inv_freq)
    p = prompt(30, seed=4)
    with torch.no_grad():
        diff = (other.step(p, fresh(other)) - model.step(p, fresh(model))).abs().max().item()
    # the same weights, but the in-memory model's fused expert tensors (views at other storage
    # offsets) vs save_pretrained's per-expert ones: float32 GEMM rounding only (measured 3e-7)
    assert diff <= 1e-5, diff


def test_full_attention_snapshot_truncates_anywhere(pair):
    model, _ = pair
    tokens = prompt(120, seed=8)
    caches = fresh(model)
    run_chunks(model, caches, tokens[:100], 33)
    snaps = [c.snapshot() for c in caches]
    for t in (1, 64, 65, 99):
        assert all(s.can_restore_to(t) for s in snaps)
        warm = fresh(model)
        for c, s in zip(warm, snaps):
            c.restore(s, t)
        cold = fresh(model)
        run_chunks(model, cold, tokens[:t], 40)
        a, b = run_chunks(model, warm, tokens[t:t + 5], 5), run_chunks(model, cold, tokens[t:t + 5], 5)
        assert (a - b).abs().max().item() <= 1e-5


def dense_routed(tmp_path):
    # every token through all 8 experts: the routing weights are continuous in the hidden state.
    # With top-2 of 8 in 2 of 4 groups a weight format's rounding flips which experts some tokens
    # take on this tiny random model (measured 0.24 of the logits' scale for bfloat16), which says
    # nothing about the format.
    hf = build_hf(seed=2, num_experts_per_tok=8, n_group=1, topk_group=1)
    return save_and_load(hf, tmp_path), hf


