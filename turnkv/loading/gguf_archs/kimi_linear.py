"""Kimi Linear (``kimi-linear``) as llama.cpp's converter writes it (conversion/kimi_linear.py).

What the converter does and how it is undone here:

- the layer kind is in ``attention.head_count_kv``, an array: 0 on the KDA (recurrent) layers, 1 on
  the MLA layers (llama.cpp's loader: ``is_recr(i) = n_head_kv(i) == 0``);
- KDA: ``q/k/v_conv1d`` are reshaped to ``[1, d, 1, K]`` (same memory order: reshaped back),
  ``A_log`` is stored as ``-exp(A_log)`` (``ssm_a``; handed to the model as that, so the decay is
  the same float32 value, not exp(log(...)) of it), ``dt_bias`` as ``ssm_dt.bias``;
- MLA: ``kv_b_proj`` is split per head into ``attn_k_b`` (the key half, transposed) and
  ``attn_v_b``; they are put back together. No q/k permutation (the MLA layers are NoPE);
- the routed experts are stacked ``[E, out, in]`` (``ffn_{gate,up,down}_exps``): split back into
  ``experts.{e}.w1/w3/w2``. The dense leading layers keep ``ffn_gate/up/down``.

Config values the GGUF does not hold are taken as llama.cpp's graph takes them: the routed weights
are always renormalised (``build_moe_ffn(..., norm_w=true, ...)``), the MoE has no expert groups
unless ``expert_group_count`` says so, and the KDA layers have ``attention.head_count`` heads.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ModelLoadError
from ..gguf import GGUFArchitecture, GGUFHeader, _scalar, _token_ids, _vocab_size, register

ARCH = "kimi-linear"
LINEAR, FULL = "linear_attention", "full_attention"
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the value config.json held, when it had few enough digits."""
    return float(str(np.float32(value)))


def per_layer(h: GGUFHeader, key: str, n: int) -> list:
    """A per-layer metadata value (an array, or one scalar for every layer)."""
    value = h.get(key)
    if isinstance(value, list):
        if len(value) != n:
            raise ModelLoadError(f"{h.path}: '{key}' has {len(value)} entries for {n} layers")
        return value
    if isinstance(value, (int, float)):
        return [value] * n
    raise ModelLoadError(f"{h.path}: '{key}' is not a per-layer array")


def uniform(h: GGUFHeader, key: str, n: int, default=...):
    """A value llama.cpp may store per layer (get_key_or_arr), which turnkv takes as one."""
    if key not in h.metadata and default is not ...:
        return default
    values = set(per_layer(h, key, n))
    if len(values) != 1:
        raise ModelLoadError(f"{h.path}: per-layer values for '{key}' that differ are not supported")
    return values.pop()


def moe_config(h: GGUFHeader, a: str) -> dict:
    gating = h.metadata.get(f"{a}.expert_gating_func", SIGMOID)
    if gating != SIGMOID:
        raise ModelLoadError(f"{h.path}: expert gating function {gating} is not supported (sigmoid routing only)")
    return {
        "num_local_experts": _scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": _scalar(h, f"{a}.expert_used_count"),
        "n_shared_experts": _scalar(h, f"{a}.expert_shared_count", 1),
        "n_group": _scalar(h, f"{a}.expert_group_count", 1),
        "topk_group": _scalar(h, f"{a}.expert_group_used_count", 1),
        "routed_scaling_factor": f32(_scalar(h, f"{a}.expert_weights_scale", 1.0)),
        "first_k_dense_replace": _scalar(h, f"{a}.leading_dense_block_count", 0),
    }


def mla_config(h: GGUFHeader, a: str) -> dict:
    rope = _scalar(h, f"{a}.rope.dimension_count")
    return {
        "kv_lora_rank": _scalar(h, f"{a}.attention.kv_lora_rank"),
        "q_lora_rank": _scalar(h, f"{a}.attention.q_lora_rank", None),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": _scalar(h, f"{a}.attention.key_length_mla") - rope,
        "v_head_dim": _scalar(h, f"{a}.attention.value_length_mla"),
    }


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    n = _scalar(h, f"{a}.block_count")
    heads = _scalar(h, f"{a}.attention.head_count")
    layer_types = [LINEAR if kv == 0 else FULL for kv in per_layer(h, f"{a}.attention.head_count_kv", n)]
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": _vocab_size(h, a),
        "hidden_size": _scalar(h, f"{a}.embedding_length"),
        "intermediate_size": _scalar(h, f"{a}.feed_forward_length"),
        "moe_intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", n),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        **mla_config(h, a),
        **moe_config(h, a),
        "norm_topk_prob": True,
        "layer_types": layer_types,
        "linear_num_heads": heads,
        "linear_head_dim": _scalar(h, f"{a}.kda.head_dim"),
        "linear_conv_kernel_dim": _scalar(h, f"{a}.ssm.conv_kernel"),
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": _scalar(h, f"{a}.context_length", 4096),
        "rms_norm_eps": f32(_scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **_token_ids(h),
    }


