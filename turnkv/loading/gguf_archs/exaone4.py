"""EXAONE 4 from llama.cpp's ``exaone4`` GGUF layout (conversion/exaone.py ``Exaone4Model``).

The converter writes the plain llama-style names (no q/k permute: it is not a LlamaModel), the
post-norms as ``post_attention_norm`` / ``post_ffw_norm``, QK-norms as ``attn_q_norm`` /
``attn_k_norm``, the window as ``attention.sliding_window`` with ``attention.sliding_window_pattern``
one bool per layer (True = sliding, from ``layer_types``), and Llama 3 rope scaling as
``rope_freqs.weight``. With a window the global layers are NoPE (turnkv.models.exaone4).

llama.cpp itself switches the window on only for 64-layer files (EXAONE 4.0 32B) and reads the
per-layer array there (default: every 4th layer global); the array is what the converter wrote
from the model's own ``layer_types``, so it is used for any depth here, as transformers runs the
HF folder. EXAONE 4.5's multi-token-prediction blocks (``nextn_predict_layers``) are skipped.
"""

from __future__ import annotations

from ..errors import ModelLoadError
from ..gguf import GGUFArchitecture, GGUFArray, GGUFHeader, _rope_scaling, _scalar, _token_ids, _vocab_size, register
from .rope_freqs import freq_factors, llama3_rope

ARCH = "exaone4"
DEFAULT_SWA_PATTERN = 4  # llama.cpp's load_swa_pattern(ml, 4) when the file has no array

_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _layer_types(h: GGUFHeader, layers: int, window: int | None) -> list[str]:
    if window is None:
        return ["full_attention"] * layers
    key = f"{ARCH}.attention.sliding_window_pattern"
    pattern = h.metadata.get(key, DEFAULT_SWA_PATTERN)
    if isinstance(pattern, GGUFArray):
        raise ModelLoadError(f"{h.path}: '{key}' has {len(pattern)} entries for {layers} layers")
    if isinstance(pattern, list):
        if len(pattern) < layers:
            raise ModelLoadError(f"{h.path}: '{key}' has {len(pattern)} entries for {layers} layers")
        return ["sliding_attention" if s else "full_attention" for s in pattern[:layers]]
    n = int(pattern)  # llama_hparams::set_swa_pattern
    return ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)]


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    hidden = _scalar(h, f"{a}.embedding_length")
    heads = _scalar(h, f"{a}.attention.head_count")
    head_dim = _scalar(h, f"{a}.attention.key_length", hidden // heads)
    layers = _scalar(h, f"{a}.block_count") - int(_scalar(h, f"{a}.nextn_predict_layers", 0))
    window = _scalar(h, f"{a}.attention.sliding_window", None)
    rope_theta = float(_scalar(h, f"{a}.rope.freq_base", 10000.0))
    swa_theta = h.metadata.get(f"{a}.rope.freq_base_swa")
    if swa_theta is not None and float(swa_theta) != rope_theta:
        raise ModelLoadError(
            f"{h.path}: a separate sliding-layer rope base ({swa_theta}) is not supported for EXAONE 4")
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if (factors := freq_factors(h, head_dim)) is not None:
        rope.update(llama3_rope(factors, head_dim, rope_theta))
    elif scaling := _rope_scaling(h, a):
        rope.update(scaling)
    return {
        "model_type": "exaone4",
        "architectures": ["Exaone4ForCausalLM"],
        "vocab_size": _vocab_size(h, a),
        "hidden_size": hidden,
        "intermediate_size": _scalar(h, f"{a}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(h, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _scalar(h, f"{a}.context_length", 4096),
        "rms_norm_eps": _scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "sliding_window": window,
        "sliding_window_pattern": None,
        "layer_types": _layer_types(h, layers, window),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **_token_ids(h),
    }


register(ARCH, GGUFArchitecture(model_type="exaone4", build_config=_config, layer_tensors=_LAYER))
