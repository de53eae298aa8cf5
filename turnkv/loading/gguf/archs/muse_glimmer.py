"""Muse Glimmer's text decoder (``muse-glimmer``) as llama.cpp's converter writes it
(conversion/muse_glimmer.py, class MuseGlimmerModel; the vision tower goes to a separate mmproj
file, which turnkv does not read).

What the converter does and how it is undone here:

- the four Gemma-2 block norms (``*layernorm.weight``) are stored as ``1 + w``: ``- 1`` here
  (turnkv adds the 1 back: exact while ``1 + w`` lies in [0.5, 2]); the final norm is plain;
- q/k are permuted from transformers' rotate-half layout to ggml's interleaved one, on every
  layer: un-permuted here (a reorder of whole rows, so a Q8_0 file's blocks stay quantized);
- ``qk_scale_factor`` is folded into synthesized QK-norm weights (``attn_q_norm`` = the factor
  repeated, ``attn_k_norm`` = ones): the factor is read back from them (they must be uniform).

Config values the GGUF does not hold are taken as llama.cpp's graph (src/models/muse-glimmer.cpp)
takes them: RoPE on the sliding layers only (``sliding_window_pattern``), at
``rope.freq_base_swa`` if present, else ``rope.freq_base``; the post-attention / post-FFN norms at
eps 1e-8; the weightless embedding norm at ``layer_norm_rms_epsilon``; a SiLU-gated MLP.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import attention_shape, check_full_rotary, f32, global_names, layer_biases, layer_weights, per_layer
from .llama import reverse_permute

ARCH = "muse-glimmer"
NAME = "Muse Glimmer"
SLIDING, FULL = "sliding_attention", "full_attention"
POST_NORM_EPS = 1e-8  # hard-coded in llama.cpp's graph, as transformers' default post_norm_eps


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    n = scalar(h, f"{a}.block_count")
    hidden, heads, head_dim = attention_shape(h, a, NAME)
    check_full_rotary(h, a, head_dim, NAME)
    if f"{a}.rope.scaling.type" in h.metadata and h.metadata[f"{a}.rope.scaling.type"] not in ("none",):
        raise ModelLoadError(f"{h.path}: rope scaling is not supported for Muse Glimmer")
    sliding = per_layer(h, f"{a}.attention.sliding_window_pattern", n)
    layer_types = [SLIDING if s else FULL for s in sliding]
    theta = float(scalar(h, f"{a}.rope.freq_base_swa", scalar(h, f"{a}.rope.freq_base", 10000.0)))
    cap = scalar(h, f"{a}.final_logit_softcapping", None)
    return {
        "model_type": "muse_glimmer",
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": hidden,
        "intermediate_size": scalar(h, f"{a}.feed_forward_length"),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(h, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon")),
        "post_norm_eps": POST_NORM_EPS,
        "sliding_window": scalar(h, f"{a}.attention.sliding_window"),
        "layer_types": layer_types,
        # RoPE on the sliding layers (llama.cpp: use_rope = is_swa(il)); one table for all of them
        "layer_rope_theta": [theta if s else 0 for s in sliding],
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_activation": "silu",
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "output_multiplier": f32(scalar(h, f"{a}.logit_scale")),
        "final_logit_softcapping": f32(cap) if cap else None,
        "max_position_embeddings": scalar(h, f"{a}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **ATTN_PROJ_TENSORS,
    "attn_gate": "self_attn.gate_proj",
    **QK_NORM_TENSORS,
    **GATED_MLP_TENSORS,
}


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = global_names(h)
    for i in range(config["num_hidden_layers"]):
        b, p = f"blk.{i}", f"model.layers.{i}"
        names |= layer_weights(b, p, _LAYER)
        if config["attention_bias"]:
            names |= layer_biases(b, p, _LAYER, ATTN_PROJ_TENSORS)
    return names


def _needs_transform(name: str) -> bool:
    return name.endswith("layernorm.weight") or ".self_attn.q_proj." in name or ".self_attn.k_proj." in name


def _transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    if name.endswith("layernorm.weight"):
        return w - 1
    if ".self_attn.q_proj." in name:
        return reverse_permute(w, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return reverse_permute(w, config["num_key_value_heads"])
    return w


def _finish(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    factors = set()
    for i in range(config["num_hidden_layers"]):
        q, k = t.pop(f"model.layers.{i}.self_attn.q_norm.weight"), t.pop(f"model.layers.{i}.self_attn.k_norm.weight")
        if not bool((k == 1).all()) or not bool((q == q[0]).all()):
            raise ModelLoadError("Muse Glimmer GGUF: the QK-norm weights are not the converter's (uniform q "
                                 "factor, unit k); trained QK-norm weights are not supported")
        factors.add(float(q[0]))
    if len(factors) != 1:
        raise ModelLoadError(f"Muse Glimmer GGUF: the layers' query factors differ ({sorted(factors)})")
    config["qk_scale_factor"] = f32(factors.pop())
    return t


ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="muse_glimmer",
    build_config=_config,
    layer_tensors=_LAYER,
    transform=_transform,
    needs_transform=_needs_transform,
    transform_permutes_rows=True,
    tensor_names=_tensor_names,
    finish=_finish,
)}
