"""Reading a transformers config out of GGUF metadata: the scalar keys, token ids, vocabulary
size and RoPE entries every family's config builder reads, and the key set of a plain llama-style
decoder."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .reader import GGUFArray, GGUFHeader


def token_ids(h: GGUFHeader) -> dict:
    out = {}
    for gguf_key, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
        ("unknown_token_id", "unk_token_id"),
    ):
        value = h.metadata.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            out[key] = value
    return out


def vocab_size(h: GGUFHeader, arch: str) -> int:
    size = h.metadata.get(f"{arch}.vocab_size")
    if size is None:
        tokens = h.metadata.get("tokenizer.ggml.tokens")
        size = len(tokens) if tokens is not None else h.tensors["token_embd.weight"].shape[0]
    return int(size)


def scalar(h: GGUFHeader, key: str, default: Any = ...) -> Any:
    value = h.get(key, default)
    if isinstance(value, (list, GGUFArray)):
        raise ModelLoadError(f"{h.path}: per-layer values for '{key}' are not supported")
    return value


def rope_scaling(h: GGUFHeader, arch: str) -> dict | None:
    kind = h.metadata.get(f"{arch}.rope.scaling.type")
    factor = h.metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"{h.path}: rope scaling type '{kind}' is not supported")


def default_rope(h: GGUFHeader, arch: str, rope_theta: float, **extra: Any) -> dict:
    """rope_parameters: default RoPE at ``rope_theta`` (with ``extra``, e.g. a partial rotary
    factor), updated by the file's linear scaling if it has one."""
    rope = {"rope_type": "default", "rope_theta": rope_theta, **extra}
    if scaling := rope_scaling(h, arch):
        rope.update(scaling)
    return rope


def llama_style_config(h: GGUFHeader, arch: str, *, model_type: str, architecture: str, layers: int, hidden: int,
                        heads: int, head_dim: int, context: int, eps: float) -> dict:
    """The leading entries of a plain pre-norm SwiGLU decoder's config (llama and the families
    written with its key set): the caller appends its rope, window and token entries."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": vocab_size(h, arch),
        "hidden_size": hidden,
        "intermediate_size": scalar(h, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(h, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": scalar(h, f"{arch}.attention.layer_norm_rms_epsilon", eps),
    }

