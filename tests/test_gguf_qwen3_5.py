"""Qwen 3.5's GGUF layouts (``qwen35`` / ``qwen35moe``, turnkv/loading/gguf/archs/qwen3_5.py) beyond
tests/test_gguf_families.py's logits: on the converter-made fixtures (tests/gguf_fixtures/qwen3_5*),
the model built from the F32 file holds exactly the HF folder's weights, the file layout the loader
undoes is really there (value heads reordered, an MTP block counted in block_count), llama.cpp's
fallbacks for the layer kinds hold, and ``--weights gguf`` keeps the delta-net's projections on
their own blocks by running the value heads in the file's tiled order, which computes the same
model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from turnkv.loading import gguf, load_checkpoint
from turnkv.loading.errors import ModelLoadError
from turnkv.models import family_class
from turnkv.models.weights import GGUFPacked, load_model
from test_gguf_families import build, greedy, logits

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
VARIANTS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def f32_file(name: str) -> Path:
    return FIXTURES / name / f"{name}-f32.gguf"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fixture_has_the_layout_the_loader_undoes(name):
    h = gguf.read_header(f32_file(name))
    a = VARIANTS[name]
    assert h.architecture == a
    # fewer key heads than value heads: the converter reordered the value heads (grouped -> tiled)
    assert h.metadata[f"{a}.ssm.group_count"] < h.metadata[f"{a}.ssm.time_step_rank"]
    # the MTP block is counted in block_count; the trunk is the HF folder's 4 layers
    assert h.metadata[f"{a}.block_count"] == 5 and h.metadata[f"{a}.nextn_predict_layers"] == 1
    config = gguf.architecture_of(h).build_config(h)
    assert config["num_hidden_layers"] == 4
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_f32_file_builds_the_folder_model_bit_for_bit(name):
    # every parameter (norms with their 1 folded in, -exp(A_log), the un-reordered delta-net
    # projections, conv and per-head vectors, stacked experts) equals the HF-folder build's
    _, hf_model = build(FIXTURES / name / "hf")
    _, model = build(f32_file(name))
    want, got = hf_model.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_layer_kinds_without_the_recurrent_array(name):
    # llama.cpp's fallback: every full_attention_interval-th layer of the trunk is full attention
    h = gguf.read_header(f32_file(name))
    a = VARIANTS[name]
    meta = {k: v for k, v in h.metadata.items() if k != f"{a}.attention.recurrent_layers"}
    spec = gguf.architecture_of(h)
    assert spec.build_config(dataclasses.replace(h, metadata=meta))["layer_types"] == \
        spec.build_config(h)["layer_types"]
    meta[f"{a}.full_attention_interval"] = 2
    assert spec.build_config(dataclasses.replace(h, metadata=meta))["layer_types"] == \
        ["linear_attention", "full_attention"] * 2


def test_mtp_only_file_is_refused():
    h = gguf.read_header(f32_file("qwen3_5"))
    tensors = {k: v for k, v in h.tensors.items() if not k.startswith("blk.0.")}
    with pytest.raises(ModelLoadError, match="MTP-only"):
        gguf.architecture_of(h).build_config(dataclasses.replace(h, tensors=tensors))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_q8_delta_net_projections_stay_quantized(name):
    # with --weights gguf the value heads stay in the file's tiled order: every delta-net projection
    # (ssm_out's columns included) is one GGUF matmul on its own blocks
    ckpt, model = build(FIXTURES / name / f"{name}-q8_0.gguf", weights="gguf")
    assert ckpt.config["linear_value_heads_tiled"] is True
    delta = model.layers[0].mixer
    assert delta.tiled
    assert isinstance(delta.w_in, GGUFPacked) and delta.w_in.qtypes == ["Q8_0"]
    assert isinstance(delta.w_out, GGUFPacked)
    assert isinstance(model.layers[3].mixer.wo, GGUFPacked)
    assert isinstance(model.embed, GGUFPacked)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiled_value_heads_compute_the_grouped_model(name):
    # the same Q8_0 weights, dequantized: in the file's tiled order (what --weights gguf runs) and
    # put back in transformers' grouped order (what the float path loads) give the same logits up
    # to the order of ssm_out's sums, and the same greedy tokens
    path = FIXTURES / name / f"{name}-q8_0.gguf"
    tiled = load_checkpoint(path, dtype=torch.float32, progress=False, keep_quantized=True)
    grouped = load_checkpoint(path, dtype=torch.float32, progress=False)
    assert tiled.config.get("linear_value_heads_tiled") and not grouped.config.get("linear_value_heads_tiled")
    z = "model.layers.0.linear_attn.in_proj_z.weight"
    assert not torch.equal(tiled.quantized[z].dequantize(), grouped.tensors[z])   # really reordered
    cls = family_class(tiled.architecture)
    a = load_model(cls, tiled.config, tiled.tensors, torch.float32, "native", quantized=tiled.quantized).eval()
    b = load_model(cls, grouped.config, grouped.tensors, torch.float32, "native").eval()
    tokens = torch.randint(3, grouped.config["vocab_size"], (300,), generator=torch.Generator().manual_seed(5))
    want, got = logits(b, tokens), logits(a, tokens)
    assert (got - want).abs().max().item() <= 1e-4
    assert greedy(a, tokens[:40], 16) == greedy(b, tokens[:40], 16)
