"""Bailing hybrid (Ling 3; transformers' ``bailing_hybrid``) as llama.cpp writes it: architecture
``bailingmoe3``, converted by conversion/bailingmoe3.py's BailingMoeV3ForCausalLM class (its example
checkpoint is inclusionAI/Ling-3.0-flash, the one transformers' BailingHybridConfig documents).

What the converter does and how it is undone here (the KDA and MLA parts as Kimi Linear's, read by
kda_mla.py beside this file):

- the layer kind is in ``attention.head_count_kv``: 0 on KDA layers, 1 on MLA layers; MTP layers
  (``nextn_predict_layers``) follow the ``block_count - nextn_predict_layers`` decoder layers and are
  not read;
- KDA: ``f_proj`` is ``ssm_f_a``, the output-gate ``g_proj`` is ``ssm_g_a``, ``A_log`` is stored as
  ``exp(A_log)`` (``ssm_a [H, 1]``; handed to the model as that), ``dt_bias`` as ``ssm_dt.bias``,
  the q/k/v conv kernels reshaped to ``[1, d, 1, K]``;
- MLA: ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` (put back together), the head gate
  ``g_proj`` is ``attn_gate``; no q/k permutation: ggml's NORM rope is the checkpoint's interleaved
  rope, which the model de-interleaves itself;
- experts stacked ``[E, out, in]``: fused here into transformers' ``experts.gate_up_proj`` /
  ``experts.down_proj``; ``gate.expert_bias`` is ``exp_probs_b.bias``.

Config values are read as llama.cpp's loader (src/models/bailingmoe3.cpp) reads them: routed weights
renormalised only when ``expert_weights_norm`` is set, expert groups only when
``expert_group_count`` is written, the KDA gate bounded (``kda.safe_gate``, llama.cpp asserts it).
"""

from __future__ import annotations

from ...errors import ModelLoadError
from ..metadata import scalar
from ..reader import GGUFHeader
from .common import f32, per_layer
from .kda_mla import hybrid_architecture, hybrid_config, hybrid_names

ARCH = "bailingmoe3"
# KDA tensors beyond q/k/v and their convolutions: gguf suffix -> name under self_attn
_KDA = {"ssm_f_a.weight": "forget_gate.f_proj.weight", "ssm_g_a.weight": "g_proj.weight",
        "ssm_beta.weight": "b_proj.weight", "ssm_a": "forget_gate.exp_A_log",
        "ssm_dt.bias": "forget_gate.dt_bias", "ssm_norm.weight": "o_norm.weight"}
_MLA_GATE = {"attn_gate.weight": "g_proj.weight"}   # MLA's head gate


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    n_all = scalar(h, f"{a}.block_count")
    n = n_all - scalar(h, f"{a}.nextn_predict_layers", 0)
    if f"{a}.rope.dimension_sections" in h.metadata:
        raise ModelLoadError(f"{h.path}: the vision-language variant's M-RoPE is not supported (text GGUFs only)")
    if h.metadata.get(f"{a}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"{h.path}: rope scaling is not supported for the Bailing hybrid")
    for key in (f"{a}.swiglu_clamp_exp", f"{a}.swiglu_clamp_shexp"):
        if key in h.metadata and any(per_layer(h, key, n_all)):
            raise ModelLoadError(f"{h.path}: clamped SwiGLU experts ('{key}') are not supported")
    if not h.metadata.get(f"{a}.kda.safe_gate", True):
        raise ModelLoadError(f"{h.path}: only the bounded KDA gate exists in llama.cpp's layout")
    kv_heads = per_layer(h, f"{a}.attention.head_count_kv", n_all)[:n]
    kda_dim = scalar(h, f"{a}.kda.head_dim")
    theta = float(scalar(h, f"{a}.rope.freq_base", 10000.0))
    return {
        "model_type": "bailing_hybrid",
        "architectures": ["BailingHybridForCausalLM"],
        **hybrid_config(h, a, n, kv_heads, eps=1e-6),
        "moe_intermediate_size": scalar(h, f"{a}.expert_feed_forward_length"),
        "norm_topk_prob": bool(h.metadata.get(f"{a}.expert_weights_norm", False)),
        "head_dim": kda_dim,
        "short_conv_kernel_size": scalar(h, f"{a}.ssm.conv_kernel"),
        "kda_safe_gate": True,
        "kda_lower_bound": f32(scalar(h, f"{a}.kda.gate_lower_bound")),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    return hybrid_names(h, config, _KDA, "mlp", _MLA_GATE)


ARCHITECTURES = {ARCH: hybrid_architecture("bailing_hybrid", _config, _tensor_names)}
