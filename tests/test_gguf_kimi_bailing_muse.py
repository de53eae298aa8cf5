"""Kimi Linear, Bailing hybrid (llama.cpp's ``bailingmoe3``) and Muse Glimmer GGUF layouts, beyond
tests/test_gguf_families.py: the model built from the converter-made F32 file holds the same
weights, bit for bit, as the one built from the HF folder (KDA decay stored as -exp / exp(A_log),
conv kernels reshaped, ``attn_k_b`` / ``attn_v_b`` fused back, stacked experts split or fused,
Muse's ``1 + w`` norms and interleaved q/k undone), the config llama.cpp keeps comes back as the
folder's (layer kinds from the per-layer ``head_count_kv``, Muse's ``qk_scale_factor`` from its
synthesized QK-norm weights), and what turnkv cannot run is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from turnkv.loading import ModelLoadError, load_checkpoint
from turnkv.loading.gguf import read_header
from turnkv.loading.gguf.archs import bailing_hybrid as gguf_bailing
from turnkv.loading.gguf.archs import kimi_linear as gguf_kimi
from turnkv.loading.gguf.archs import muse_glimmer as gguf_muse
from turnkv.models import family_class

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
NAMES = ["kimi_linear", "bailing_hybrid", "muse_glimmer"]


def built(spec):
    ckpt = load_checkpoint(spec, dtype=torch.float32, progress=False)
    return ckpt, family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_every_weight_equals_the_folders(name):
    hf_ckpt, hf = built(FIXTURES / name / "hf")
    gg_ckpt, gg = built(FIXTURES / name / f"{name}-f32.gguf")
    assert gg_ckpt.architecture == hf_ckpt.architecture
    want, got = hf.state_dict(), gg.state_dict()
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert torch.equal(got[key], w), key


ARGS = {
    "kimi_linear": ["layer_types", "mlp_layer_types", "experts", "top_k", "shared", "groups", "topk_group",
                    "renormalize", "routed_scaling_factor", "rms_norm_eps", "kv_lora_rank", "q_lora_rank",
                    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_head_dim", "linear_num_heads",
                    "linear_conv_kernel_dim", "num_attention_heads", "hidden_size", "vocab_size",
                    "tie_word_embeddings"],
    "bailing_hybrid": ["layer_types", "mlp_layer_types", "experts", "top_k", "shared", "groups", "topk_group",
                       "renormalize", "routed_scaling_factor", "rms_norm_eps", "kv_lora_rank", "q_lora_rank",
                       "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_head_dim", "linear_num_heads",
                       "linear_conv_kernel_dim", "kda_safe_gate", "kda_lower_bound", "num_attention_heads",
                       "hidden_size", "vocab_size", "tie_word_embeddings"],
    "muse_glimmer": ["layer_types", "sliding_window", "rms_norm_eps", "post_norm_eps", "qk_scale_factor",
                     "output_multiplier", "final_logit_softcapping", "hidden_activation", "head_dim",
                     "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"],
}


@pytest.mark.parametrize("name", NAMES)
def test_config_from_gguf_is_the_folders(name):
    _, hf = built(FIXTURES / name / "hf")
    _, gg = built(FIXTURES / name / f"{name}-f32.gguf")
    for key in ARGS[name]:
        got, want = getattr(gg.args, key), getattr(hf.args, key)
        if isinstance(want, float):   # GGUF stores float32: equal at that precision
            got, want = np.float32(got), np.float32(want)
        assert got == want, key
    if name == "muse_glimmer":   # RoPE on the sliding layers only, NoPE on the full one
        assert [bool(t) for t in gg.args.layer_rope_theta] == [bool(t) for t in hf.args.layer_rope_theta] == [
            True, True, True, False]
        assert gg.args.qk_scale_factor == 3.87
    else:
        assert gg.args.layer_types == ["linear_attention", "full_attention"] * 2
    assert [s.kind for s in gg.cache_specs()] == [s.kind for s in hf.cache_specs()]


def _with(path, **meta):
    h = read_header(path)
    return dataclasses.replace(h, metadata={**h.metadata, **meta})


def test_kimi_refuses_softmax_routing():
    path = FIXTURES / "kimi_linear" / "kimi_linear-f32.gguf"
    with pytest.raises(ModelLoadError, match="gating"):
        gguf_kimi._config(_with(path, **{"kimi-linear.expert_gating_func": 1}))


def test_bailing_mtp_layers_are_not_decoder_layers_and_vl_rope_is_refused():
    path = FIXTURES / "bailing_hybrid" / "bailing_hybrid-f32.gguf"
    h = read_header(path)
    kv = h.metadata["bailingmoe3.attention.head_count_kv"]
    config = gguf_bailing._config(_with(path, **{"bailingmoe3.block_count": 5, "bailingmoe3.nextn_predict_layers": 1,
                                                 "bailingmoe3.attention.head_count_kv": kv + [1]}))
    assert config["num_hidden_layers"] == 4 and len(config["layer_types"]) == 4
    with pytest.raises(ModelLoadError, match="M-RoPE"):
        gguf_bailing._config(_with(path, **{"bailingmoe3.rope.dimension_sections": [2, 1, 1, 0]}))
    with pytest.raises(ModelLoadError, match="clamped"):
        gguf_bailing._config(_with(path, **{"bailingmoe3.swiglu_clamp_exp": [0.0, 7.0, 7.0, 7.0]}))


def test_muse_refuses_trained_qk_norm_weights():
    config = gguf_muse._config(read_header(FIXTURES / "muse_glimmer" / "muse_glimmer-f32.gguf"))
    ones = torch.ones(16)
    tensors = {f"model.layers.{i}.self_attn.{n}.weight": ones * (3.87 if n == "q_norm" else 1)
               for i in range(4) for n in ("q_norm", "k_norm")}
    assert gguf_muse._finish(dict(tensors), dict(config)) == {}
    tensors["model.layers.2.self_attn.q_norm.weight"] = torch.linspace(1, 2, 16)
    with pytest.raises(ModelLoadError, match="QK-norm"):
        gguf_muse._finish(tensors, dict(config))
