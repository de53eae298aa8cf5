"""Gemma 4 (text) from the GGUF layout llama.cpp writes (conversion/gemma.py Gemma4Model, read back
by src/models/gemma4.cpp).

What the file holds and how llama.cpp reads it, which is what this loader rebuilds:

- norms are stored as they are (Gemma 4's RMSNorm multiplies by the plain weight: no ``1 + w``
  shift, unlike Gemma 3), so no tensor is transformed;
- layer kinds: ``attention.sliding_window_pattern`` is one bool per layer (true = sliding);
  head sizes per kind: ``attention.key_length`` (full) and ``key_length_swa`` (sliding); kv heads
  per layer: ``attention.head_count_kv`` (an array when the full layers have their own, as with
  ``attention_k_eq_v``); MLP widths per layer: ``feed_forward_length`` (an array with double-wide
  MLPs on the shared layers);
- KV sharing: ``attention.shared_kv_layers`` = the last n layers own no K/V. llama.cpp gives a
  shared sliding layer the cache of layer ``first_shared - 2`` and a shared full layer that of
  ``first_shared - 1``; turnkv (as transformers) takes the last earlier layer of the same kind.
  The two agree on every released layout; a file where they differ is refused;
- k = v on a full layer: its ``attn_v`` is absent (llama.cpp then uses K as V);
- proportional RoPE on the full layers: ``rope.dimension_count`` is the whole head and
  ``rope_freqs.weight`` holds 1 for the rotated frequency pairs and 1e30 for the others, so the
  partial rotary factor is 2 * (count of ones) / head dim; sliding layers: default RoPE with
  ``rope.freq_base_swa``;
- per-layer embeddings (``embedding_length_per_layer_input`` > 0): ``per_layer_token_embd``,
  ``per_layer_model_proj``, ``per_layer_proj_norm`` and per layer ``inp_gate`` / ``proj`` /
  ``post_norm``; the layer scalar is ``layer_output_scale``;
- the MoE block beside the MLP: router ``ffn_gate_inp`` (+ ``.scale``), per-expert scale
  ``ffn_down_exps.scale``, experts ``ffn_gate_up_exps`` [E, 2I, H] (or gate / up apart) and
  ``ffn_down_exps`` [E, H, I], norms ``pre_ffw_norm_2`` / ``post_ffw_norm_1`` / ``post_ffw_norm_2``.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import GGUFArchitecture
from ..metadata import scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import f32, fuse_gate_up, global_names, per_layer, stop_ids
from .rope_freqs import freq_factors

ARCH = "gemma4"
SLIDING, FULL = "sliding_attention", "full_attention"
# tokens llama.cpp's vocabulary loader ends generation on for Gemma 4 (llama-vocab.cpp special_eog_ids)
EOG_TEXTS = ("<eos>", "<turn|>", "<|tool_response>")
_UNROTATED = 1e29   # rope_freqs entries this large leave a frequency pair unrotated (the converter writes 1e30)


def _rope_freqs(h: GGUFHeader, head_dim: int) -> float:
    """The full layers' partial rotary factor from ``rope_freqs.weight`` (1 = rotated pair,
    1e30 = unrotated); 1.0 when the file has none (every pair rotated)."""
    values = freq_factors(h, head_dim)
    if values is None:
        return 1.0
    rotated = sum(1 for v in values if v == 1.0)
    if any(v != 1.0 and v < _UNROTATED for v in values) or any(v == 1.0 for v in values[rotated:]):
        raise ModelLoadError(
            f"{h.path}: 'rope_freqs.weight' is not Gemma 4's proportional RoPE (leading ones, then 1e30): "
            "frequency scaling on the full layers is not supported"
        )
    return 2 * rotated / head_dim


def _layer_types(h: GGUFHeader, a: str, n: int) -> list[str]:
    pattern = h.get(f"{a}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ModelLoadError(f"{h.path}: '{a}.attention.sliding_window_pattern' must list one bool per layer")
    types = [SLIDING if swa else FULL for swa in pattern]
    if types[-1] != FULL:
        raise ModelLoadError(f"{h.path}: the last Gemma 4 layer is sliding here; transformers and turnkv make it full")
    return types


def _head_sizes(h: GGUFHeader, a: str) -> tuple[int, int]:
    """(full, sliding) head size; refuses what llama.cpp's Gemma 4 graph does not run."""
    head_full = scalar(h, f"{a}.attention.key_length")
    head_swa = scalar(h, f"{a}.attention.key_length_swa")
    if (scalar(h, f"{a}.attention.value_length", head_full), scalar(h, f"{a}.attention.value_length_swa", head_swa)) \
            != (head_full, head_swa):
        raise ModelLoadError(f"{h.path}: Gemma 4 needs key and value head sizes equal (llama.cpp does too)")
    if scalar(h, f"{a}.rope.dimension_count_swa", head_swa) != head_swa:
        raise ModelLoadError(f"{h.path}: partial RoPE on Gemma 4's sliding layers is not supported")
    if scalar(h, f"{a}.rope.dimension_count", head_full) != head_full:
        raise ModelLoadError(f"{h.path}: Gemma 4's full-layer RoPE spans the whole head (rope_freqs mark the rest)")
    if h.metadata.get(f"{a}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"{h.path}: rope scaling on Gemma 4 is not supported")
    return head_full, head_swa


def _check_shared_kv(h: GGUFHeader, types: list[str], shared: int) -> None:
    """Refuses a layout where llama.cpp's shared-KV source layer differs from transformers'."""
    n = len(types)
    first_shared = n - shared
    if not shared:
        return
    if first_shared < 2:
        raise ModelLoadError(f"{h.path}: {shared} shared-KV layers of {n}: llama.cpp needs two owning layers")
    for i in range(first_shared, n):
        ours = max(j for j in range(first_shared) if types[j] == types[i]) \
            if types[i] in types[:first_shared] else None
        theirs = first_shared - (2 if types[i] == SLIDING else 1)
        if ours != theirs:
            raise ModelLoadError(
                f"{h.path}: shared-KV layer {i} ({types[i]}) reads layer {theirs}'s K/V in llama.cpp but "
                f"{ours}'s in transformers (the last earlier {types[i]} layer); this layout is not supported"
            )


def _k_eq_v(h: GGUFHeader, types: list[str], first_shared: int) -> bool:
    """k = v: a full owning layer without attn_v (llama.cpp takes V = K); turnkv does it per kind."""
    no_v = {types[i] for i in range(first_shared) if f"blk.{i}.attn_v.weight" not in h.tensors}
    if SLIDING in no_v:
        raise ModelLoadError(f"{h.path}: a sliding Gemma 4 layer without attn_v (k = v) is not supported")
    k_eq_v = FULL in no_v
    if k_eq_v and any(f"blk.{i}.attn_v.weight" in h.tensors for i in range(first_shared) if types[i] == FULL):
        raise ModelLoadError(f"{h.path}: some full Gemma 4 layers have attn_v and others not")
    return k_eq_v


def _has_moe(h: GGUFHeader, n: int) -> bool:
    moe = [f"blk.{i}.ffn_gate_inp.weight" in h.tensors for i in range(n)]
    if any(moe) and not all(moe):
        raise ModelLoadError(f"{h.path}: Gemma 4 with the MoE block on some layers only is not supported")
    return any(moe)


def build_config(h: GGUFHeader) -> dict:
    a = ARCH
    n = scalar(h, f"{a}.block_count")
    heads = set(per_layer(h, f"{a}.attention.head_count", n))
    if len(heads) != 1:
        raise ModelLoadError(f"{h.path}: Gemma 4 with a per-layer query head count is not supported")
    types = _layer_types(h, a, n)
    head_full, head_swa = _head_sizes(h, a)
    kv = per_layer(h, f"{a}.attention.head_count_kv", n)
    ff = per_layer(h, f"{a}.feed_forward_length", n)
    head_dims = [head_swa if t == SLIDING else head_full for t in types]
    shared = scalar(h, f"{a}.attention.shared_kv_layers", 0)
    _check_shared_kv(h, types, shared)
    k_eq_v = _k_eq_v(h, types, n - shared)
    moe = _has_moe(h, n)
    ple = scalar(h, f"{a}.embedding_length_per_layer_input", 0)
    vocab = vocab_size(h, a)
    config = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": scalar(h, f"{a}.embedding_length"),
        "intermediate_size": min(ff),
        "use_double_wide_mlp": max(ff) != min(ff),
        "num_hidden_layers": n,
        "num_attention_heads": heads.pop(),
        "num_key_value_heads": next((kv[i] for i in range(n) if types[i] == SLIDING), kv[0]),
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "per_layer_config": {str(i): {"head_dim": head_dims[i], "num_key_value_heads": kv[i]} for i in range(n)},
        "attention_k_eq_v": k_eq_v,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": scalar(h, f"{a}.context_length", 131072),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope_parameters(h, a, head_full),
        "sliding_window": scalar(h, f"{a}.attention.sliding_window"),
        "layer_types": types,
        "final_logit_softcapping": h.metadata.get(f"{a}.final_logit_softcapping"),
        "attention_bias": False,   # llama.cpp's Gemma 4 graph has no attention biases
        "hidden_size_per_layer_input": ple,
        "vocab_size_per_layer_input": h.tensors["per_layer_token_embd.weight"].shape[0] if ple else vocab,
        "num_kv_shared_layers": shared,
        "enable_moe_block": moe,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }
    return _finish_config(h, a, config)


