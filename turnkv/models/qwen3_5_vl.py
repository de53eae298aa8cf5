"""Qwen3.5-VL (transformers ``qwen3_5`` / ``qwen3_5_moe``, Qwen3_5(Moe)ForConditionalGeneration): a
ViT with 2-D rotary positions and bilinearly resampled learned positions, a patch merger (LayerNorm,
``merge x merge`` patches concatenated, two-layer MLP), and the Qwen 3.5 text model (models/qwen3_5.py:
gated delta-net hybrid) under multimodal rotary positions (M-RoPE).

**M-RoPE.** Every token has a (t, h, w) position. A text token's three are equal; the rows of an
image whose merged grid is ``lh x lw`` and whose first row comes where a text token would have had
position ``st`` take ``(st, st + r, st + c)`` for row ``k = r * lw + c``, and the text after the
image continues at ``st + max(lh, lw)`` (transformers' ``get_rope_index``). So a token's rotary
position is its index plus the sequence's *rope delta*, ``sum(max(lh, lw) - lh * lw)`` over the
images before it. The delta is **stored in the state**: an extra field ``mrope`` of the first
delta-net layer's recurrent state (its base-128 digits, exact in any float dtype), updated in the
step that prefills an image's last row. Snapshots, checkpoints, forks and the disk / Redis tiers
carry it with the rest of that state, and a hybrid only restores a state at the exact length it was
taken, so the position of the next token after a restored prefix is that snapshot's delta plus its
length. Within a step, an image row's position needs the image's merged grid width: ``prepare_image``
records ``image_id -> (lh, lw)`` (a pure function of the pixels) in ``self.grids``.

Preprocessing is transformers' ``Qwen2VLImageProcessorPil`` (the Pillow backend the auto class
picks for ``qwen3_5`` without torchvision), configured from the folder's saved settings (models/vision_settings.py).
The chat template renders an image as ``<|vision_start|><|image_pad|><|vision_end|>``; the
``<|image_pad|>`` marker expands to one ``<|image_pad|>`` per merged patch, as Qwen3VLProcessor does.
A folder without vision weights loads as the text model (models/qwen3_5.py)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import specs
from ..images import ImageInput, content_digest, image_id_of, is_key, merge_embeddings, split_key
from .base import UnsupportedConfig
from .batch import Batch
from .qwen3_5 import Qwen3_5Model
from .qwen3_next import LINEAR
from .tensors import param, take
from .vision_settings import expect, read_settings, salt, transformers_processor

VISUAL = "model.visual."
MAX_GRIDS = 1 << 16                # image grids remembered (a few bytes each)
DIGIT, DIGITS = 128, 4          # -delta in base 128 (each digit exact in bfloat16 / float16 / float32)


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported vision activation {name!r}")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, heads: int, act, t: dict, p: str, dtype):
        super().__init__()
        self.heads, self.act = heads, act
        for name in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            key = name.replace(".", "_")
            setattr(self, key + "_w", param(take(t, f"{p}.{name}.weight"), dtype))
            setattr(self, key + "_b", param(take(t, f"{p}.{name}.bias"), dtype))

    def forward(self, x, cos, sin):
        N, C = x.shape
        h = F.layer_norm(x, (C,), self.norm1_w, self.norm1_b, 1e-6)
        q, k, v = F.linear(h, self.attn_qkv_w, self.attn_qkv_b).reshape(N, 3, self.heads, -1).permute(1, 0, 2, 3)
        # rotary in float32, then back (apply_rotary_pos_emb_vision)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        x = x + F.linear(o[0].transpose(0, 1).reshape(N, C), self.attn_proj_w, self.attn_proj_b)
        h = F.layer_norm(x, (C,), self.norm2_w, self.norm2_b, 1e-6)
        return x + F.linear(self.act(F.linear(h, self.mlp_linear_fc1_w, self.mlp_linear_fc1_b)),
                            self.mlp_linear_fc2_w, self.mlp_linear_fc2_b)


class VisionTower(nn.Module):
    """Qwen3_5VisionModel + its merger: pixel patches [N, C*tp*P*P] (the processor's merge-block
    order) of one image with grid (t, h, w) -> [t*h*w / merge**2, text hidden]."""

    def __init__(self, vcfg: dict, t: dict, dtype):
        super().__init__()
        p = VISUAL[:-1]
        self.hidden = int(vcfg.get("hidden_size", 1152))
        self.heads = int(vcfg.get("num_heads", 16))
        self.merge = int(vcfg.get("spatial_merge_size", 2))
        w = take(t, f"{p}.patch_embed.proj.weight")
        self.patch_w = param(w.reshape(w.shape[0], -1), dtype)           # Conv3d with stride = kernel: a matmul
        self.patch_b = param(take(t, f"{p}.patch_embed.proj.bias"), dtype)
        self.pos = param(take(t, f"{p}.pos_embed.weight"), dtype)
        self.side = int(self.pos.shape[0] ** 0.5)
        act = _act(vcfg.get("hidden_act", "gelu_pytorch_tanh"))
        depth = int(vcfg.get("depth", 27))
        self.blocks = nn.ModuleList(VisionBlock(self.heads, act, t, f"{p}.blocks.{i}", dtype) for i in range(depth))
        theta = float((vcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = (self.hidden // self.heads) // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        def pair(name):
            return param(take(t, f"{p}.merger.{name}.weight"), dtype), param(take(t, f"{p}.merger.{name}.bias"), dtype)
        self.m_norm, self.m_fc1, self.m_fc2 = pair("norm"), pair("linear_fc1"), pair("linear_fc2")

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        thw = torch.tensor([list(grid)])
        x = F.linear(pixels.to(self.patch_w.dtype), self.patch_w, self.patch_b)
        idx, wts = get_vision_interpolation_indices_and_weights(thw, self.side, mode="bilinear", align_corners=True,
                                                                spatial_merge_size=self.merge)
        x = x + (self.pos[idx] * wts[:, :, None]).sum(1).to(x.dtype)
        pos = get_vision_position_ids(thw, self.merge)                                  # [N, 2] (h, w)
        freqs = pos[..., None].float() * self.inv_freq                                   # [N, 2, d/4]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1)[:, None]                                       # [N, 1, d]
        cos, sin = emb.cos(), emb.sin()
        # one image (t = 1 for a still image): one attention segment per frame
        frames = x.shape[0] // grid[0]
        outs = []
        for f in range(grid[0]):
            xf, cf, sf = (z[f * frames:(f + 1) * frames] for z in (x, cos, sin))
            for block in self.blocks:
                xf = block(xf, cf, sf)
            outs.append(xf)
        x = torch.cat(outs)
        x = F.layer_norm(x, (self.hidden,), *self.m_norm, 1e-6).reshape(-1, self.hidden * self.merge ** 2)
        return F.linear(F.gelu(F.linear(x, *self.m_fc1)), *self.m_fc2)


def _read_delta(cache) -> int:
    d = cache.state["mrope"].tolist()
    return -sum(int(round(v)) * DIGIT ** i for i, v in enumerate(d))


def _write_delta(cache, delta: int) -> None:
    n, digits = -delta, []
    for _ in range(DIGITS):
        n, r = divmod(n, DIGIT)
        digits.append(float(r))
    if n:
        raise RuntimeError("the M-RoPE delta is out of range")
    cache.set("mrope", torch.tensor(digits))


class Qwen3_5VlModel(Qwen3_5Model):
    family = "qwen3_5_vl"
    # native weights only: the weight formats are verified on the text model (Qwen3_5Model), and
    # the image path looks the embedding table up directly
    packable_weights = head_weights = embedding_weights = ()

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        if not isinstance(config.get("vision_config"), dict) or VISUAL + "pos_embed.weight" not in tensors:
            return Qwen3_5Model.from_checkpoint(config, tensors, dtype)     # a text-only folder
        model = super().from_checkpoint(config, tensors, dtype)
        model._init_vision(config, tensors)
        return model

    def _init_vision(self, config: dict, tensors: dict) -> None:
        vcfg = dict(config["vision_config"])
        self.vision = VisionTower(vcfg, tensors, self.dtype)
        self.merge = self.vision.merge
        self.image_token_id = int(config.get("image_token_id", 248056))
        self.image_marker = "<|image_pad|>"
        linear_layers = [i for i, layer in enumerate(self.layers) if layer.kind == LINEAR]
        if not linear_layers:
            raise UnsupportedConfig("qwen3_5: config field layer_types without a linear_attention layer is not "
                                    "supported with images (the M-RoPE position delta is kept in its state)")
        self.mrope_layer = linear_layers[0]
        tcfg = config.get("text_config") or {}
        rope = dict(tcfg.get("rope_parameters") or tcfg.get("rope_scaling") or {})
        sec = list(rope.get("mrope_section") or [11, 11, 10])
        half = self.rope.inv_freq.shape[0]
        axis = torch.zeros(half, dtype=torch.long)         # interleaved: t h w t h w ... then t
        for a, offset in ((1, 1), (2, 2)):
            axis[offset:sec[a] * 3:3] = a
        self.axis = axis
        self.grids: OrderedDict[int, tuple[int, int]] = OrderedDict()     # image_id -> merged (lh, lw)
        self.processor = None
        self.vision_cfg = vcfg

    def cache_specs(self):
        out = super().cache_specs()
        if hasattr(self, "mrope_layer"):
            i = self.mrope_layer
            out[i] = specs.recurrent(**dict(out[i].fields), mrope=(DIGITS,))
        return out

    # --- images --------------------------------------------------------------------------------
    def load_processor(self, folder: str | Path | None = None) -> None:
        """transformers' Qwen2VLImageProcessorPil from the folder's saved settings
        (models/vision_settings.py), else the vision config's patch / merge sizes and the class
        defaults. Patch, merge or temporal sizes other than the tower's are refused."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        settings = read_settings(folder)
        v = self.vision_cfg
        tower = {"patch_size": int(v.get("patch_size", 16)), "merge_size": self.merge,
                 "temporal_patch_size": int(v.get("temporal_patch_size", 2))}
        proc = transformers_processor(Qwen2VLImageProcessorPil, settings, tower)
        for key, want in tower.items():
            expect(settings, "qwen3_5_vl", key, getattr(proc, key), want, "it must match the vision tower")
        self.processor, self.image_salt = proc, salt("qwen3_5_vl", proc.to_dict())

    def prepare_image(self, img) -> ImageInput:
        if self.processor is None:
            self.load_processor()
        out = self.processor(images=[img], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
        digest = content_digest(img, self.image_salt)
        image_id = image_id_of(digest)
        self.grids[image_id] = (h // self.merge, w // self.merge)
        self.grids.move_to_end(image_id)
        while len(self.grids) > MAX_GRIDS:          # the oldest: long past their requests' prefill
            self.grids.popitem(last=False)
        return ImageInput(digest, image_id, out["pixel_values"], None, t * h * w // self.merge ** 2,
                          (h // self.merge, w // self.merge), self.image_token_id, {"grid_thw": (t, h, w)})

    def image_prompt(self, image: ImageInput) -> str:
        return self.image_marker * image.n_rows

    @torch.inference_mode()
    def encode_image(self, image: ImageInput) -> torch.Tensor:
        return self.vision(image.pixel_values, image.extra["grid_thw"])

    # --- text ----------------------------------------------------------------------------------
    def _positions(self, tokens: list[int], start: int, delta: int) -> tuple[torch.Tensor, int]:
        """[3, T] (t, h, w) positions of a span's tokens at index ``start`` under ``delta``, and
        the delta after them."""
        out = torch.empty(3, len(tokens), dtype=torch.long)
        for j, tok in enumerate(tokens):
            i = start + j
            if not is_key(tok):
                out[:, j] = i + delta
                continue
            image_id, k = split_key(tok)
            grid = self.grids.get(image_id)
            if grid is None:
                raise RuntimeError(f"image {image_id:x} has no grid (prepare_image was not called)")
            lh, lw = grid
            st = i - k + delta
            out[0, j], out[1, j], out[2, j] = st, st + k // lw, st + k % lw
            if k == lh * lw - 1:                      # the image's last row: the text after it moves on
                delta += max(lh, lw) - lh * lw
        return out, delta

    def mrope_rows(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [N, rotary dim] of every row at its M-RoPE position; the rope delta read from
        and written back to each span's state."""
        cos, sin = [], []
        for s in batch.spans:
            cache = s.caches[self.mrope_layer]
            delta = _read_delta(cache)
            toks = batch.tokens[s.rows].tolist()
            if not any(is_key(t) for t in toks):
                c, n = self.rope.table(s.position + delta, s.length)
            else:
                pos, new = self._positions(toks, s.position, delta)
                inv = self.rope.inv_freq
                freqs = pos.to(inv.device)[..., None].float() * inv[None, None, :].float()     # [3, T, half]
                f = freqs.gather(0, self.axis.to(inv.device).view(1, 1, -1).expand(1, s.length, -1))[0]
                emb = torch.cat((f, f), dim=-1)
                c = (emb.cos() * self.rope.scaling).to(self.rope.dtype)
                n = (emb.sin() * self.rope.scaling).to(self.rope.dtype)
                if new != delta:
                    _write_delta(cache, new)
            cos.append(c)
            sin.append(n)
        if len(cos) == 1:
            return cos[0], sin[0]
        return torch.cat(cos), torch.cat(sin)

    def forward(self, batch: Batch):
        if not hasattr(self, "mrope_layer"):
            return super().forward(batch)
        x = merge_embeddings(batch.tokens, lambda ids: F.embedding(ids, self.embed), batch.images)
        rope = self.mrope_rows(batch)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, i, rope)
        return self.final_logits(x, batch)
