"""llama's GGUF layout: the config (with Llama 3 rope scaling read back from ``rope_freqs``) and
the reversal of the converter's q/k row permutation."""

from __future__ import annotations

import torch

from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, GGUFArchitecture
from ..metadata import default_rope, llama_style_config, scalar, token_ids
from ..reader import GGUFHeader
from .rope_freqs import freq_factors, llama3_rope

ARCH = "llama"

LAYER = {
    "attn_norm": "input_layernorm",
    **ATTN_PROJ_TENSORS,
    "ffn_norm": "post_attention_layernorm",
    **GATED_MLP_TENSORS,
}


def _config(h: GGUFHeader) -> dict:
    a = "llama"
    hidden = scalar(h, f"{a}.embedding_length")
    heads = scalar(h, f"{a}.attention.head_count")
    head_dim = scalar(h, f"{a}.rope.dimension_count", hidden // heads)
    rope_theta = float(scalar(h, f"{a}.rope.freq_base", 10000.0))
    rope = default_rope(h, a, rope_theta)
    # Llama 3.1+ / 3.2: the converter writes rope_type llama3 as per-dimension divisors
    if (factors := freq_factors(h, head_dim)) is not None:
        rope = {"rope_theta": rope_theta, **llama3_rope(factors, head_dim, rope_theta)}
    return {
        **llama_style_config(
            h, a, model_type="llama", architecture="LlamaForCausalLM", layers=scalar(h, f"{a}.block_count"),
            hidden=hidden, heads=heads, head_dim=head_dim,
            context=scalar(h, f"{a}.context_length", 2048), eps=1e-6),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


def reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # Undo convert_hf_to_gguf.py's LlamaModel.permute (rotary halves interleaved per head).
    # A permutation of whole rows: it applies as well to raw quantized rows (uint8 [N, row_bytes]).
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return reverse_permute(w, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return reverse_permute(w, config["num_key_value_heads"])
    return w


LLAMA = GGUFArchitecture(
    model_type="llama",
    build_config=_config,
    layer_tensors=LAYER,
    transform=_transform,
    needs_transform=lambda name: ".self_attn.q_proj." in name or ".self_attn.k_proj." in name,
    transform_permutes_rows=True,
)

ARCHITECTURES = {ARCH: LLAMA}
