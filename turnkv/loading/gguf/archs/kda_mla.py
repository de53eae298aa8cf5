"""The KDA + MLA hybrid layout Kimi Linear (kimi_linear.py) and the Bailing hybrid
(bailing_hybrid.py) share in llama.cpp's GGUFs: layer kinds from ``attention.head_count_kv`` (0 on
KDA layers, 1 on MLA layers), the MLA tensors with ``kv_b_proj`` split into ``attn_k_b`` /
``attn_v_b``, the q/k/v short convolutions reshaped to ``[1, d, 1, K]``, and a DeepSeek-style MoE
(sigmoid router with a score-correction bias, stacked experts, shared experts) after
``leading_dense_block_count`` dense blocks. Each family passes its own KDA tensor names.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import GATED_MLP_TENSORS, GGUFArchitecture
from ..metadata import scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import SIGMOID, f32, fuse_gate_up, global_names, layer_weights

LINEAR, FULL = "linear_attention", "full_attention"


def moe_config(h: GGUFHeader, a: str) -> dict:
    gating = h.metadata.get(f"{a}.expert_gating_func", SIGMOID)
    if gating != SIGMOID:
        raise ModelLoadError(f"{h.path}: expert gating function {gating} is not supported (sigmoid routing only)")
    return {
        "num_local_experts": scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": scalar(h, f"{a}.expert_used_count"),
        "n_shared_experts": scalar(h, f"{a}.expert_shared_count", 1),
        "n_group": scalar(h, f"{a}.expert_group_count", 1),
        "topk_group": scalar(h, f"{a}.expert_group_used_count", 1),
        "routed_scaling_factor": f32(scalar(h, f"{a}.expert_weights_scale", 1.0)),
        "first_k_dense_replace": scalar(h, f"{a}.leading_dense_block_count", 0),
    }


def mla_config(h: GGUFHeader, a: str) -> dict:
    rope = scalar(h, f"{a}.rope.dimension_count")
    return {
        "kv_lora_rank": scalar(h, f"{a}.attention.kv_lora_rank"),
        "q_lora_rank": scalar(h, f"{a}.attention.q_lora_rank", None),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": scalar(h, f"{a}.attention.key_length_mla") - rope,
        "v_head_dim": scalar(h, f"{a}.attention.value_length_mla"),
    }


def hybrid_config(h: GGUFHeader, a: str, n: int, kv_heads: list[int], eps: float) -> dict:
    """The config entries both hybrids read alike, for ``n`` decoder layers whose per-layer KV head
    counts are ``kv_heads`` (0: KDA); the family adds its model type, MoE widths and KDA extras."""
    heads = scalar(h, f"{a}.attention.head_count")
    return {
        "vocab_size": vocab_size(h, a),
        "hidden_size": scalar(h, f"{a}.embedding_length"),
        "intermediate_size": scalar(h, f"{a}.feed_forward_length"),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        **mla_config(h, a),
        **moe_config(h, a),
        "layer_types": [LINEAR if kv == 0 else FULL for kv in kv_heads],
        "linear_num_heads": heads,
        "linear_head_dim": scalar(h, f"{a}.kda.head_dim"),
        "linear_conv_kernel_dim": scalar(h, f"{a}.ssm.conv_kernel"),
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": scalar(h, f"{a}.context_length", 4096),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", eps)),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


def mla_map(h: GGUFHeader, b: str, p: str) -> dict[str, str]:
    """The MLA tensors of layer ``b`` (``blk.{i}``) under the attention prefix ``p``."""
    out = {f"{b}.attn_kv_a_mqa.weight": f"{p}.kv_a_proj_with_mqa.weight",
           f"{b}.attn_kv_a_norm.weight": f"{p}.kv_a_layernorm.weight"}
    if f"{b}.attn_q_a.weight" in h.tensors:
        out |= {f"{b}.attn_q_a.weight": f"{p}.q_a_proj.weight",
                f"{b}.attn_q_a_norm.weight": f"{p}.q_a_layernorm.weight",
                f"{b}.attn_q_b.weight": f"{p}.q_b_proj.weight"}
    else:
        out[f"{b}.attn_q.weight"] = f"{p}.q_proj.weight"
    if f"{b}.attn_kv_b.weight" in h.tensors:   # older files: kv_b_proj whole
        out[f"{b}.attn_kv_b.weight"] = f"{p}.kv_b_proj.weight"
    else:
        out |= {f"{b}.attn_k_b.weight": f"{p}.kv_b_proj.k_b", f"{b}.attn_v_b.weight": f"{p}.kv_b_proj.v_b"}
    return out


def moe_map(b: str, p: str) -> dict[str, str]:
    """The MoE tensors of layer ``b`` under the MoE prefix ``p``; the stacked experts stay
    ``{p}.experts.{gate,up,down}_exps`` [E, out, in] until the family's ``finish``."""
    return {
        f"{b}.ffn_gate_inp.weight": f"{p}.gate.weight",
        f"{b}.exp_probs_b.bias": f"{p}.gate.e_score_correction_bias",
        f"{b}.ffn_gate_exps.weight": f"{p}.experts.gate_exps",
        f"{b}.ffn_up_exps.weight": f"{p}.experts.up_exps",
        f"{b}.ffn_down_exps.weight": f"{p}.experts.down_exps",
        f"{b}.ffn_gate_shexp.weight": f"{p}.shared_experts.gate_proj.weight",
        f"{b}.ffn_up_shexp.weight": f"{p}.shared_experts.up_proj.weight",
        f"{b}.ffn_down_shexp.weight": f"{p}.shared_experts.down_proj.weight",
    }


