"""Qwen 3 and Qwen 2 (turnkv.models.llama) against transformers' Qwen3ForCausalLM and
Qwen2ForCausalLM on tiny random configs: Qwen 3's per-head q/k RMS norms before RoPE and its
head_dim apart from hidden / heads, Qwen 2's q/k/v biases without an o bias. (The 8-turn chat with
reuse == cold: tests/test_family_reuse.py; batched == alone: tests/test_batching.py; GGUF ==
folder: tests/test_gguf_families.py.)
The contract every family keeps (parity, greedy, KV modes, weight formats):
tests/test_family_contract.py; here, what is these families' own."""

import pytest
import torch
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.models.llama import ModelArgs

VOCAB = 256


def qwen3_config(**overrides) -> Qwen3Config:
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return Qwen3Config(**{**kw, **overrides})


def qwen2_config(**overrides) -> Qwen2Config:
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return Qwen2Config(**{**kw, **overrides})


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return Qwen3MoeConfig(**{**kw, **overrides})


def routed(hf):
    """transformers zero-initialises the routers, which would send every token to experts 0..k-1."""
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.3)
    return hf


def _pair(hf, tmp_path):
    hf = hf.eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    return _pair(Qwen3ForCausalLM(qwen3_config(**overrides)), tmp_path)


def tiny_qwen2(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    return _pair(Qwen2ForCausalLM(qwen2_config(**overrides)), tmp_path)


def tiny_moe(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    return _pair(routed(Qwen3MoeForCausalLM(qwen3_moe_config(**overrides))), tmp_path)


def all_routed(tmp_path):
    """The weight formats' model (tests/test_family_contract.py): every token through all 8
    experts, so the routing weights are continuous in the hidden state. With top-2 of 8 a bfloat16
    rounding flips which experts some tokens take on this tiny random model (0.13 of the logits'
    scale), which says nothing about the format."""
    return tiny_moe(tmp_path, seed=2, num_experts_per_tok=8)


@pytest.mark.parametrize("overrides", [dict(norm_topk_prob=False, mlp_only_layers=[1]),
                                       dict(decoder_sparse_step=2, tie_word_embeddings=True)])
def test_qwen3_moe_routing_options_and_dense_layers(tmp_path, overrides):
    from turnkv.models.qwen3_moe import MoE

    model, hf = tiny_moe(tmp_path, seed=2, **overrides)
    kinds = [isinstance(layer.mlp, MoE) for layer in model.layers]
    assert kinds == [isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module) for layer in hf.model.layers]
    assert not all(kinds) and any(kinds)
    check_parity(model, hf, prompt(60, seed=4), chunk=11, decode=6)


def test_qwen3_normalizes_q_and_k_per_head(tmp_path):
    model, hf = tiny(tmp_path)
    attn = model.layers[0].attn
    assert attn.qk_norm is not None and attn.qk_norm.shape == (4 + 2, 1, 32)
    assert attn.bqkv is None and attn.bo is None
    # head_dim 32 with hidden 64 and 4 heads: the q projection is wider than the residual
    assert attn.wqkv.shape[0] == (4 + 2 * 2) * 32


def test_qwen2_biases_on_qkv_only(tmp_path):
    model, hf = tiny_qwen2(tmp_path)
    attn = model.layers[0].attn
    assert attn.bqkv is not None and attn.bo is None and attn.qk_norm is None
    assert model.lm_head is model.embed


@pytest.mark.parametrize("bias", [True, False])
def test_qwen3_attention_bias_and_llama3_rope(tmp_path, bias):
    rope = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model, hf = tiny(tmp_path, seed=1, attention_bias=bias, rope_parameters=rope, tie_word_embeddings=True)
    assert (model.layers[0].attn.bo is not None) == bias
    check_parity(model, hf, prompt(120, seed=9), chunk=13, decode=6)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sliding_window_on_the_layers_from_max_window_layers(tmp_path, model_type):
    """use_sliding_window: the layers from max_window_layers on attend within the window (as
    transformers 5 resolves it; the released configs leave it off), over a prompt 5x the window."""
    make = tiny if model_type == "qwen3" else tiny_qwen2
    model, hf = make(tmp_path, seed=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert [s.kind for s in model.cache_specs()] == ["full", "sliding", "sliding"]
    check_parity(model, hf, prompt(80, seed=4), chunk=13, decode=6)
    off = ModelArgs.from_dict(qwen3_config(sliding_window=16, max_window_layers=1).to_dict())
    assert off.layer_types is None and off.sliding_window is None     # the window needs the switch
