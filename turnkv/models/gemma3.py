"""Gemma 3 (text): sliding-window attention on local layers, full attention on every
``sliding_window_pattern``-th layer, QK-norm, sandwich norms, scaled embeddings, GELU-tanh MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..images import IMAGE_KEY_BASE
from .base import Rope, apply_rope, attention, attention_spans, embedding, linear, rms_norm
from .batch import Batch, Span, spans_apply
from .decoder import (FULL, SLIDING, DecoderArgs, DecoderModel, GatedMLP, gelu_tanh_, norm_plus_one, out_weights,
                      qk_norm_rows, qkv_weights, rope_for)
from .fused import FusedBlock, FusedSlot, stack_for
from .rope_config import rope_params
from .tensors import take


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    computes = {"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,),
                "use_bidirectional_attention": (False,)}
    num_key_value_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4096
    layer_types: list | None = None
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not self.layer_types:
            n = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % n == 0 else SLIDING for i in range(self.num_hidden_layers)]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, p: str, dtype, sliding: bool):
        super().__init__()
        self.hq, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale = a.query_pre_attn_scalar ** -0.5
        # transformers' Gemma 3 never soft-caps the scores: attn_logit_softcapping, a field kept
        # from Gemma 2's config, is read by no layer (llama.cpp's gemma3 has none either)
        self.softcap = None
        self.eps = a.rms_norm_eps
        self.sliding = sliding
        self.wqkv, _ = qkv_weights(t, p, dtype)
        self.wo, _ = out_weights(t, p, dtype)
        self.qk_norm = norm_plus_one(qk_norm_rows(t, p, self.hq, self.hk), dtype)

    def forward(self, x, batch: Batch, i: int, rope, blocks: dict | None = None):
        hq, hk = self.hq, self.hk
        qkv = linear(x, self.wqkv).view(x.shape[0], hq + 2 * hk, self.d).transpose(0, 1)
        # same order as transformers' Gemma3RMSNorm: normalize, then scale by (1 + w)
        qk = apply_rope(rms_norm(qkv[: hq + hk], None, self.eps).mul_(self.qk_norm), *rope)
        return linear(self.attend(qk, qkv[hq + hk:], batch, i, blocks), self.wo)

    def attend(self, qk, v, batch: Batch, i: int, blocks: dict | None = None):
        """The rows' attention output [T, hq * D] from their rotated q/k [hq + hk, T, D] and v."""
        hq = self.hq
        if blocks is None:      # text only: every sequence's rows over its own KV, one native call
            return attention_spans(batch, i, qk[:hq], qk[hq:], v, self.scale, self.softcap)

        def one(s: Span):   # this sequence's rows over its own KV
            view = s.caches[i].update_and_fetch(qk[hq:, s.rows], v[:, s.rows])
            out = attention(qk[:hq, s.rows], view, self.scale, self.softcap)
            if s in blocks:   # image rows: their whole image too (Gemma 3 vision)
                rows, same = blocks[s]
                out[rows] = image_rows_attention(qk[:hq, s.rows], view, rows, same, self.scale, self.softcap)
            return out
        return spans_apply(batch, one)


def image_blocks(batch: Batch) -> dict | None:
    """Per span with image keys (turnkv/images.py): (its image rows [R], bool [R, T] "the same
    image run"): transformers' token_type_ids block mask, a run of consecutive image tokens being
    one block (get_block_sequence_ids_for_mask). The scheduler never splits a run (whole_images)."""
    out = {}
    for s in batch.spans:
        img = batch.tokens[s.rows] >= IMAGE_KEY_BASE
        if s.length < 2 or not bool(img.any()):
            continue
        start = img & ~torch.cat([img.new_zeros(1), img[:-1]])
        run = torch.cumsum(start.long(), 0)
        rows = img.nonzero().flatten()
        same = (run[rows][:, None] == run[None, :]) & img[None, :]
        out[s] = (rows, same)
    return out or None


