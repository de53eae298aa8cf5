"""gpt-oss from the GGUF layout llama.cpp writes (conversion/gpt_oss.py, ``general.architecture``
"gpt-oss", read back by src/models/openai-moe.cpp).

What the file holds and how llama.cpp reads it, which is what this loader rebuilds:

- no q/k permute (NEOX rope), no norm offsets: tensors are the HF values; ``attn_norm`` /
  ``post_attention_norm`` are the two block norms, ``attn_sinks.weight`` the per-head sinks,
  ``ffn_gate_inp`` (weight and bias) the router;
- the experts stacked per projection with their biases: ``ffn_gate_exps`` / ``ffn_up_exps``
  [E, I, H] are the even / odd rows of transformers' ``gate_up_proj`` (stored [E, H, 2I], gate
  and up interleaved by column), ``ffn_down_exps`` [E, H, I] is ``down_proj`` transposed; the
  biases split the same way. Released checkpoints give MXFP4 experts, which the converter repacks
  to ggml's MXFP4 blocks (dequantized at load with the ``gguf`` package's MXFP4 kernel); a float
  source gives float (or, quantized, Q8_0 ...) experts. Either way they are floats by ``finish``;
- layer kinds are not in the file's config: llama.cpp takes sliding layers from
  ``attention.sliding_window_pattern`` (an array, or a period, 2 when absent: even layers slide),
  which is transformers' own default for gpt-oss;
- YaRN: factor, original context and betas are stored; transformers' ``truncate`` is not. The
  released gpt-oss configs set ``truncate: false`` (no rounding of the correction range), which
  is what this loader gives, so the GGUF runs as the HF checkpoint it came from (llama.cpp's ggml
  kernel always rounds it; a small RoPE difference in llama.cpp, not carried over here);
- llama.cpp's clamped SwiGLU constants (alpha 1.702, limit 7.0) are fixed in its code, as in
  transformers' defaults;
- generation ends (llama-vocab.cpp's EOG set for the o200k_harmony vocabulary) on ``<|return|>``,
  ``<|call|>`` and ``<|endoftext|>`` besides the file's eos (``<|end|>`` is not one: it closes a
  message, not the turn) -- the released generation_config.json's eos ids.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import GGUFArchitecture
from ..metadata import scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import attention_shape, check_full_rotary, f32, global_names, rope_base, stop_ids, swa_layers, uniform

ARCH = "gpt-oss"
NAME = "gpt-oss"
DEFAULT_SWA_PERIOD = 2   # load_swa_pattern(ml, 2) in openai-moe.cpp
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0   # llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE
STOP_TEXTS = ("<|return|>", "<|call|>", "<|endoftext|>")


def yarn_rope(h: GGUFHeader, arch: str, rope_theta: float, truncate: bool) -> dict:
    """rope_parameters from the file's rope keys: default, linear or YaRN (the keys
    conversion/base.py writes from transformers' rope_parameters)."""
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    kind = h.metadata.get(f"{arch}.rope.scaling.type")
    factor = h.metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return rope
    if kind == "linear":
        return rope | {"rope_type": "linear", "factor": f32(factor)}
    if kind != "yarn":
        raise ModelLoadError(f"{h.path}: rope scaling type '{kind}' is not supported")
    p = f"{arch}.rope.scaling."
    if h.metadata.get(p + "yarn_log_multiplier", 0.0):
        raise ModelLoadError(f"{h.path}: YaRN with a log multiplier (mscale_all_dim) is not supported for {arch}")
    if h.metadata.get(p + "yarn_ext_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{h.path}: YaRN with an extrapolation factor other than 1 is not supported")
    rope |= {
        "rope_type": "yarn",
        "factor": f32(h.get(p + "factor")),
        "original_max_position_embeddings": h.get(p + "original_context_length"),
        "beta_fast": f32(h.metadata.get(p + "yarn_beta_fast", 32.0)),
        "beta_slow": f32(h.metadata.get(p + "yarn_beta_slow", 1.0)),
        "truncate": truncate,
    }
    if (attention := h.metadata.get(p + "yarn_attn_factor")) is not None:
        rope["attention_factor"] = f32(attention)
    return rope


