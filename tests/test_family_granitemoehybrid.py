"""Granite 4 hybrid (Mamba 2 + attention, MoE + shared MLP, Granite multipliers) against
transformers' GraniteMoeHybridForCausalLM on tiny random configs.
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from ssm_family_checks import check_parity, fresh, perturb_vectors, save_and_load
from tiny import prompt
from turnkv.cache.specs import FULL, RECURRENT
from turnkv.loading import load_checkpoint
from turnkv.models.granitemoehybrid import GraniteMoeHybridModel

VOCAB = 256
SSD_CHUNK = 16  # the 70-token prompts span several SSD chunks, the last one partial


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              layer_types=["mamba", "attention", "mamba", "attention"],  # the hub's spelling
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=SSD_CHUNK,
              mamba_proj_bias=True, num_local_experts=4, num_experts_per_tok=2,
              embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0,
              position_embedding_type="rope", initializer_range=0.2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    hf = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**kw)).eval()
    perturb_vectors(hf)
    return save_and_load(hf, tmp_path), hf


def test_cache_specs(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [RECURRENT, FULL, RECURRENT, FULL]
    conv_dim = 2 * 64 + 2 * 2 * 16
    assert dict(specs[0].fields) == {"conv": (3, conv_dim), "ssm": (8, 16, 16)}


def test_loads_the_hub_tensor_names(pair, tmp_path):
    # save_pretrained writes the original MoE names (input_linear / output_linear / router.layer)
    _, hf = pair
    hf.save_pretrained(tmp_path)
    names = load_checkpoint(tmp_path, progress=False).tensors
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in names
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in names
    # ... and transformers' in-memory names load to the same model
    sd_model = GraniteMoeHybridModel.from_checkpoint(hf.config.to_dict(), hf.state_dict(), torch.float32)
    tokens = prompt(20)
    with torch.no_grad():
        ours = pair[0].step(tokens, fresh(pair[0]), logits="all")
        assert torch.equal(sd_model.step(tokens, fresh(sd_model), logits="all"), ours)


def test_parity_pieces_straddling_ssd_chunks(pair):
    model, hf = pair
    check_parity(model, hf, prompt(60, seed=5), chunk=SSD_CHUNK + 3, decode=3)


def test_parity_variant_nope_dense_single_group(tmp_path):
    # no RoPE (Granite 4 "nope"), no routed experts (shared MLP only), one SSM group, no biases
    model, hf = tiny(tmp_path, seed=1, position_embedding_type="nope", num_local_experts=0, mamba_n_groups=1,
                     mamba_proj_bias=False, mamba_conv_bias=False, layer_types=["attention", "mamba", "mamba"],
                     num_hidden_layers=3)
    assert model.rope is None
    check_parity(model, hf, prompt(45, seed=9), chunk=11, decode=5)