def _rope_parameters(h: GGUFHeader, a: str, head_full: int) -> dict:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": float(scalar(h, f"{a}.rope.freq_base_swa", 10_000.0))},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": _rope_freqs(h, head_full),
               "rope_theta": float(scalar(h, f"{a}.rope.freq_base", 1_000_000.0))},
    }


def _finish_config(h: GGUFHeader, a: str, config: dict) -> dict:
    """The softcap as float32, the MoE sizes when the block is there, the end-of-generation ids."""
    if config["final_logit_softcapping"] is not None:
        config["final_logit_softcapping"] = f32(config["final_logit_softcapping"])
    if config["enable_moe_block"]:
        config |= {"num_experts": scalar(h, f"{a}.expert_count"),
                   "top_k_experts": scalar(h, f"{a}.expert_used_count"),
                   "moe_intermediate_size": scalar(h, f"{a}.expert_feed_forward_length")}
    stop_ids(h, config, EOG_TEXTS, keys=())   # the file's eos and the EOG tokens, not its eot / eom ids
    return config


_PLE_GLOBAL = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_KV = {"attn_k.weight": "self_attn.k_proj.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_PLE = {
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
_MOE = {
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = global_names(h)
    if config["hidden_size_per_layer_input"]:
        names |= _PLE_GLOBAL
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    for i in range(config["num_hidden_layers"]):
        b, p = f"blk.{i}", f"model.layers.{i}"
        layer = dict(_LAYER)
        if i < first_shared:
            layer |= _KV
            if config["attention_k_eq_v"] is False or config["layer_types"][i] == SLIDING:
                layer["attn_v.weight"] = "self_attn.v_proj.weight"
        if config["hidden_size_per_layer_input"]:
            layer |= _PLE
        if config["enable_moe_block"]:
            layer |= _MOE
            if f"{b}.ffn_gate_up_exps.weight" in h.tensors:
                layer["ffn_gate_up_exps.weight"] = "experts.gate_up_proj"
            else:   # gate and up stacked apart: fused in ``finish``
                layer |= {"ffn_gate_exps.weight": "experts.gate_stack", "ffn_up_exps.weight": "experts.up_stack"}
        names |= {f"{b}.{g}": f"{p}.{t}" for g, t in layer.items()}
        if f"{b}.layer_output_scale.weight" in h.tensors:
            names[f"{b}.layer_output_scale.weight"] = f"{p}.layer_scalar"
    return names


def finish(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    fuse_gate_up(tensors)   # experts whose gate and up were stacked apart
    return tensors


ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="gemma4_text",
    build_config=build_config,
    layer_tensors={},
    tensor_names=tensor_names,
    finish=finish,
)}
