"""GLM-4.5 / 4.6 / 4.7 MoE from the GGUF layout llama.cpp writes (conversion/glm.py
Glm4MoeModel, ``general.architecture`` "glm4moe", read back by src/models/glm4-moe.cpp).

What the file holds and how llama.cpp reads it, which is what this loader rebuilds:

- no q/k permute (GLM-4 MoE already uses NEOX rope; only the dense GLM-4 M-RoPE variant is
  permuted), no norm offsets: tensors are the HF values; ``attn_norm`` / ``post_attention_norm``
  are the block norms, ``attn_q_norm`` / ``attn_k_norm`` the optional per-head QK-norm;
- partial RoPE: ``rope.dimension_count`` is the rotated part of a ``attention.key_length`` head;
- the first ``leading_dense_block_count`` blocks are dense SwiGLU (``ffn_gate/up/down``); the
  others hold the router (``ffn_gate_inp``), the score-correction bias (``exp_probs_b.bias``), the
  experts stacked per projection (``ffn_{gate,up,down}_exps`` [E, ...]) and the shared experts
  (``ffn_*_shexp``); sigmoid scoring (``expert_gating_func``, sigmoid when absent), group-limited
  choice (``expert_group_count`` / ``expert_group_used_count``), ``expert_weights_norm`` (False
  when absent, as llama.cpp reads it) and ``expert_weights_scale`` (1 when absent);
- ``block_count`` counts the NextN/MTP layers too: llama.cpp's decoder is the first
  ``block_count - nextn_predict_layers`` blocks, and the ``blk.{n}...`` MTP blocks after them
  (``nextn.eh_proj`` etc.) are only for speculative decoding. turnkv ignores them, as it ignores
  ``model.layers.{num_hidden_layers}`` in the HF checkpoints;
- generation ends on the file's eos, eot and eom (the converter writes ``<|endoftext|>``,
  ``<|user|>``, ``<|observation|>``: the released generation_config.json's eos ids).
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import default_rope, scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import SIGMOID, attention_shape, f32, fuse_gate_up, moe_decoder_names, stop_ids, uniform

ARCH = "glm4moe"
NAME = "GLM-4 MoE"


def build_config(h: GGUFHeader) -> dict:
    a = ARCH
    nextn = scalar(h, f"{a}.nextn_predict_layers", 0)
    layers = scalar(h, f"{a}.block_count") - nextn
    hidden, heads, head_dim = attention_shape(h, a, NAME)
    if any(h.metadata.get(f"{a}.rope.dimension_sections") or ()):
        raise ModelLoadError(f"{h.path}: GLM-4 MoE with M-RoPE sections (the vision variant) is not supported")
    rotary = scalar(h, f"{a}.rope.dimension_count", head_dim // 2)
    rope_theta = float(scalar(h, f"{a}.rope.freq_base", 10000.0))
    partial = rotary / head_dim
    rope = default_rope(h, a, rope_theta, partial_rotary_factor=partial)
    if h.metadata.get(f"{a}.expert_gating_func", SIGMOID) not in (0, SIGMOID):   # 0: none -> sigmoid
        raise ModelLoadError(f"{h.path}: GLM-4 MoE scores experts with a sigmoid; this file names another function")
    shared = scalar(h, f"{a}.expert_shared_count")
    if shared < 1:
        raise ModelLoadError(f"{h.path}: GLM-4 MoE without a shared expert is not supported")
    config = {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": hidden,
        "intermediate_size": uniform(h, f"{a}.feed_forward_length", layers),
        "moe_intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", layers),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn,
        "first_k_dense_replace": scalar(h, f"{a}.leading_dense_block_count", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(h, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": scalar(h, f"{a}.context_length", 131072),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "partial_rotary_factor": partial,
        "rope_parameters": rope,
        "n_routed_experts": scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": uniform(h, f"{a}.expert_used_count", layers),
        "n_shared_experts": shared,
        "n_group": scalar(h, f"{a}.expert_group_count", 0) or 1,
        "topk_group": scalar(h, f"{a}.expert_group_used_count", 0) or 1,
        "norm_topk_prob": bool(h.metadata.get(f"{a}.expert_weights_norm", False)),
        "routed_scaling_factor": f32(h.metadata.get(f"{a}.expert_weights_scale", 0.0) or 1.0),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in h.tensors,
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }
    stop_ids(h, config)
    return config


_ATTN = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **ATTN_PROJ_TENSORS,
}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_BIASED = ("attn_q", "attn_k", "attn_v")   # o_proj has no bias


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    # the MTP blocks after the num_hidden_layers decoder blocks are left unread
    attn = _ATTN | (QK_NORM_TENSORS if config["use_qk_norm"] else {})
    biased = _BIASED if config["attention_bias"] else ()
    return moe_decoder_names(h, config["num_hidden_layers"], config["first_k_dense_replace"], attn,
                             GATED_MLP_TENSORS, _MOE, "mlp.gate.e_score_correction_bias", biased)


def finish(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Gate and up experts fused as transformers holds them in memory ([E, 2I, H]); down stays
    [E, H, I]."""
    fuse_gate_up(tensors)
    return tensors


ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="glm4_moe",
    build_config=build_config,
    layer_tensors={},
    tensor_names=tensor_names,
    finish=finish,
)}
