"""Qwen 3.5 text, dense (``qwen35``) and MoE (``qwen35moe``), as llama.cpp's converter writes them
(conversion/qwen.py: Qwen3_5TextModel / Qwen3_5MoeTextModel over _LinearAttentionVReorderBase and
Qwen3NextModel), read back as src/models/qwen35.cpp / qwen35moe.cpp read them.

What the converter does and how it is undone here:

- the trunk is ``block_count - nextn_predict_layers`` blocks; one MTP block after it (the converter
  counts it in ``block_count``: a full-attention block ``blk.{n}.*`` and ``blk.{n}.nextn.*``: ``fc`` is
  ``eh_proj``, ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` are ``enorm`` / ``hnorm``
  / ``shared_head_norm``) is read back under transformers' ``mtp.*`` names (models/mtp.py, the
  ``--speculative mtp`` drafter); an MTP-only file (no ``blk.0.attn_norm``) is refused;
- layer kinds: ``attention.recurrent_layers`` (an array, true on the gated delta-net layers), else
  every ``full_attention_interval``-th layer (4 when absent) is full attention, as llama.cpp's loader;
- every RMSNorm weight but the delta-net's output norm (``ssm_norm``) is stored as ``1 + w``
  (transformers keeps ``w`` and scales by ``1 + w``): 1 is subtracted (exact: the model adds it back);
- ``A_log`` is stored as ``-exp(A_log)`` (``ssm_a``) and ``dt_bias`` as ``ssm_dt.bias``;
  ``conv1d`` is squeezed to ``[channels, kernel]``;
- with fewer key heads than value heads, the value heads are reordered from grouped by key head
  (transformers) to tiled (ggml's broadcast): the V rows of ``attn_qkv`` (``in_proj_qkv``) and of
  the ``ssm_conv1d`` channels, the rows of ``attn_gate`` (``in_proj_z``), ``ssm_beta`` / ``ssm_alpha``
  (``in_proj_b`` / ``in_proj_a``), the entries of ``ssm_a`` / ``ssm_dt``, and the columns of
  ``ssm_out`` (``out_proj``). With every delta-net projection read as floats they are put back in
  grouped order (``finish``): the model is then the HF folder's, bit for bit. When some stay
  quantized (``--weights gguf``) nothing is reordered and the config says
  ``linear_value_heads_tiled``: the model runs its value heads in the file's order (value head
  ``j * nk + g`` reads key head ``g``, as llama.cpp's graph), the same computation with the heads
  numbered otherwise (``ssm_out``'s sums then run in another order), so no projection has to be
  dequantized for a column reorder;
- the full-attention ``attn_q`` is transformers' ``q_proj`` as is (query | gate per head), no
  permute (NeoX-style rotary); a ``--fuse-qkv`` file's ``attn_qkv`` on those layers is split back;
- MoE: the router ``ffn_gate_inp``, experts stacked ``ffn_{gate,up,down}_exps`` [E, out, in] (or
  ``ffn_gate_up_exps``), the shared expert ``ffn_*_shexp`` and its sigmoid gate
  ``ffn_gate_inp_shexp``; llama.cpp routes with a softmax and renormalises the top-k, as the model.

Rotary: ``rope.dimension_count`` over ``attention.key_length`` is the partial rotary factor; the
interleaved M-RoPE sections do not matter for text (every axis has the token's position).
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import GATED_MLP_TENSORS, GGUFArchitecture
from ..metadata import default_rope, scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import f32, fuse_gate_up, global_names, layer_weights, uniform

LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_FULL_ATTENTION_INTERVAL = 4   # llama.cpp's default when the file has neither key

# transformers names whose GGUF values are stored as (1 + w)
_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                  ".self_attn.k_norm.weight")
_FUSED_QKV = ".self_attn.qkv_proj.weight"
MTP_LAYER = "mtp.layers.0"
# the MTP block's own tensors (llama.cpp's converter: fc -> eh_proj, pre_fc_norm_embedding -> enorm,
# pre_fc_norm_hidden -> hnorm, norm -> shared_head.norm); its norms are stored as (1 + w) too
_NEXTN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
          "shared_head_norm": "norm"}   # a --fuse-qkv file's full-attention attn_qkv (split in finish)


def _layer_types(h: GGUFHeader, a: str, n: int) -> list[str]:
    recurrent = h.metadata.get(f"{a}.attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < n:
            raise ModelLoadError(f"{h.path}: '{a}.attention.recurrent_layers' does not cover the {n} layers")
        return [LINEAR if r else FULL for r in recurrent[:n]]
    interval = scalar(h, f"{a}.full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    return [LINEAR if (i + 1) % interval else FULL for i in range(n)]


def _config(h: GGUFHeader, moe: bool) -> dict:
    a = h.architecture
    total = scalar(h, f"{a}.block_count")
    n = total - scalar(h, f"{a}.nextn_predict_layers", 0)
    if n <= 0 or "blk.0.attn_norm.weight" not in h.tensors:
        raise ModelLoadError(f"{h.path}: an MTP-only Qwen 3.5 file (no decoder layers) cannot be run on its own")
    heads = scalar(h, f"{a}.attention.head_count")
    head_dim = scalar(h, f"{a}.attention.key_length")
    if scalar(h, f"{a}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{h.path}: attention key and value head sizes differ")
    v_heads = scalar(h, f"{a}.ssm.time_step_rank")
    rope_theta = float(scalar(h, f"{a}.rope.freq_base", 10000.0))
    partial = scalar(h, f"{a}.rope.dimension_count", head_dim // 4) / head_dim
    rope = default_rope(h, a, rope_theta, partial_rotary_factor=partial)
    scale = h.metadata.get(f"{a}.expert_weights_scale", 1.0)
    if moe and scale not in (0.0, 1.0):
        raise ModelLoadError(f"{h.path}: expert_weights_scale {scale} is not supported")
    first_full = next((f"blk.{i}" for i, t in enumerate(_layer_types(h, a, n)) if t == FULL), None)
    config = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": scalar(h, f"{a}.embedding_length"),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": uniform(h, f"{a}.attention.head_count_kv", n, heads),
        "head_dim": head_dim,
        "linear_conv_kernel_dim": scalar(h, f"{a}.ssm.conv_kernel"),
        "linear_key_head_dim": scalar(h, f"{a}.ssm.state_size"),
        "linear_value_head_dim": scalar(h, f"{a}.ssm.inner_size") // v_heads,
        "linear_num_key_heads": scalar(h, f"{a}.ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "layer_types": _layer_types(h, a, n),
        "full_attention_interval": scalar(h, f"{a}.full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL),
        "hidden_act": "silu",
        "attention_bias": first_full is not None and (f"{first_full}.attn_q.bias" in h.tensors
                                                      or f"{first_full}.attn_qkv.bias" in h.tensors),
        "max_position_embeddings": scalar(h, f"{a}.context_length", 262144),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        # one MTP block with its tensors (a --no-mtp file counts it but has none): loaded as the drafter
        "mtp_num_hidden_layers": int(total - n == 1 and f"blk.{n}.nextn.eh_proj.weight" in h.tensors),
        **token_ids(h),
    }
    if moe:
        experts = scalar(h, f"{a}.expert_count")
        up = h.tensors.get("blk.0.ffn_up_shexp.weight")
        config |= {
            "num_experts": experts,
            "num_experts_per_tok": scalar(h, f"{a}.expert_used_count"),
            "moe_intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", n),
            "shared_expert_intermediate_size": scalar(h, f"{a}.expert_shared_feed_forward_length",
                                                       up.shape[0] if up is not None else 0),
        }
    else:
        config["intermediate_size"] = uniform(h, f"{a}.feed_forward_length", n)
    return config


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = global_names(h)
    for i, kind in enumerate(config["layer_types"]):
        names |= _layer_names(h, config, f"blk.{i}", f"model.layers.{i}", kind)
    if config.get("mtp_num_hidden_layers"):     # the MTP block after the trunk (models/mtp.py)
        b = f"blk.{config['num_hidden_layers']}"
        names |= _layer_names(h, config, b, MTP_LAYER, FULL)
        names |= {f"{b}.nextn.{g}.weight": f"mtp.{t}.weight" for g, t in _NEXTN.items()}
    return names


def _layer_names(h: GGUFHeader, config: dict, b: str, p: str, kind: str) -> dict[str, str]:
    """GGUF -> transformers names of one decoder layer (GGUF prefix ``b``, transformers ``p``)."""
    moe = config["model_type"] == "qwen3_5_moe_text"
    names = {f"{b}.attn_norm.weight": f"{p}.input_layernorm.weight",
             f"{b}.post_attention_norm.weight": f"{p}.post_attention_layernorm.weight"}
    if kind == LINEAR:
        la = f"{p}.linear_attn"
        names |= {f"{b}.attn_qkv.weight": f"{la}.in_proj_qkv.weight",
                  f"{b}.attn_gate.weight": f"{la}.in_proj_z.weight",
                  f"{b}.ssm_beta.weight": f"{la}.in_proj_b.weight",
                  f"{b}.ssm_alpha.weight": f"{la}.in_proj_a.weight",
                  f"{b}.ssm_conv1d.weight": f"{la}.conv1d.weight", f"{b}.ssm_a": f"{la}.A_log",
                  f"{b}.ssm_dt.bias": f"{la}.dt_bias", f"{b}.ssm_norm.weight": f"{la}.norm.weight",
                  f"{b}.ssm_out.weight": f"{la}.out_proj.weight"}
    else:
        sa = f"{p}.self_attn"
        names |= {f"{b}.attn_output.weight": f"{sa}.o_proj.weight",
                  f"{b}.attn_q_norm.weight": f"{sa}.q_norm.weight",
                  f"{b}.attn_k_norm.weight": f"{sa}.k_norm.weight"}
        parts = ("q", "k", "v") if f"{b}.attn_q.weight" in h.tensors else ("qkv",)
        for x in parts:
            names[f"{b}.attn_{x}.weight"] = f"{sa}.{x}_proj.weight"
            if config["attention_bias"]:
                names[f"{b}.attn_{x}.bias"] = f"{sa}.{x}_proj.bias"
        if config["attention_bias"]:
            names[f"{b}.attn_output.bias"] = f"{sa}.o_proj.bias"
    m = f"{p}.mlp"
    if moe:
        names |= {f"{b}.ffn_gate_inp.weight": f"{m}.gate.weight",
                  f"{b}.ffn_down_exps.weight": f"{m}.experts.down_proj",
                  f"{b}.ffn_gate_inp_shexp.weight": f"{m}.shared_expert_gate.weight"}
        if f"{b}.ffn_gate_up_exps.weight" in h.tensors:
            names[f"{b}.ffn_gate_up_exps.weight"] = f"{m}.experts.gate_up_proj"
        else:
            names |= {f"{b}.ffn_gate_exps.weight": f"{m}.experts.gate_exps",
                      f"{b}.ffn_up_exps.weight": f"{m}.experts.up_exps"}
        names |= {f"{b}.ffn_{x}_shexp.weight": f"{m}.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
    else:
        names |= layer_weights(b, p, GATED_MLP_TENSORS)
    return names


_TOP_NORMS = {"model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"}


def _is_norm(name: str) -> bool:
    return name in _TOP_NORMS or name.endswith(_NORM_SUFFIXES)


def _needs_transform(name: str) -> bool:
    return _is_norm(name) or name.endswith((".linear_attn.A_log", ".linear_attn.conv1d.weight", _FUSED_QKV))


def _transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    if _is_norm(name):
        return w - 1
    if name.endswith(".A_log"):
        return torch.log(-w)
    if name.endswith(".conv1d.weight"):
        return w.reshape(w.shape[0], 1, -1)   # squeezed [channels, kernel] -> transformers' [channels, 1, kernel]
    return w   # a --fuse-qkv attn_qkv: only dequantized here (a fused tensor), split in _finish


_DELTA_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def _untile(w: torch.Tensor, dim: int, k_heads: int, per_k: int, head: int) -> torch.Tensor:
    """Undo the converter's _reorder_v_heads along ``dim``: tiled [per_k, k_heads, head] -> grouped
    [k_heads, per_k, head]."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], per_k, k_heads, head, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape).contiguous()