def image_rows_attention(q, view, rows, same, scale, softcap):
    """Attention of the image rows ``rows`` of this call's queries: the layer's rule (causal, and the
    window on sliding layers) OR the rows of the same image, AND the window (transformers'
    create_masks_for_vision_model). Explicit masked softmax over the view's keys."""
    T = q.shape[1]
    S = view.keys.shape[1]
    qpos = view.query_pos0 + rows
    kpos = view.key_pos0 + torch.arange(S)
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= view.needed_from_many(qpos)[:, None])
    off = view.query_pos0 - view.key_pos0         # the call's own keys are the view's last T
    extra = torch.zeros_like(mask)
    extra[:, off:off + T] = same
    if view.kind == "sliding":
        extra &= kpos[None, :] > qpos[:, None] - view.span
    mask |= extra
    qi = q[:, rows]
    k, v = view.keys, view.values
    rep = qi.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, 0) if rep > 1 else k
    v = v.repeat_interleave(rep, 0) if rep > 1 else v
    scores = torch.matmul(qi, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(qi.dtype), v)
    return out.transpose(0, 1).reshape(len(rows), -1)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, t: dict, i: int, dtype):
        super().__init__()
        p = f"model.layers.{i}"
        self.eps = a.rms_norm_eps
        self.sliding = a.layer_types[i] == SLIDING
        self.ln_in = norm_plus_one(take(t, f"{p}.input_layernorm.weight"), dtype)
        self.ln_post_attn = norm_plus_one(take(t, f"{p}.post_attention_layernorm.weight"), dtype)
        self.ln_pre_ff = norm_plus_one(take(t, f"{p}.pre_feedforward_layernorm.weight"), dtype)
        self.ln_post_ff = norm_plus_one(take(t, f"{p}.post_feedforward_layernorm.weight"), dtype)
        self.attn = Attention(a, t, f"{p}.self_attn", dtype, self.sliding)
        self.mlp = GatedMLP.named(t, f"{p}.mlp", dtype, gelu_tanh_)

    fused = FusedSlot()     # its FusedBlock, or None

    def fuse(self) -> bool:
        """Run the block as two native calls (models/fused.py) when its weights allow it."""
        a = self.attn
        self.fused = FusedBlock.build(hq=a.hq, hk=a.hk, head_dim=a.d, eps=self.eps, attn_norm=self.ln_in,
                                      wqkv=a.wqkv, qk_norm=a.qk_norm, wo=a.wo, post_attn=self.ln_post_attn,
                                      mlp_norm=self.ln_pre_ff, wgu=self.mlp.wgu, act="gelu_tanh",
                                      wdown=self.mlp.wdown, post_ff=self.ln_post_ff)
        return self.fused is not None

    def forward(self, x, batch, i, rope, blocks=None):
        f = self.fused
        if f is not None and f.takes(x):
            if blocks is None:      # text only: every sequence's rows over its own KV
                return f.layer(x, rope, batch, i, self.attn.scale, self.attn.softcap)
            qk, v = f.qkv(x, rope)
            return f.out_mlp(x, self.attn.attend(qk, v, batch, i, blocks))
        # x is the model's own residual buffer (fresh from the embedding): accumulate in place
        h = self.attn.forward(rms_norm(x, self.ln_in, self.eps), batch, i, rope, blocks)
        x += rms_norm(h, self.ln_post_attn, self.eps)
        h = self.mlp.forward(rms_norm(x, self.ln_pre_ff, self.eps))
        x += rms_norm(h, self.ln_post_ff, self.eps)
        return x


class Gemma3Model(DecoderModel):
    family = "gemma3"
    Args = ModelArgs
    Block = Block
    norm_weight = staticmethod(norm_plus_one)

    def __init__(self, args: ModelArgs, config: dict, tensors: dict, dtype: torch.dtype):
        # tied (transformers ignores a stored lm_head then): one table, packed once by weight formats
        super().__init__(args, config, tensors, dtype)
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5).to(dtype)

    def set_rope(self, config: dict) -> None:
        self.rope_global = self._rope(config, FULL, default_theta=1_000_000.0)
        self.rope_local = self._rope(config, SLIDING, default_theta=config.get("rope_local_base_freq", 10_000.0))

    def _rope(self, config: dict, layer_type: str, default_theta: float) -> Rope:
        params = rope_params(config, layer_type)
        if "rope_parameters" not in config or layer_type not in (config.get("rope_parameters") or {}):
            if layer_type == SLIDING:
                params = {"rope_theta": default_theta, "rope_type": "default"}
        return rope_for(params, self.args.head_dim, self.dtype)

    def forward(self, batch):
        return self.forward_embeds(embedding(batch.tokens, self.embed, self.dtype) * self.embed_scale, batch)

    def forward_embeds(self, x, batch, blocks: dict | None = None):
        """The decoder over input embeddings ``x`` [N, hidden]; ``blocks`` (Gemma 3 vision) maps a
        span to its image rows and their same-image table (``image_blocks``)."""
        rope_g, rope_l = self.rope_global.rows(batch), self.rope_local.rows(batch)
        stack = None if blocks is not None else stack_for(
            self, lambda: [layer.attn.scale for layer in self.layers],
            lambda: [layer.attn.softcap for layer in self.layers],
            lambda: [1 if layer.sliding else 0 for layer in self.layers])
        if stack is None or not stack.run(x, batch, [rope_g, rope_l]):   # all layers in one native call, else one by one
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, batch, i, rope_l if layer.sliding else rope_g, blocks)
        return self.final_logits(x, batch)

    def head(self, x):
        out = linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out
