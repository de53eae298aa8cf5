"""AFMoE (Arcee Trinity) from the GGUF layout llama.cpp writes (conversion/afmoe.py, read back by
src/models/afmoe.cpp).

What the file holds and how llama.cpp reads it, which is what this loader rebuilds:

- no q/k permute (AfmoeModel bypasses LlamaModel's), no norm offsets: tensors are the HF values;
- the four norms of a block: ``attn_norm`` / ``post_attention_norm`` / ``ffn_norm`` /
  ``post_ffw_norm`` are input / post-attention / pre-MLP / post-MLP; the sigmoid output gate is
  ``attn_gate``;
- the first ``leading_dense_block_count`` blocks are dense SwiGLU; the others hold the router
  (``ffn_gate_inp``), the expert bias (``exp_probs_b.bias``), the experts stacked per projection
  (``ffn_{gate,up,down}_exps`` [E, ...]) and the shared experts (``ffn_*_shexp``);
- layer kinds are not in the file's config: llama.cpp takes sliding layers from
  ``attention.sliding_window_pattern`` (an array or a period, 4 when absent) and rotates every
  layer but each 4th (its fixed ``n_no_rope_layer_step``); turnkv's AFMoE rotates exactly its
  sliding layers, so a file whose two patterns differ is refused;
- llama.cpp always multiplies the embeddings by sqrt(hidden) (muP), scores experts with a sigmoid
  unless the file says otherwise and renormalises the chosen weights only when
  ``expert_weights_norm`` is set; turnkv's AFMoE (as transformers') always renormalises, so a file
  without it is refused rather than run differently.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import default_rope, scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import (SIGMOID, attention_shape, check_full_rotary, f32, fuse_gate_up, moe_decoder_names, rope_base,
                     swa_layers)

ARCH = "afmoe"
NAME = "AFMoE"
NO_ROPE_LAYER_STEP = 4   # llama.cpp's llama_hparams::n_no_rope_layer_step, not read from the file
DEFAULT_SWA_PERIOD = 4   # load_swa_pattern(ml, 4)


def build_config(h: GGUFHeader) -> dict:
    a = ARCH
    layers = scalar(h, f"{a}.block_count")
    hidden, heads, head_dim = attention_shape(h, a, NAME)
    check_full_rotary(h, a, head_dim, NAME)
    rope_theta = rope_base(h, a, 10000.0, NAME)
    rope = default_rope(h, a, rope_theta)
    if h.metadata.get(f"{a}.expert_gating_func", SIGMOID) != SIGMOID:
        raise ModelLoadError(f"{h.path}: AFMoE scores experts with a sigmoid; this file names another function")
    if not h.metadata.get(f"{a}.expert_weights_norm", False):
        raise ModelLoadError(
            f"{h.path}: {a}.expert_weights_norm is not set, so llama.cpp would not renormalise the routing "
            "weights; turnkv's AFMoE (as transformers') always does"
        )
    shared = scalar(h, f"{a}.expert_shared_count")
    if shared < 1:
        raise ModelLoadError(f"{h.path}: AFMoE without shared experts is not supported")

    window = h.metadata.get(f"{a}.attention.sliding_window") or None
    rotated = [(i + 1) % NO_ROPE_LAYER_STEP != 0 for i in range(layers)]
    if window is not None and swa_layers(h, a, layers, DEFAULT_SWA_PERIOD) != rotated:
        raise ModelLoadError(
            f"{h.path}: llama.cpp would run this AFMoE with sliding layers that differ from its RoPE "
            f"layers (every {NO_ROPE_LAYER_STEP}th layer NoPE); turnkv's AFMoE ties the two"
        )
    # With no window every layer attends fully; the sliding_attention label then only marks RoPE.
    types = ["sliding_attention" if r else "full_attention" for r in rotated]
    return {
        "model_type": "afmoe",
        "architectures": ["AfmoeForCausalLM"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": hidden,
        "intermediate_size": scalar(h, f"{a}.feed_forward_length"),
        "moe_intermediate_size": scalar(h, f"{a}.expert_feed_forward_length"),
        "num_hidden_layers": layers,
        "num_dense_layers": scalar(h, f"{a}.leading_dense_block_count", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(h, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": scalar(h, f"{a}.context_length", 16384),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "num_experts": scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": scalar(h, f"{a}.expert_used_count"),
        "num_shared_experts": shared,
        "route_norm": True,
        "route_scale": f32(scalar(h, f"{a}.expert_weights_scale", 1.0)),
        "score_func": "sigmoid",
        "global_attn_every_n_layers": NO_ROPE_LAYER_STEP,
        "sliding_window": window,
        "layer_types": types,
        "mup_enabled": True,   # llama.cpp scales the embeddings unconditionally
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


_ATTN = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_mlp_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    **ATTN_PROJ_TENSORS,
    "attn_gate": "self_attn.gate_proj",
    **QK_NORM_TENSORS,
}
_MOE = {
    "ffn_gate_inp": "mlp.router.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    biased = ATTN_PROJ_TENSORS if config["attention_bias"] else ()
    return moe_decoder_names(h, config["num_hidden_layers"], config["num_dense_layers"], _ATTN, GATED_MLP_TENSORS,
                             _MOE, "mlp.expert_bias", biased)


def finish(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Gate and up experts fused as transformers holds them in memory ([E, 2I, H])."""
    fuse_gate_up(tensors)
    return tensors


ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="afmoe",
    build_config=build_config,
    layer_tensors={},
    tensor_names=tensor_names,
    finish=finish,
)}
