"""Qwen 2 / 2.5, Qwen 3 dense and Qwen 3 MoE from llama.cpp's ``qwen2`` / ``qwen3`` / ``qwen3moe``
GGUF layouts (conversion/qwen.py ``Qwen2Model``, ``Qwen3Model``, ``Qwen3MoeModel``): llama's
tensor names without its q/k row permutation (llama.cpp runs them with NEOX RoPE, as transformers
does), q/k/v biases for Qwen 2, ``attn_q_norm`` / ``attn_k_norm`` for Qwen 3. The dense ones run
on turnkv.models.llama, the MoE on turnkv.models.qwen3_moe: every block routed (llama.cpp has no
dense blocks for qwen3moe), the router as ``ffn_gate_inp``, the experts stacked per projection."""

from __future__ import annotations

from ...errors import ModelLoadError
from ..architecture import ATTN_PROJ_TENSORS, GATED_MLP_TENSORS, QK_NORM_TENSORS, GGUFArchitecture
from ..metadata import default_rope, llama_style_config, scalar, token_ids
from ..reader import GGUFHeader
from .common import attention_shape, check_full_rotary, fuse_gate_up, moe_decoder_names, rope_base, uniform

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


def _moe_config(h: GGUFHeader) -> dict:
    a = "qwen3moe"
    config = _architecture(a, "Qwen 3 MoE", "Qwen3MoeForCausalLM", qk_norm=True).build_config(h)
    layers = config["num_hidden_layers"]
    if h.metadata.get(f"{a}.expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise ModelLoadError(f"{h.path}: Qwen 3 MoE with expert_weights_scale "
                             f"{h.metadata[f'{a}.expert_weights_scale']} is not supported")
    return {
        **config,
        "model_type": "qwen3_moe",
        "intermediate_size": scalar(h, f"{a}.feed_forward_length", 0),
        "moe_intermediate_size": uniform(h, f"{a}.expert_feed_forward_length", layers),
        "num_experts": scalar(h, f"{a}.expert_count"),
        "num_experts_per_tok": uniform(h, f"{a}.expert_used_count", layers),
        # llama.cpp's qwen3moe graph always renormalizes the kept weights
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _moe_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    attn = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTN_PROJ_TENSORS,
            **QK_NORM_TENSORS}
    names = moe_decoder_names(h, config["num_hidden_layers"], 0, attn, GATED_MLP_TENSORS,
                              {"ffn_gate_inp": "mlp.gate"}, "unused")
    # no score-correction bias in this layout
    return {g: t for g, t in names.items() if not g.endswith(".exp_probs_b.bias")}


def _fuse(tensors: dict, config: dict) -> dict:
    fuse_gate_up(tensors)
    return tensors


ARCHITECTURES = {
    "qwen2": _architecture("qwen2", "Qwen 2", "Qwen2ForCausalLM", qk_norm=False),
    "qwen3": _architecture("qwen3", "Qwen 3", "Qwen3ForCausalLM", qk_norm=True),
    "qwen3moe": GGUFArchitecture(model_type="qwen3_moe", build_config=_moe_config, layer_tensors={},
                                 tensor_names=_moe_names, finish=_fuse),
}
