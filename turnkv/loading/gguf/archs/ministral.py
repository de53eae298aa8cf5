"""Ministral 3 from llama.cpp's ``mistral3`` GGUF layout (conversion/mistral3.py).

The converter registers ``Ministral3ForCausalLM`` and ``Mistral3ForConditionalGeneration`` (its
text model; the vision tower goes to a separate mmproj file) as ``mistral3``, through its
LlamaModel: llama names, q/k rows permuted (undone here as for llama), YaRN as
``rope.scaling.*`` keys with ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier`` and the
Llama 4 query scale beta as ``attention.temperature_scale``. It does not write ``mscale``
(llama.cpp takes 1.0, as here) nor a sliding window (llama.cpp's mistral3 graph attends over the
full context on every layer, as here). Mistral-format conversions (conversion/mistral.py,
``llama_4_scaling`` models) skip the permute because Mistral's own checkpoints already hold the
rows in llama.cpp's order: the same file layout.

A mistral3 file without YaRN or a temperature scale (Mistral Small 3.x text) is a plain
pre-norm GQA decoder and runs as ``ministral3`` without either. ``MinistralForCausalLM``
(model_type ``ministral``, Ministral 8B with per-layer windows) has no converter class in
llama.cpp: no GGUF layout to read. Mistral 4 (``mistral4``) and mistral3 MoE files are refused.
"""

from __future__ import annotations

import dataclasses

from ...errors import ModelLoadError
from ..metadata import llama_style_config, scalar, token_ids
from ..reader import GGUFHeader
from .llama import LLAMA
from .rope_freqs import freq_factors, llama3_rope

ARCH = "mistral3"


def _rope(h: GGUFHeader, head_dim: int, n_ctx: int) -> dict:
    a = ARCH
    rope_theta = float(scalar(h, f"{a}.rope.freq_base", 10000.0))
    rope: dict = {"rope_type": "default", "rope_theta": rope_theta}
    kind = h.metadata.get(f"{a}.rope.scaling.type")
    factor = h.metadata.get(f"{a}.rope.scaling.factor")
    # llama.cpp: n_ctx_orig_yarn = rope.scaling.original_context_length, else the training context
    orig = int(scalar(h, f"{a}.rope.scaling.original_context_length", n_ctx))
    if (factors := freq_factors(h, head_dim)) is not None:
        rope.update(llama3_rope(factors, head_dim, rope_theta))
    elif kind == "yarn":
        ext = h.metadata.get(f"{a}.rope.scaling.yarn_ext_factor")
        if ext is not None and float(ext) != 1.0:
            raise ModelLoadError(f"{h.path}: YaRN extrapolation factor {ext} is not supported")
        rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=orig,
                    max_position_embeddings=n_ctx,
                    beta_fast=float(scalar(h, f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(scalar(h, f"{a}.rope.scaling.yarn_beta_slow", 1.0)))
        if (log_mul := h.metadata.get(f"{a}.rope.scaling.yarn_log_multiplier")) not in (None, 0.0):
            rope.update(mscale=1.0, mscale_all_dim=float(log_mul))  # llama.cpp assumes mscale == 1
        if (attn := h.metadata.get(f"{a}.rope.scaling.yarn_attn_factor")) is not None:
            rope["attention_factor"] = float(attn)
    elif kind == "linear" and factor not in (None, 1.0):
        rope.update(rope_type="linear", factor=float(factor))
    elif kind not in (None, "none", "linear"):
        raise ModelLoadError(f"{h.path}: rope scaling type '{kind}' is not supported for mistral3")
    beta = h.metadata.get(f"{a}.attention.temperature_scale")
    if beta not in (None, 0.0):
        # the Llama 4 query scale: 1 + beta * log(1 + floor(pos / n_ctx_orig_yarn))
        rope.update(llama_4_scaling_beta=float(beta), original_max_position_embeddings=orig)
    return rope


def _config(h: GGUFHeader) -> dict:
    a = ARCH
    if h.metadata.get(f"{a}.expert_count"):
        raise ModelLoadError(f"{h.path}: mixture-of-experts mistral3 files are not supported")
    if h.metadata.get(f"{a}.attention.scale"):
        raise ModelLoadError(f"{h.path}: a custom attention scale is not supported for mistral3")
    if biases := sorted(n for n in h.tensors if n.startswith("blk.") and n.endswith(".bias")):
        raise ModelLoadError(f"{h.path}: bias tensors ({biases[0]}, ...) are not supported for mistral3")
    hidden = scalar(h, f"{a}.embedding_length")
    heads = scalar(h, f"{a}.attention.head_count")
    head_dim = scalar(h, f"{a}.attention.key_length", None) or scalar(h, f"{a}.rope.dimension_count",
                                                                         hidden // heads)
    rot = scalar(h, f"{a}.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ModelLoadError(f"{h.path}: partial rotary ({rot} of {head_dim} dims) is not supported for mistral3")
    n_ctx = int(scalar(h, f"{a}.context_length", 32768))
    rope = _rope(h, head_dim, n_ctx)
    return {
        **llama_style_config(h, a, model_type="ministral3", architecture="Ministral3ForCausalLM",
                              layers=scalar(h, f"{a}.block_count"), hidden=hidden, heads=heads, head_dim=head_dim,
                              context=n_ctx, eps=1e-5),
        "sliding_window": None,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


# llama's tensor names and q/k un-permute, with this config
ARCHITECTURES = {ARCH: dataclasses.replace(LLAMA, model_type="ministral3", build_config=_config)}