def build_config(h: GGUFHeader) -> dict:
    a = ARCH
    layers = scalar(h, f"{a}.block_count")
    hidden, heads, head_dim = attention_shape(h, a, NAME)
    check_full_rotary(h, a, head_dim, NAME)
    rope_theta = rope_base(h, a, 150000.0, NAME)
    rope = yarn_rope(h, a, rope_theta, truncate=False)
    window = scalar(h, f"{a}.attention.sliding_window")   # required by llama.cpp too
    sliding = swa_layers(h, a, layers, DEFAULT_SWA_PERIOD)
    config = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": vocab_size(h, a),
        "hidden_size": hidden,
        "intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", layers),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(h, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "num_local_experts": scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": uniform(h, f"{a}.expert_used_count", layers),
        "max_position_embeddings": scalar(h, f"{a}.context_length", 131072),
        "rms_norm_eps": f32(scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": SWIGLU_LIMIT,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }
    stop_ids(h, config, STOP_TEXTS)
    return config


_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    # stacked [E, ...] experts and their biases: held under these names until ``finish``
    "ffn_gate_exps.weight": "mlp.experts.gate_stack",
    "ffn_up_exps.weight": "mlp.experts.up_stack",
    "ffn_down_exps.weight": "mlp.experts.down_stack",
    "ffn_gate_exps.bias": "mlp.experts.gate_stack_bias",
    "ffn_up_exps.bias": "mlp.experts.up_stack_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
_BIASED = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj"}


def tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = global_names(h)
    for i in range(config["num_hidden_layers"]):
        b, p = f"blk.{i}", f"model.layers.{i}"
        names.update({f"{b}.{g}": f"{p}.{t}" for g, t in _LAYER.items()})
        if config["attention_bias"]:
            names.update({f"{b}.{g}.bias": f"{p}.{t}.bias" for g, t in _BIASED.items()})
    return names


def interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of the converter's ``[..., ::2]`` / ``[..., 1::2]`` split along ``dim``."""
    out = torch.stack([gate, up], dim=dim + 1)
    return out.flatten(dim, dim + 1)


def finish(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The experts as transformers holds them: ``gate_up_proj`` [E, H, 2I] (gate, up interleaved
    by column) with its [E, 2I] bias, ``down_proj`` [E, I, H]. Experts kept in GGUF blocks keep
    the file's [out, in] rows instead: ``gate_up_stack`` [E, 2I, H] (gate rows, then up rows) and
    ``down_stack`` [E, H, I] (models/gpt_oss.py reads either)."""
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        gate_b, up_b = tensors.pop(f"{p}.gate_stack_bias"), tensors.pop(f"{p}.up_stack_bias")   # [E, I]
        tensors[f"{p}.gate_up_proj_bias"] = interleave(gate_b, up_b, 1)
        if isinstance(tensors[f"{p}.down_stack"], torch.Tensor):
            tensors[f"{p}.down_proj"] = tensors.pop(f"{p}.down_stack").transpose(1, 2).contiguous()  # [E, I, H]
        gate, up = tensors.pop(f"{p}.gate_stack"), tensors.pop(f"{p}.up_stack")           # [E, I, H]
        if isinstance(gate, torch.Tensor) or isinstance(up, torch.Tensor) or gate.qtype != up.qtype:
            gate, up = (w if isinstance(w, torch.Tensor) else w.dequantize() for w in (gate, up))
            tensors[f"{p}.gate_up_proj"] = interleave(gate, up, 1).transpose(1, 2).contiguous()
        else:
            tensors[f"{p}.gate_up_stack"] = type(gate).cat_rows([gate, up])
    return tensors


ARCHITECTURES = {ARCH: GGUFArchitecture(
    model_type="gpt_oss",
    build_config=build_config,
    layer_tensors={},
    tensor_names=tensor_names,
    finish=finish,
)}
