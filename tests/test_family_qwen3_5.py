"""Qwen 3.5 text, dense (Qwen3_5ForCausalLM) and MoE (Qwen3_5MoeForCausalLM), against transformers on
tiny random configs: gated delta-net with separate in_proj_qkv / z / b / a, gated full attention with
partial (M-)RoPE, dense MLP or shared-expert MoE on every layer; and the text decoder of a
vision-language folder (Qwen3_5ForConditionalGeneration, the released layout). (8-turn chat reuse
== cold, edits, regenerate: tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

from functools import partial

import pytest
import torch
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from ssm_family_checks import fresh, perturb_vectors, save_and_load
from tiny import prompt as random_tokens
from turnkv.cache.specs import FULL, RECURRENT
from turnkv.models import family_class
from turnkv.models.qwen3_5 import Qwen3_5Model

VOCAB = 256
prompt = partial(random_tokens, low=0)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=1024,
              initializer_range=0.05)


def dense_config():
    return Qwen3_5TextConfig(intermediate_size=96, **COMMON)


def moe_config():
    return Qwen3_5MoeTextConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, **COMMON)


def _pair(cls, config, path):
    torch.manual_seed(0)
    hf = cls(config).eval()
    perturb_vectors(hf)
    return save_and_load(hf, path), hf


def tiny_dense(tmp_path):
    return _pair(Qwen3_5ForCausalLM, dense_config(), tmp_path)


def tiny_moe(tmp_path):
    return _pair(Qwen3_5MoeForCausalLM, moe_config(), tmp_path)


def all_routed(tmp_path):
    """The weight formats' model (tests/test_family_contract.py): every expert routed. On the 2-of-6
    MoE a bfloat16 rounding flips routing choices (transformers' own bfloat16 run of it is 0.21 of
    the logits' scale off its float32 one), which says nothing about the formats. Holds every
    declared weight: the delta-net's input and output projections, the attention's, the MLP class's
    (as the shared expert), the head; the routed experts, router and shared-expert gate stay native."""
    return _pair(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(
        num_experts=6, num_experts_per_tok=6, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        **COMMON), tmp_path)


@pytest.fixture(scope="module")
def dense(tiny_pair):
    return tiny_pair(tiny_dense)


@pytest.fixture(scope="module")
def moe(tiny_pair):
    return tiny_pair(tiny_moe)


def test_vision_language_folders_register_a_subclass():
    for model_type in ("qwen3_5", "qwen3_5_moe"):    # vision-language folders (tests/test_family_qwen3_5_vl.py)
        assert issubclass(family_class(model_type), Qwen3_5Model)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_cache_specs(request, variant):
    model, _ = request.getfixturevalue(variant)
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [RECURRENT, RECURRENT, RECURRENT, FULL]
    # conv over q|k|v (2 * 2 * 16 + 4 * 8 channels), recurrent state [value heads, k dim, v dim]
    assert dict(specs[0].fields) == {"conv": (3, 96), "recurrent": (4, 16, 8)}
    assert (specs[3].heads, specs[3].head_dim) == (2, 16)


def test_feed_forward_kind(dense, moe):
    from turnkv.models.decoder import GatedMLP as MLP
    from turnkv.models.qwen3_next import SparseMoE
    assert all(isinstance(layer.mlp, MLP) for layer in dense[0].layers)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in moe[0].layers)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_text_decoder_of_a_vision_language_folder(tmp_path, variant):
    """The released layout: Qwen3_5(Moe)ForConditionalGeneration's folder (text_config, decoder
    under model.language_model., a vision tower) serves text exactly like the ForCausalLM."""
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    if variant == "dense":
        hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dense_config().to_dict(),
                                                           vision_config=vision))
    else:
        hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=moe_config().to_dict(),
                                                                 vision_config=vision))
    hf = hf.eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path)
    assert isinstance(model, Qwen3_5Model)
    assert any(n.startswith("model.visual.") for n in hf.state_dict())   # a real VLM folder
    from turnkv.models.qwen3_next import SparseMoE
    assert isinstance(model.layers[0].mlp, SparseMoE) == (variant == "moe")
    p = prompt(80, seed=5)
    with torch.no_grad():
        ref = hf(input_ids=p[None], use_cache=False).logits[0, -1].float()
        ours = model.step(p, fresh(model), logits="last")
    assert (ours - ref).abs().max().item() < 1e-4


