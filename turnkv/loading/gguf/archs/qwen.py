"""Qwen 2 / 2.5 and Qwen 3 dense from llama.cpp's ``qwen2`` / ``qwen3`` GGUF layouts
(conversion/qwen.py ``Qwen2Model``, ``Qwen3Model``): llama's tensor names without its q/k row
permutation (llama.cpp runs them with NEOX RoPE, as transformers does), q/k/v biases for Qwen 2,
``attn_q_norm`` / ``attn_k_norm`` for Qwen 3. Both run on turnkv.models.llama."""

from __future__ import annotations

from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import default_rope, llama_style_config, scalar, token_ids
from ..reader import GGUFHeader
from .common import attention_shape, check_full_rotary, rope_base

_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _architecture(arch: str, name: str, hf_class: str, qk_norm: bool) -> GGUFArchitecture:
    def config(h: GGUFHeader) -> dict:
        hidden, heads, head_dim = attention_shape(h, arch, name)
        check_full_rotary(h, arch, head_dim, name)
        rope_theta = rope_base(h, arch, 1_000_000.0, name)
        return {
            **llama_style_config(h, arch, model_type=arch, architecture=hf_class,
                                 layers=scalar(h, f"{arch}.block_count"), hidden=hidden, heads=heads,
                                 head_dim=head_dim, context=scalar(h, f"{arch}.context_length", 32768), eps=1e-6),
            "rope_theta": rope_theta,
            "rope_parameters": default_rope(h, arch, rope_theta),
            "attention_bias": False,         # Qwen 2's q/k/v biases come with its model_type
            "use_sliding_window": False,     # llama.cpp attends to the full context for both
            "tie_word_embeddings": "output.weight" not in h.tensors,
            **token_ids(h),
        }

    layer = {**_NORMS, **ATTN_PROJ_TENSORS, **(QK_NORM_TENSORS if qk_norm else {}), **GATED_MLP_TENSORS}
    return GGUFArchitecture(model_type=arch, build_config=config, layer_tensors=layer)


ARCHITECTURES = {
    "qwen2": _architecture("qwen2", "Qwen 2", "Qwen2ForCausalLM", qk_norm=False),
    "qwen3": _architecture("qwen3", "Qwen 3", "Qwen3ForCausalLM", qk_norm=True),
}
