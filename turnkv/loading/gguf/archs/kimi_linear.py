"""Kimi Linear (``kimi-linear``) as llama.cpp's converter writes it (conversion/kimi_linear.py).

What the converter does and how it is undone here:

- the layer kind is in ``attention.head_count_kv``, an array: 0 on the KDA (recurrent) layers, 1 on
  the MLA layers (llama.cpp's loader: ``is_recr(i) = n_head_kv(i) == 0``);
- KDA: ``q/k/v_conv1d`` are reshaped to ``[1, d, 1, K]`` (same memory order: reshaped back),
  ``A_log`` is stored as ``-exp(A_log)`` (``ssm_a``; handed to the model as that, so the decay is
  the same float32 value, not exp(log(...)) of it), ``dt_bias`` as ``ssm_dt.bias``;
- MLA: ``kv_b_proj`` is split per head into ``attn_k_b`` (the key half, transposed) and
  ``attn_v_b``; they are put back together. No q/k permutation (the MLA layers are NoPE);
- the routed experts are stacked ``[E, out, in]`` (``ffn_{gate,up,down}_exps``): held as
  transformers' in-memory ``experts.gate_up_proj`` / ``experts.down_proj`` (the released files'
  ``experts.{e}.w1/w3/w2`` stacked). The dense leading layers keep ``ffn_gate/up/down``.

Config values the GGUF does not hold are taken as llama.cpp's graph takes them: the routed weights
are always renormalised (``build_moe_ffn(..., norm_w=true, ...)``), the MoE has no expert groups
unless ``expert_group_count`` says so, and the KDA layers have ``attention.head_count`` heads.
"""

from __future__ import annotations

from ..metadata import scalar
from ..reader import GGUFHeader
from .common import per_layer, uniform
from .kda_mla import hybrid_architecture, hybrid_config, hybrid_names

ARCH = "kimi-linear"
# KDA tensors beyond q/k/v and their convolutions: gguf suffix -> name under self_attn
_KDA = {"ssm_f_a.weight": "f_a_proj.weight", "ssm_f_b.weight": "f_b_proj.weight",
        "ssm_g_a.weight": "g_a_proj.weight", "ssm_g_b.weight": "g_b_proj.weight",
        "ssm_beta.weight": "b_proj.weight", "ssm_a": "neg_exp_A_log",
        "ssm_dt.bias": "dt_bias", "ssm_norm.weight": "o_norm.weight"}


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    n = scalar(h, f"{a}.block_count")
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        **hybrid_config(h, a, n, per_layer(h, f"{a}.attention.head_count_kv", n), eps=1e-5),
        "moe_intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", n),
        "norm_topk_prob": True,
    }


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    return hybrid_names(h, config, _KDA, "block_sparse_moe")


ARCHITECTURES = {ARCH: hybrid_architecture("kimi_linear", _config, _tensor_names)}
