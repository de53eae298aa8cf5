"""Gemma 4 and AFMoE GGUF layouts beyond tests/test_gguf_families.py's logits: the structure read
back from llama.cpp's metadata (layer kinds, head dims, kv heads, shared-KV producers, k = v, MoE
and PLE flags) equals the HF folder's, and files that llama.cpp would run differently from what
turnkv computes are refused with a clear error rather than loaded.

The headers are the converter-made fixtures' own (tests/gguf_fixtures/<family>/), with one
metadata value changed where a refusal is tested."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import turnkv.loading.gguf.reader as gguf
from turnkv.loading import load_checkpoint
from turnkv.loading.errors import ModelLoadError
from turnkv.loading.gguf import read_header
from turnkv.loading.gguf.archs import afmoe, gemma4
from turnkv.loading.gguf.archs.common import token_ids_of
from turnkv.models import family_class
from turnkv.models.weights import load_model

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
GEMMA4 = FIXTURES / "gemma4" / "gemma4-f32.gguf"
AFMOE = FIXTURES / "afmoe" / "afmoe-f32.gguf"


def model(spec):
    ckpt = load_checkpoint(spec, dtype=torch.float32, progress=False)
    return ckpt, load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, torch.float32)


def edited(path: Path, **changes):
    h = read_header(path)
    return dataclasses.replace(h, metadata=h.metadata | changes)


def test_gemma4_structure_equals_the_hf_folder():
    (_, ours), (_, hf) = model(GEMMA4), model(FIXTURES / "gemma4" / "hf")
    a, b = ours.args, hf.args
    for key in ("layer_types", "head_dims", "kv_heads", "producer", "first_shared", "attention_k_eq_v",
                "enable_moe_block", "num_experts", "top_k_experts", "hidden_size_per_layer_input",
                "sliding_window", "final_logit_softcapping", "rms_norm_eps"):
        assert getattr(a, key) == getattr(b, key), key
    # the fixture holds every kind: sliding / full owners, and a shared layer of each reading them
    assert a.layer_types == ["sliding_attention", "full_attention"] * 2 and a.producer == [0, 1, 0, 1]
    assert a.attention_k_eq_v and a.kv_heads == [2, 1, 2, 1] and a.head_dims == [16, 32, 16, 32]
    assert [(s.kind, s.heads, s.head_dim) for s in ours.cache_specs()] == \
        [(s.kind, s.heads, s.head_dim) for s in hf.cache_specs()]
    assert ours.cache_of == hf.cache_of == [0, 1, 0, 1]
    # double-wide MLPs on the shared layers came through the per-layer feed_forward_length
    assert [layer.mlp.wdown.shape[1] for layer in ours.layers] == [32, 32, 64, 64]


def test_gemma4_refuses_a_kv_reuse_llama_cpp_reads_differently():
    # sliding, sliding, sliding, full with two shared layers: llama.cpp gives layer 2 (sliding)
    # layer 0's cache (n_layer_kv_from_start - 2); transformers the last earlier sliding layer, 1
    h = edited(GEMMA4, **{"gemma4.attention.sliding_window_pattern": [True, True, True, False]})
    with pytest.raises(ModelLoadError, match="shared-KV layer 2"):
        gemma4.build_config(h)


def test_gemma4_refuses_a_sliding_last_layer():
    h = edited(GEMMA4, **{"gemma4.attention.sliding_window_pattern": [True, False, False, True]})
    with pytest.raises(ModelLoadError, match="last Gemma 4 layer is sliding"):
        gemma4.build_config(h)


def test_gemma4_end_of_generation_ids_read_from_a_lazy_vocabulary(monkeypatch):
    # real Gemma 4 vocabularies (262k tokens) stay unparsed in the header (GGUFArray): the ids of
    # llama.cpp's end-of-generation tokens are found by walking the array in the file
    listed = token_ids_of(read_header(GEMMA4), ("<s>", "</s>"))
    monkeypatch.setattr(gguf, "_LAZY_ARRAY_MIN", 100)
    lazy = read_header(GEMMA4)
    assert isinstance(lazy.metadata["tokenizer.ggml.tokens"], gguf.GGUFArray)
    assert token_ids_of(lazy, ("<s>", "</s>")) == listed == [1, 2]
    assert token_ids_of(lazy, gemma4.EOG_TEXTS) == []   # the byte-level test vocabulary has none of Gemma 4's


def test_afmoe_config_equals_the_hf_folder():
    (_, ours), (_, hf) = model(AFMOE), model(FIXTURES / "afmoe" / "hf")
    for key in ("layer_types", "num_dense_layers", "num_experts", "num_experts_per_tok", "num_shared_experts",
                "route_scale", "mup_enabled", "sliding_window", "head_dim", "num_key_value_heads", "rms_norm_eps",
                "tie_word_embeddings"):
        assert getattr(ours.args, key) == getattr(hf.args, key), key
    assert [s.kind for s in ours.cache_specs()] == [s.kind for s in hf.cache_specs()]


def test_afmoe_without_a_window_keeps_the_nope_layers():
    # no sliding window: llama.cpp attends fully everywhere but still rotates all but every 4th layer
    h = read_header(AFMOE)
    h = dataclasses.replace(h, metadata={k: v for k, v in h.metadata.items() if k != "afmoe.attention.sliding_window"})
    config = afmoe.build_config(h)
    assert config["sliding_window"] is None
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]


def test_afmoe_refuses_what_llama_cpp_would_run_differently():
    with pytest.raises(ModelLoadError, match="expert_weights_norm"):
        afmoe.build_config(edited(AFMOE, **{"afmoe.expert_weights_norm": False}))
    # a period-2 window pattern: sliding layers 0, 2 but NoPE stays on every 4th layer
    with pytest.raises(ModelLoadError, match="sliding layers that differ from its RoPE"):
        afmoe.build_config(edited(AFMOE, **{"afmoe.attention.sliding_window_pattern": 2}))
