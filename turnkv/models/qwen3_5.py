"""Qwen 3.5 text (dense ``qwen3_5_text`` and MoE ``qwen3_5_moe_text``): the Qwen3-Next layer stack
(gated delta-net on most layers, gated full attention with partial RoPE and (1 + w) QK-norm on every
``full_attention_interval``-th layer) with three differences, all handled here on top of
``qwen3_next.py``'s building blocks:

- the delta-net's input projections are four separate matrices (``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``) laid out q_all | k_all | v_all, not Qwen3-Next's per-key-head
  interleaved ``in_proj_qkvz`` / ``in_proj_ba``: they are concatenated as they are;
- the feed-forward is either a dense SwiGLU MLP on every layer (``qwen3_5``) or the sparse MoE with
  a sigmoid-gated shared expert on every layer (``qwen3_5_moe``: no ``mlp_only_layers``, no
  ``decoder_sparse_step``, top-k probabilities always renormalised);
- RoPE is transformers' multimodal (M-RoPE) rotary, which for text positions (the same position on
  the temporal / height / width axes) is plain partial RoPE.

The released checkpoints are vision-language folders (``model_type`` ``qwen3_5`` / ``qwen3_5_moe``,
``text_config``, the decoder under ``model.language_model.``): their text decoder loads from those
too, the vision tower is ignored. The MTP block (``mtp.*``), where the checkpoint has one, is
loaded as ``model.mtp`` (models/mtp.py): the ``--speculative mtp`` drafter."""

from __future__ import annotations

import torch

from . import qwen3_next
from .mtp import PREFIX as MTP_PREFIX
from .mtp import MtpHead, has_mtp
from .tensors import stored

VLM_TEXT_PREFIX = "model.language_model."


class GatedDeltaNet(qwen3_next.GatedDeltaNet):
    def input_parts(self, t: dict, p: str, H: int) -> list:
        # already [q_all, k_all, v_all] | z_all | b_all | a_all: no regrouping
        return [stored(t, f"{p}.in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]


class Block(qwen3_next.Block):
    delta_net = GatedDeltaNet


def text_part(config: dict, tensors: dict) -> tuple[dict, dict]:
    """(text config, decoder tensors named as the CausalLM names them) of a text-only folder
    (``qwen3_5_text`` / ``qwen3_5_moe_text``) or of a vision-language one."""
    if not isinstance(config.get("text_config"), dict):
        return config, tensors
    text = dict(config["text_config"])
    if "tie_word_embeddings" in config:
        text.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    renamed = {}
    for name, t in tensors.items():
        if name.startswith(VLM_TEXT_PREFIX):
            renamed["model." + name[len(VLM_TEXT_PREFIX):]] = t
        elif name == "lm_head.weight" or name.startswith(MTP_PREFIX):
            renamed[name] = t
    return text, renamed


class Qwen3_5Model(qwen3_next.Qwen3NextModel):
    family = "qwen3_5"
    block = Block
    # the delta-net's fused input and output projections, the attention's q|k|v|gate and output,
    # the dense MLP and the shared expert (models/weights.py); the stacked routed experts, the
    # router and the shared-expert gate stay native; the MTP block's (models/mtp.py) too, and its eh_proj
    packable_weights = ("w_in", "w_out", "wqkvg", "wo", "wgu", "wdown", "eh_proj")
    head_weights = ("lm_head",)
    embedding_weights = ("embed",)

    def __init__(self, args, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__(args, config, tensors, dtype)
        self.mtp = MtpHead(self, tensors, dtype, self.block, qwen3_next.FULL) if has_mtp(tensors) else None

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        outer = str(config.get("model_type", ""))
        config, tensors = text_part(config, tensors)
        moe = any(str(m).startswith("qwen3_5_moe") for m in (outer, config.get("model_type", "")))
        cfg = dict(config)
        # Qwen 3.5 has no mlp_only_layers / decoder_sparse_step / norm_topk_prob: every layer is
        # dense (qwen3_5) or sparse (qwen3_5_moe), and the MoE always renormalises its top-k
        cfg.update(mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
        cfg.setdefault("intermediate_size", 0)   # the MoE config has none
        if not moe:
            cfg["num_experts"] = 0
        # partial_rotary_factor lives in rope_parameters (0.25 in the released configs)
        rope = cfg.get("rope_parameters") or {}
        if "partial_rotary_factor" in rope:
            cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
        return cls(qwen3_next.ModelArgs.from_dict(cfg), cfg, tensors, dtype)