def globals_map(h: GGUFHeader, config: dict, embed: str = "model.embed_tokens") -> dict[str, str]:
    out = {"token_embd.weight": f"{embed}.weight", "output_norm.weight": "model.norm.weight"}
    if "output.weight" in h.tensors:
        out["output.weight"] = "lm_head.weight"
    return out


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


def moe_map(b: str, p: str, experts: str, gate: str, bias: str) -> dict[str, str]:
    return {
        f"{b}.ffn_gate_inp.weight": f"{p}.gate.weight",
        f"{b}.exp_probs_b.bias": f"{p}.gate.{bias}",
        f"{b}.ffn_gate_exps.weight": f"{p}.{experts}.gate_exps",
        f"{b}.ffn_up_exps.weight": f"{p}.{experts}.up_exps",
        f"{b}.ffn_down_exps.weight": f"{p}.{experts}.down_exps",
        f"{b}.ffn_gate_shexp.weight": f"{p}.shared_experts.gate_proj.weight",
        f"{b}.ffn_up_shexp.weight": f"{p}.shared_experts.up_proj.weight",
        f"{b}.ffn_down_shexp.weight": f"{p}.shared_experts.down_proj.weight",
    }


def dense_map(b: str, p: str) -> dict[str, str]:
    return {f"{b}.ffn_{x}.weight": f"{p}.{x}_proj.weight" for x in ("gate", "up", "down")}


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = globals_map(h, config)
    for i, kind in enumerate(config["layer_types"]):
        b, p = f"blk.{i}", f"model.layers.{i}"
        a = f"{p}.self_attn"
        names |= {f"{b}.attn_norm.weight": f"{p}.input_layernorm.weight",
                  f"{b}.ffn_norm.weight": f"{p}.post_attention_layernorm.weight",
                  f"{b}.attn_output.weight": f"{a}.o_proj.weight"}
        if kind == LINEAR:
            names |= {f"{b}.attn_{x}.weight": f"{a}.{x}_proj.weight" for x in "qkv"}
            names |= {f"{b}.ssm_conv1d_{x}.weight": f"{a}.{x}_conv1d.weight" for x in "qkv"}
            names |= {f"{b}.ssm_f_a.weight": f"{a}.f_a_proj.weight", f"{b}.ssm_f_b.weight": f"{a}.f_b_proj.weight",
                      f"{b}.ssm_g_a.weight": f"{a}.g_a_proj.weight", f"{b}.ssm_g_b.weight": f"{a}.g_b_proj.weight",
                      f"{b}.ssm_beta.weight": f"{a}.b_proj.weight", f"{b}.ssm_a": f"{a}.neg_exp_A_log",
                      f"{b}.ssm_dt.bias": f"{a}.dt_bias", f"{b}.ssm_norm.weight": f"{a}.o_norm.weight"}
        else:
            names |= mla_map(h, b, a)
        if i < config["first_k_dense_replace"]:
            names |= dense_map(b, f"{p}.mlp")
        else:
            names |= moe_map(b, f"{p}.block_sparse_moe", "experts", "gate", "e_score_correction_bias")
    return names


def fuse_kv_b(t: dict[str, torch.Tensor]) -> None:
    """attn_k_b [H, R, nope] (transposed per head) + attn_v_b [H, dv, R] -> kv_b_proj [H * (nope + dv), R]."""
    for name in [n for n in t if n.endswith(".kv_b_proj.k_b")]:
        p = name[: -len(".k_b")]
        k_b, v_b = t.pop(f"{p}.k_b"), t.pop(f"{p}.v_b")
        t[f"{p}.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()


def split_experts(t: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """Stacked ``{p}.gate_exps / up_exps / down_exps`` [E, out, in] -> ``{p}.{e}.<names[kind]>.weight``."""
    for name in [n for n in t if n.endswith(".gate_exps")]:
        p = name[: -len(".gate_exps")]
        for kind, hf in names.items():
            stacked = t.pop(f"{p}.{kind}_exps")
            for e in range(stacked.shape[0]):
                t[f"{p}.{e}.{hf}.weight"] = stacked[e]


def _finish(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    k = config["linear_conv_kernel_dim"]
    for name in [n for n in t if n.endswith("_conv1d.weight")]:
        t[name] = t[name].reshape(-1, 1, k)           # [1, d, 1, K] -> transformers' [d, 1, K]
    fuse_kv_b(t)
    split_experts(t, {"gate": "w1", "down": "w2", "up": "w3"})
    return t


register(ARCH, GGUFArchitecture(
    model_type="kimi_linear",
    build_config=_config,
    layer_tensors={},
    tensor_names=_tensor_names,
    finish=_finish,
))