def _value_heads(t: dict[str, torch.Tensor], config: dict) -> None:
    """Put the delta-net's value heads back in transformers' grouped order, or, when any of its
    projections stayed quantized (not in ``t``), leave the file's tiled order and say so in the
    config (the model's ``linear_value_heads_tiled``)."""
    layers = [f"model.layers.{i}.linear_attn" for i, k in enumerate(config["layer_types"]) if k == LINEAR]
    if any(f"{p}.{w}.weight" not in t for p in layers for w in _DELTA_PROJECTIONS):
        config["linear_value_heads_tiled"] = True
        return
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk, dv, r = 2 * nk * config["linear_key_head_dim"], config["linear_value_head_dim"], nv // nk
    for p in layers:
        for name in (f"{p}.in_proj_qkv.weight", f"{p}.conv1d.weight"):   # the V rows / channels only
            t[name] = torch.cat([t[name][:qk], _untile(t[name][qk:], 0, nk, r, dv)])
        t[f"{p}.in_proj_z.weight"] = _untile(t[f"{p}.in_proj_z.weight"], 0, nk, r, dv)
        for name in (f"{p}.in_proj_b.weight", f"{p}.in_proj_a.weight", f"{p}.A_log", f"{p}.dt_bias"):
            t[name] = _untile(t[name], 0, nk, r, 1)
        t[f"{p}.out_proj.weight"] = _untile(t[f"{p}.out_proj.weight"], 1, nk, r, dv)


def _finish(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    _value_heads(t, config)
    fuse_gate_up(t, "gate_exps", "up_exps")
    for name in [n for n in t if n.endswith(".shared_expert_gate.weight")]:
        t[name] = t[name].reshape(1, -1)
    d, hq, hk = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    for name in [n for n in t if ".self_attn.qkv_proj." in n]:
        p, kind = name.rsplit(".qkv_proj.", 1)
        q, k, v = t.pop(name).split([2 * hq * d, hk * d, hk * d])
        t |= {f"{p}.q_proj.{kind}": q, f"{p}.k_proj.{kind}": k, f"{p}.v_proj.{kind}": v}
    return t


def _architecture(moe: bool) -> GGUFArchitecture:
    return GGUFArchitecture(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        build_config=lambda h: _config(h, moe),
        layer_tensors={},
        tensor_names=_tensor_names,
        transform=_transform,
        needs_transform=_needs_transform,
        finish=_finish,
    )


ARCHITECTURES = {"qwen35": _architecture(False), "qwen35moe": _architecture(True)}
