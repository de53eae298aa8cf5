"""EXAONE 4 and Ministral 3 GGUF layouts, beyond tests/test_gguf_families.py: every tensor read
from the converter-made F32 files equals the HF folder's (q/k un-permuted for mistral3, none for
exaone4), the config keys llama.cpp keeps come back as the folder's (per-layer sliding pattern,
Llama 3 rope from rope_freqs, YaRN + Llama 4 query scale), and what cannot be read is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from turnkv.loading import ModelLoadError, load_checkpoint
from turnkv.loading.gguf import architecture_of, read_header
from turnkv.loading.gguf.archs import exaone4 as gguf_exaone4
from turnkv.loading.gguf.archs.rope_freqs import freq_factors, llama3_rope
from turnkv.models.rope_config import inv_freq_for

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"


def pair(name):
    hf = load_checkpoint(FIXTURES / name / "hf", progress=False)
    gg = load_checkpoint(FIXTURES / name / f"{name}-f32.gguf", progress=False)
    return hf, gg


@pytest.mark.parametrize("name", ["exaone4", "ministral"])
def test_every_tensor_equals_the_folder(name):
    hf, gg = pair(name)
    assert gg.architecture == hf.architecture
    assert sorted(gg.tensors) == sorted(hf.tensors)
    for key, want in hf.tensors.items():
        assert torch.equal(gg.tensors[key], want), key


def test_exaone4_config_from_gguf():
    hf, gg = pair("exaone4")
    c = gg.config
    assert c["layer_types"] == hf.config["layer_types"] == [
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert c["sliding_window"] == hf.config["sliding_window"] == 16
    # rope_freqs (written by llama.cpp's converter) read back as the folder's llama3 parameters
    assert c["rope_parameters"] == hf.config["rope_parameters"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "eos_token_id"):
        assert c[key] == hf.config[key], key


def test_exaone4_pattern_without_the_array_is_llama_cpps_default():
    h = read_header(FIXTURES / "exaone4" / "exaone4-f32.gguf")
    meta = {k: v for k, v in h.metadata.items() if k != "exaone4.attention.sliding_window_pattern"}
    config = gguf_exaone4._config(dataclasses.replace(h, metadata=meta))
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    meta.pop("exaone4.attention.sliding_window")
    config = gguf_exaone4._config(dataclasses.replace(h, metadata=meta))
    assert config["sliding_window"] is None and config["layer_types"] == ["full_attention"] * 4


def test_rope_freqs_that_fit_no_llama3_parameters_are_divided_as_llama_cpp_does():
    h = read_header(FIXTURES / "exaone4" / "exaone4-f32.gguf")
    factors = freq_factors(h, 16)
    assert llama3_rope(factors, 16, 10000.0)["factor"] == 8.0
    odd = list(factors)
    odd[1] *= 1.01  # no low 1 / high 4 / integer context gives this
    params = llama3_rope(odd, 16, 10000.0)
    assert params == {"rope_type": "llama3", "freq_factors": odd}
    inv, scale = inv_freq_for({**params, "rope_theta": 10000.0}, 16)
    base, _ = inv_freq_for({"rope_type": "default", "rope_theta": 10000.0}, 16)
    assert scale == 1.0 and torch.equal(inv, base / torch.tensor(odd))


def test_ministral3_config_from_gguf():
    hf, gg = pair("ministral")
    c, want = gg.config, hf.config
    assert c["model_type"] == "ministral3" and c["sliding_window"] is None
    got_rope, want_rope = c["rope_parameters"], want["rope_parameters"]
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim"):
        assert got_rope[key] == want_rope[key], key
    assert got_rope["llama_4_scaling_beta"] == pytest.approx(want_rope["llama_4_scaling_beta"], rel=1e-7)


def test_mistral3_refuses_experts_and_biases():
    h = read_header(FIXTURES / "ministral" / "ministral-f32.gguf")
    arch = architecture_of(h)
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        arch.build_config(dataclasses.replace(h, metadata={**h.metadata, "mistral3.expert_count": 8}))
    info = h.tensors["blk.0.attn_output.weight"]
    with pytest.raises(ModelLoadError, match="bias"):
        arch.build_config(dataclasses.replace(h, tensors={**h.tensors, "blk.0.attn_output.bias": info}))