def hybrid_names(h: GGUFHeader, config: dict, kda: dict[str, str], moe: str,
                 mla_extra: dict[str, str] | None = None) -> dict[str, str]:
    """Every tensor name of a KDA/MLA hybrid: per layer the two norms and ``o_proj``; on KDA
    layers q/k/v, their convolutions and the family's ``kda`` tensors ({gguf suffix: name under
    ``self_attn``}); on MLA layers ``mla_map`` and ``mla_extra``; then a dense MLP or the MoE
    under ``model.layers.{i}.{moe}``."""
    names = global_names(h)
    for i, kind in enumerate(config["layer_types"]):
        b, p = f"blk.{i}", f"model.layers.{i}"
        a = f"{p}.self_attn"
        names |= {f"{b}.attn_norm.weight": f"{p}.input_layernorm.weight",
                  f"{b}.ffn_norm.weight": f"{p}.post_attention_layernorm.weight",
                  f"{b}.attn_output.weight": f"{a}.o_proj.weight"}
        if kind == LINEAR:
            names |= {f"{b}.attn_{x}.weight": f"{a}.{x}_proj.weight" for x in "qkv"}
            names |= {f"{b}.ssm_conv1d_{x}.weight": f"{a}.{x}_conv1d.weight" for x in "qkv"}
            names |= {f"{b}.{g}": f"{a}.{t}" for g, t in kda.items()}
        else:
            names |= mla_map(h, b, a)
            names |= {f"{b}.{g}": f"{a}.{t}" for g, t in (mla_extra or {}).items()}
        if i < config["first_k_dense_replace"]:
            names |= layer_weights(b, p, GATED_MLP_TENSORS)
        else:
            names |= moe_map(b, f"{p}.{moe}")
    return names


def fuse_kv_b(t: dict[str, torch.Tensor]) -> None:
    """attn_k_b [H, R, nope] (transposed per head) + attn_v_b [H, dv, R] -> kv_b_proj [H * (nope + dv), R]."""
    for name in [n for n in t if n.endswith(".kv_b_proj.k_b")]:
        p = name[: -len(".k_b")]
        k_b, v_b = t.pop(f"{p}.k_b"), t.pop(f"{p}.v_b")
        t[f"{p}.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()


def finish_attention(t: dict[str, torch.Tensor], config: dict) -> None:
    """The KDA convolutions back to the checkpoint's [d, 1, K] and MLA's ``kv_b_proj`` whole."""
    k = config["linear_conv_kernel_dim"]
    for name in [n for n in t if n.endswith("_conv1d.weight")]:
        t[name] = t[name].reshape(-1, 1, k)           # [1, d, 1, K] -> the checkpoint's [d, 1, K]
    fuse_kv_b(t)


def finish_experts(t: dict[str, torch.Tensor]) -> None:
    """The stacked experts as transformers holds them in memory: ``experts.gate_up_proj``
    [E, 2 * I, H] and ``experts.down_proj`` [E, H, I] (GGUF blocks stay blocks)."""
    fuse_gate_up(t, "gate_exps", "up_exps")
    for name in [n for n in t if n.endswith(".experts.down_exps")]:
        t[name[: -len("down_exps")] + "down_proj"] = t.pop(name)


def _finish(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    finish_attention(t, config)
    finish_experts(t)
    return t


def hybrid_architecture(model_type: str, build_config, tensor_names) -> GGUFArchitecture:
    """A KDA + MLA family's GGUF architecture: its config and tensor names, the shared finish."""
    return GGUFArchitecture(model_type=model_type, build_config=build_config, layer_tensors={},
                            tensor_names=tensor_names, finish=_finish)
