"""What the gpt-oss and GLM-4 MoE GGUF layouts add beyond tests/test_gguf_families.py (which holds
each fixture's logits, greedy tokens, Q8_0 run and tokenizer to its HF folder):

- gpt-oss: llama.cpp's layer pattern (sliding, full, ... from the default period 2), YaRN with the
  released configs' untruncated correction range, the de-interleaved gate/up experts rebuilt, and
  the MXFP4 experts a released checkpoint converts to (tests/gguf_fixtures/gpt_oss_mxfp4, made by
  the converter from MXFP4 blocks; its Q8_0 file, Q8_0 around MXFP4 experts, is llama.cpp's
  ``MXFP4_MOE`` layout) dequantized bit for bit as transformers dequantizes the blocks;
- GLM-4 MoE: ``block_count`` counts the MTP layer, which is in the file and is not loaded;
- both: the stop ids (eos, eot, eom and the vocabulary's end-of-generation tokens).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from turnkv.loading import load_checkpoint
from turnkv.loading.gguf import read_header
from turnkv.loading.gguf.archs.common import stop_ids, swa_layers, token_ids_of
from turnkv.loading.gguf.archs.gpt_oss import build_config

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
GPT_OSS = FIXTURES / "gpt_oss" / "gpt_oss-f32.gguf"
MXFP4 = FIXTURES / "gpt_oss_mxfp4" / "gpt_oss_mxfp4-f32.gguf"
GLM = FIXTURES / "glm4_moe" / "glm4_moe-f32.gguf"


def test_gpt_oss_config_matches_the_folder():
    hf = load_checkpoint(FIXTURES / "gpt_oss" / "hf", progress=False)
    ckpt = load_checkpoint(GPT_OSS, progress=False)
    assert ckpt.config["layer_types"] == hf.config["layer_types"] == ["sliding_attention", "full_attention"]
    assert ckpt.config["sliding_window"] == hf.config["sliding_window"] == 16
    assert ckpt.config["rope_parameters"] == hf.config["rope_parameters"]
    assert ckpt.config["rope_parameters"]["truncate"] is False
    for key in ("rms_norm_eps", "num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim",
                "swiglu_limit", "eos_token_id", "bos_token_id", "pad_token_id"):
        assert ckpt.config[key] == hf.config[key], key


def test_gpt_oss_experts_and_sinks_are_the_folders():
    hf = load_checkpoint(FIXTURES / "gpt_oss" / "hf", progress=False).tensors
    got = load_checkpoint(GPT_OSS, progress=False).tensors
    for i in range(2):
        p = f"model.layers.{i}"
        for name in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                     "mlp.experts.down_proj", "mlp.experts.down_proj_bias"):
            assert torch.equal(got[f"{p}.{name}"], hf[f"{p}.{name}"]), name


def test_gpt_oss_sliding_pattern_as_llama_cpp_reads_it():
    h = read_header(GPT_OSS)
    assert "gpt-oss.attention.sliding_window_pattern" not in h.metadata   # the converter writes none
    assert swa_layers(h, "gpt-oss", 5, 2) == [True, False, True, False, True]
    arr = dataclasses.replace(h, metadata=h.metadata | {"gpt-oss.attention.sliding_window_pattern": [False, True]})
    assert build_config(arr)["layer_types"] == ["full_attention", "sliding_attention"]
    period3 = dataclasses.replace(h, metadata=h.metadata | {"gpt-oss.attention.sliding_window_pattern": 3})
    assert swa_layers(period3, "gpt-oss", 6, 2) == [True, True, False, True, True, False]


def test_mxfp4_experts_dequantize_as_transformers_does():
    h = read_header(MXFP4)
    assert {h.tensors[f"blk.0.ffn_{p}_exps.weight"].qtype.name for p in ("gate", "up", "down")} == {"MXFP4"}
    blocks = load_file(FIXTURES / "gpt_oss_mxfp4" / "hf" / "model.safetensors")
    got = load_checkpoint(MXFP4, progress=False).tensors
    for i in range(2):
        for name in ("gate_up_proj", "down_proj"):
            p = f"model.layers.{i}.mlp.experts.{name}"
            want = convert_moe_packed_tensors(blocks[f"{p}_blocks"], blocks[f"{p}_scales"], dtype=torch.float32)
            assert torch.equal(got[p], want), p


def test_glm4_moe_mtp_layer_is_in_the_file_and_not_loaded():
    h = read_header(GLM)
    assert h.metadata["glm4moe.block_count"] == 3 and h.metadata["glm4moe.nextn_predict_layers"] == 1
    assert "blk.2.nextn.eh_proj.weight" in h.tensors and "blk.2.ffn_gate_exps.weight" in h.tensors
    hf = load_checkpoint(FIXTURES / "glm4_moe" / "hf", progress=False)
    ckpt = load_checkpoint(GLM, progress=False)
    assert ckpt.config["num_hidden_layers"] == hf.config["num_hidden_layers"] == 2
    assert not [k for k in ckpt.tensors if k.startswith("model.layers.2.")]
    assert [k for k in hf.tensors if k.startswith("model.layers.2.eh_proj")]   # the folder has it too
    assert ckpt.config["rope_parameters"]["partial_rotary_factor"] == 0.5
    for key in ("first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                "n_shared_experts", "moe_intermediate_size", "use_qk_norm", "attention_bias", "rms_norm_eps"):
        assert ckpt.config[key] == hf.config[key], key
    p = "model.layers.1.mlp"
    gate_up = torch.stack([torch.cat([hf.tensors[f"{p}.experts.{e}.gate_proj.weight"],
                                      hf.tensors[f"{p}.experts.{e}.up_proj.weight"]]) for e in range(8)])
    assert torch.equal(ckpt.tensors[f"{p}.experts.gate_up_proj"], gate_up)
    bias = f"{p}.gate.e_score_correction_bias"
    assert torch.equal(ckpt.tensors[bias], hf.tensors[bias])


def test_stop_ids():
    h = read_header(GPT_OSS)
    assert token_ids_of(h, ("</s>", "<pad>")) == [0, 2]
    assert load_checkpoint(GPT_OSS, progress=False).config["eos_token_id"] == 2   # no harmony tokens here
    # GLM's converter writes eot (<|user|>) and eom (<|observation|>): both end generation
    glm = dataclasses.replace(read_header(GLM), metadata=read_header(GLM).metadata | {
        "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 9})
    config = {"eos_token_id": 2}
    stop_ids(glm, config)
    assert config["eos_token_id"] == [2, 7, 9]
    config = {"eos_token_id": 2}
    stop_ids(h, config, ("</s>", "<s>"))
    assert config["eos_token_id"] == [2, 1]
