"""LFM2 from llama.cpp's ``lfm2`` GGUF layout (conversion/lfm2.py ``LFM2Model``): the text model of
LFM2 and of LFM2-VL (whose tower comes from its mmproj, loading/gguf/mmproj/lfm2.py).

A layer is a short convolution (``shortconv.conv`` squeezed to [hidden, L], ``in_proj``,
``out_proj``) or attention (q/k/v/output with per-head ``attn_q_norm`` / ``attn_k_norm``, NeoX RoPE,
no permute); which one is ``attention.head_count_kv`` per layer (0 = conv). The MLP width is the
one the converter already adjusted (``block_auto_adjust_ff_dim`` applied), and the final norm is
``token_embd_norm`` (transformers' ``embedding_norm``).
"""

from __future__ import annotations

from ...errors import ModelLoadError
from ..architecture import GGUFArchitecture
from ..metadata import default_rope, scalar, token_ids, vocab_size
from ..reader import GGUFArray, GGUFHeader
from .common import f32

ARCH = "lfm2"
_CONV = {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"}
_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
         "attn_k_norm": "self_attn.k_layernorm"}
_COMMON = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "ffn_gate": "feed_forward.w1",
           "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}


def _kv_heads(h: GGUFHeader) -> list[int]:
    n = scalar(h, f"{ARCH}.block_count")
    value = h.get(f"{ARCH}.attention.head_count_kv")
    kv = list(value) if isinstance(value, (list, GGUFArray)) else [value] * n
    if len(kv) != n or len({k for k in kv if k}) > 1:
        raise ModelLoadError(f"{h.path}: '{ARCH}.attention.head_count_kv' must give one count for the attention "
                             f"layers and 0 for the conv layers ({kv})")
    return kv


def _config(h: GGUFHeader) -> dict:
    kv = _kv_heads(h)
    if scalar(h, f"{ARCH}.rope.dimension_count", None) not in (None, scalar(h, f"{ARCH}.embedding_length")
                                                                // scalar(h, f"{ARCH}.attention.head_count")):
        raise ModelLoadError(f"{h.path}: partial rotary LFM2 files are not supported")
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "vocab_size": vocab_size(h, ARCH),
        "hidden_size": scalar(h, f"{ARCH}.embedding_length"),
        "intermediate_size": scalar(h, f"{ARCH}.feed_forward_length"),
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": len(kv),
        "num_attention_heads": scalar(h, f"{ARCH}.attention.head_count"),
        "num_key_value_heads": max(kv),
        "layer_types": ["full_attention" if k else "conv" for k in kv],
        "conv_L_cache": scalar(h, f"{ARCH}.shortconv.l_cache", 3),
        "conv_bias": "blk.0.shortconv.in_proj.bias" in h.tensors,
        "norm_eps": f32(scalar(h, f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": scalar(h, f"{ARCH}.context_length", 128000),
        "rope_parameters": default_rope(h, ARCH, float(scalar(h, f"{ARCH}.rope.freq_base", 1000000.0))),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = {"token_embd.weight": "model.embed_tokens.weight", "token_embd_norm.weight": "model.embedding_norm.weight"}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i, kind in enumerate(config["layer_types"]):
        table = {**(_ATTN if kind == "full_attention" else _CONV), **_COMMON}
        for g, t in table.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{t}.weight"
            if f"blk.{i}.{g}.bias" in h.tensors:
                names[f"blk.{i}.{g}.bias"] = f"model.layers.{i}.{t}.bias"
    return names


ARCHITECTURES = {ARCH: GGUFArchitecture(model_type="lfm2", build_config=_config, layer_tensors={},
                                        tensor_names=_tensor_names)}
