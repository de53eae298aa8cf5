"""Gemma 3's GGUF layout: its config (five sliding layers, then one full) and the undoing of
llama.cpp's "+1" on the norm weights."""

from __future__ import annotations

import torch

from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import default_rope, scalar, token_ids, vocab_size
from ..reader import GGUFHeader

ARCH = "gemma3"

LAYER = {
    "attn_norm": "input_layernorm",
    **ATTN_PROJ_TENSORS,
    **QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **GATED_MLP_TENSORS,
}

GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0


def _config(h: GGUFHeader) -> dict:
    a = "gemma3"
    layers = scalar(h, f"{a}.block_count")
    head_dim = scalar(h, f"{a}.attention.key_length", 256)
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    rope_theta = float(scalar(h, f"{a}.rope.freq_base", 1_000_000.0))
    full_rope = default_rope(h, a, rope_theta)  # Gemma 3 scales the global layers' rope only
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": scalar(h, f"{a}.embedding_length"),
        "intermediate_size": scalar(h, f"{a}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": scalar(h, f"{a}.attention.head_count"),
        "num_key_value_heads": scalar(h, f"{a}.attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": scalar(h, f"{a}.context_length", 131072),
        "rms_norm_eps": scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_ROPE_LOCAL_BASE_FREQ},
            "full_attention": full_rope,
        },
        "attention_bias": False,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": scalar(h, f"{a}.attention.sliding_window", 4096),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    # llama.cpp stores Gemma's RMSNorm weights as (1 + w); transformers keeps w.
    return w - 1 if _is_norm(name) else w



ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="gemma3_text",
    build_config=_config,
    layer_tensors=LAYER,
    transform=_transform,
    needs_transform=_is_norm,
)}
