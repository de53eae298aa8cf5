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

from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import llama_style_config, rope_scaling, scalar, token_ids
from ..reader import GGUFHeader
from .common import attention_shape, rope_base, swa_layers
from .rope_freqs import freq_factors, llama3_rope

ARCH = "exaone4"
NAME = "EXAONE 4"
DEFAULT_SWA_PATTERN = 4  # llama.cpp's load_swa_pattern(ml, 4) when the file has no array

_LAYER = {
    **ATTN_PROJ_TENSORS,
    **QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **GATED_MLP_TENSORS,
}


def _layer_types(h: GGUFHeader, layers: int, window: int | None) -> list[str]:
    if window is None:
        return ["full_attention"] * layers
    return ["sliding_attention" if s else "full_attention" for s in swa_layers(h, ARCH, layers, DEFAULT_SWA_PATTERN)]


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    hidden, heads, head_dim = attention_shape(h, a, NAME)
    layers = scalar(h, f"{a}.block_count") - int(scalar(h, f"{a}.nextn_predict_layers", 0))
    window = scalar(h, f"{a}.attention.sliding_window", None)
    rope_theta = rope_base(h, a, 10000.0, NAME)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if (factors := freq_factors(h, head_dim)) is not None:
        rope.update(llama3_rope(factors, head_dim, rope_theta))
    elif scaling := rope_scaling(h, a):
        rope.update(scaling)
    return {
        **llama_style_config(h, a, model_type="exaone4", architecture="Exaone4ForCausalLM", layers=layers,
                              hidden=hidden, heads=heads, head_dim=head_dim,
                              context=scalar(h, f"{a}.context_length", 4096), eps=1e-5),
        "sliding_window": window,
        "sliding_window_pattern": None,
        "layer_types": _layer_types(h, layers, window),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


ARCHITECTURES = {ARCH: GGUFArchitecture(model_type="exaone4", build_config=_config, layer_tensors=_LAYER)}
