"""LFM2-VL (transformers ``lfm2_vl``): a SigLIP 2 NaFlex vision encoder (patches at the image's own
aspect ratio, learned positions resized to each image's patch grid), a pixel-unshuffle projector
(LayerNorm + two-layer MLP) and the LFM2 text model (models/lfm2.py: short-conv + attention hybrid).

Image placeholder positions carry image keys (turnkv/images.py) and take the image rows; attention
stays causal over them (transformers passes no block mask for LFM2-VL). Preprocessing is
``Lfm2VlImageProcessor``'s, ported from transformers 5.24 (smart resize, tiling into a grid with a
thumbnail, rescale + normalize, patchify) because that class only exists with a torchvision
backend, which turnkv does not depend on; the resize is the same ``torch.nn.functional.interpolate``
call torchvision makes (bilinear, antialias, uint8 on CPUs with AVX2 / AVX-512).
"""

from __future__ import annotations

import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..images import ImageInput, content_digest, image_id_of, merge_embeddings
from .base import Model, embedding, refuse_unsupported
from .idefics3 import ACTIVATIONS, VisionArgs, VisionLayer, _act
from .lfm2 import Lfm2Model
from .lfm2 import ModelArgs as TextArgs
from .tensors import param, take
from .vision_settings import VisionSettings, expect, read_settings, salt

IMAGENET_STANDARD = [0.5, 0.5, 0.5]
# saved keys that do not change the pixels (bookkeeping, or outputs turnkv computes itself)
_INERT = {"image_processor_type", "processor_class", "auto_map", "_processor_class", "return_row_col_info",
          "return_tensors", "device", "disable_grouping", "data_format", "input_data_format", "size",
          "max_num_patches", "default_to_square", "crop_size", "pad_size"}
# settings of the base class whose value here is the one the ported path implements
_NO_OP = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_pad": True, "do_convert_rgb": True,
          "do_center_crop": False, "resample": 2}


def _prefix(tensors: dict, candidates: tuple[str, ...], probe: str) -> str:
    for p in candidates:
        if p + probe in tensors:
            return p
    return candidates[0]


# --- preprocessing (transformers' Lfm2VlImageProcessor) ------------------------------------------------

@dataclass
class Preprocessing:
    downsample_factor: int = 2
    do_image_splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    encoder_patch_size: int = 16
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    rescale_factor: float = 1 / 255
    image_mean: tuple = tuple(IMAGENET_STANDARD)
    image_std: tuple = tuple(IMAGENET_STANDARD)

    @classmethod
    def from_settings(cls, settings: VisionSettings) -> "Preprocessing":
        """The saved settings; any other setting than the ones ported here (or an inert one at
        its no-op value) is refused by name."""
        raw = settings.image
        for key, value in raw.items():
            if key in cls.__dataclass_fields__ or key in _INERT or value is None:
                continue
            if _NO_OP.get(key, object()) != value:
                raise settings.refuse("lfm2_vl", key, value, "turnkv ports transformers' default path only")
        for key in ("image_mean", "image_std"):
            if isinstance(raw.get(key), (int, float)):
                raw = {**raw, key: [raw[key]] * 3}
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None})

    @property
    def max_num_patches(self) -> int:
        tile = (self.tile_size // self.encoder_patch_size) ** 2 if self.do_image_splitting else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tile)


def _round_by(n: float, f: int) -> int:
    return round(n / f) * f


def _resize(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """torchvision's resize_image (bilinear, antialias) of a uint8 [B, 3, H, W] tensor."""
    if (h, w) == tuple(img.shape[-2:]):
        return img
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    x = img if native else img.float()
    x = F.interpolate(x, size=[h, w], mode="bilinear", align_corners=False, antialias=True)
    return x if native else x.round_().to(torch.uint8)


def _closest_ratio(aspect: float, ratios: list, width: int, height: int, size: int) -> tuple[int, int]:
    best_diff, best = float("inf"), (1, 1)
    for r in ratios:
        diff = abs(aspect - r[0] / r[1])
        if diff < best_diff:
            best_diff, best = diff, r
        elif diff == best_diff and width * height > 0.5 * size * size * r[0] * r[1]:
            best = r
    return best


def preprocess(img, p: Preprocessing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, tuple[int, int]]:
    """(pixel_values [n, max_patches, 3*P*P], pixel_attention_mask [n, max_patches], spatial_shapes [n, 2],
    rows, cols, (height, width) of the resized image) for one PIL image, as transformers computes them."""
    import numpy as np

    x = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()[None]   # uint8 [1, 3, H, W]
    H, W = x.shape[-2:]
    P, f = p.encoder_patch_size, p.downsample_factor
    total = P * f
    min_tiles, max_tiles = (p.min_tiles, p.max_tiles) if p.do_image_splitting else (1, 1)
    hb, wb = max(P, _round_by(H, total)), max(P, _round_by(W, total))
    large = hb * wb > p.max_image_tokens * P ** 2 * f ** 2 * p.max_pixels_tolerance
    # smart resize
    lo, hi = p.min_image_tokens * P ** 2 * f ** 2, p.max_image_tokens * P ** 2 * f ** 2
    h_bar, w_bar = max(total, _round_by(H, total)), max(total, _round_by(W, total))
    if h_bar * w_bar > hi:
        beta = math.sqrt((H * W) / hi)
        h_bar = max(total, math.floor(H / beta / total) * total)
        w_bar = max(total, math.floor(W / beta / total) * total)
    elif h_bar * w_bar < lo:
        beta = math.sqrt(lo / (H * W))
        h_bar, w_bar = math.ceil(H * beta / total) * total, math.ceil(W * beta / total) * total
    if large and not min_tiles == max_tiles == 1:
        ratios = sorted({(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1)
                         for h in range(1, n + 1) if min_tiles <= w * h <= max_tiles}, key=lambda r: r[0] * r[1])
        gw, gh = _closest_ratio(W / H, ratios, W, H, p.tile_size)
        big = _resize(x, p.tile_size * gh, p.tile_size * gw)
        t = p.tile_size
        tiles = big.view(1, 3, gh, t, gw, t).permute(0, 2, 4, 1, 3, 5).reshape(gh * gw, 3, t, t)
        parts = list(tiles)
        if p.use_thumbnail and gw * gh != 1:
            parts.append(_resize(x, h_bar, w_bar)[0])
        rows, cols = gh, gw
    else:
        parts, rows, cols = [_resize(x, h_bar, w_bar)[0]], 1, 1
    mean = torch.tensor(list(p.image_mean)) * (1.0 / p.rescale_factor)
    std = torch.tensor(list(p.image_std)) * (1.0 / p.rescale_factor)
    n_max = p.max_num_patches
    pixels, masks, shapes = [], [], []
    for part in parts:
        z = part.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        _, h, w = z.shape
        nh, nw = h // P, w // P
        patches = z.reshape(3, nh, P, nw, P).permute(1, 3, 2, 4, 0).reshape(nh * nw, -1)
        mask = torch.ones(n_max, dtype=torch.int32)
        if n_max > patches.shape[0]:
            mask[patches.shape[0]:] = 0
            patches = F.pad(patches, (0, 0, 0, n_max - patches.shape[0]))
        pixels.append(patches)
        masks.append(mask)
        shapes.append([nh, nw])
    return torch.stack(pixels), torch.stack(masks), torch.tensor(shapes), rows, cols, (h_bar, w_bar)


# --- the vision tower ------------------------------------------------------------------------------------

def resize_positions(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[h*w, C]: the ``side x side`` position table resized to an ``h x w`` patch grid as
    transformers' Siglip2VisionEmbeddings.resize_positional_embeddings does (bilinear, antialias)."""
    side = table.shape[0]
    sizes = torch.tensor([[float(h), float(w)]])
    pos = torch.arange(h * w, dtype=torch.float32)[:, None]
    rows = torch.div(pos, sizes[:, 1:], rounding_mode="floor")
    index = torch.cat([rows, pos - rows * sizes[:, 1:]], dim=-1)            # [h*w, 2]
    scale = side / sizes                                                     # [1, 2]
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5
    source = torch.arange(side, dtype=torch.float32)
    wts = (1 - (source - center[..., None]).abs_().div_(support[..., None])).clamp_(min=0)
    wts = wts / wts.sum(-1, keepdim=True)                                    # [h*w, 2, side]
    wts = (wts[:, 0, :, None] * wts[:, 1, None, :]).flatten(-2)
    return (wts @ table.reshape(-1, table.shape[-1]).float()).to(table.dtype)


class Siglip2Tower(nn.Module):
    def __init__(self, a: VisionArgs, num_patches: int, t: dict, p: str, dtype):
        super().__init__()
        self.args = a
        self.patch_w = param(take(t, f"{p}.embeddings.patch_embedding.weight"), dtype)
        self.patch_b = param(take(t, f"{p}.embeddings.patch_embedding.bias"), dtype)
        side = int(num_patches ** 0.5)
        self.pos = param(take(t, f"{p}.embeddings.position_embedding.weight").reshape(side, side, -1), dtype)
        self.layers = nn.ModuleList(VisionLayer(a, t, f"{p}.encoder.layers.{i}", dtype)
                                    for i in range(a.num_hidden_layers))
        self.post_w = param(take(t, f"{p}.post_layernorm.weight"), dtype)
        self.post_b = param(take(t, f"{p}.post_layernorm.bias"), dtype)
        for k in [k for k in t if k.startswith(f"{p}.head.")]:     # the pooling head: unused by LFM2-VL
            del t[k]

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """One image's real patches [h*w, 3*P*P] -> [h*w, C] (padding patches are masked out of
        every attention in transformers, so dropping them computes the same rows)."""
        x = F.linear(patches, self.patch_w, self.patch_b) + resize_positions(self.pos, h, w)
        x = x[None]
        for layer in self.layers:
            x = layer(x, None)
        return F.layer_norm(x[0], (x.shape[-1],), self.post_w, self.post_b, self.args.layer_norm_eps)


class Lfm2VlModel(Model):
    family = "lfm2_vl"

    def __init__(self, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.config, self.dtype = config, dtype
        text_cfg = dict(config.get("text_config") or {})
        pre = _prefix(tensors, ("model.language_model.", "language_model.model."), "embed_tokens.weight")
        text_t = {("model." + k[len(pre):]): v for k, v in tensors.items() if k.startswith(pre)}
        for head in ("lm_head.weight", "language_model.lm_head.weight"):
            if head in tensors:
                text_t["lm_head.weight"] = tensors[head]
        text_args = TextArgs.from_dict(text_cfg)
        if "lm_head.weight" not in text_t:
            text_args.tie_word_embeddings = True
        self.text = Lfm2Model(text_args, text_cfg, text_t, dtype)
        self.args = self.text.args
        vcfg = dict(config.get("vision_config") or {})
        refuse_unsupported(config, {"projector_hidden_act": ACTIVATIONS})
        self.vision_args = VisionArgs.from_dict(vcfg)
        vp = _prefix(tensors, ("model.vision_tower.vision_model.", "model.vision_tower."),
                     "embeddings.patch_embedding.weight")
        self.vision = Siglip2Tower(self.vision_args, int(vcfg.get("num_patches", 256)), tensors, vp[:-1], dtype)
        mp = "model.multi_modal_projector"
        self.factor = int(config.get("downsample_factor", 2))
        self.ln = None
        if config.get("projector_use_layernorm", True):
            self.ln = (param(take(tensors, f"{mp}.layer_norm.weight"), dtype),
                       param(take(tensors, f"{mp}.layer_norm.bias"), dtype))
        bias = config.get("projector_bias", True)
        self.w1 = param(take(tensors, f"{mp}.linear_1.weight"), dtype)
        self.b1 = param(take(tensors, f"{mp}.linear_1.bias"), dtype) if bias else None
        self.w2 = param(take(tensors, f"{mp}.linear_2.weight"), dtype)
        self.b2 = param(take(tensors, f"{mp}.linear_2.bias"), dtype) if bias else None
        self.act = _act(config.get("projector_hidden_act", "gelu"))
        self.image_token_id = int(config.get("image_token_id", 396))
        self.image_marker = "<image>"
        self.load_processor()

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(config, tensors, dtype)

    def cache_specs(self):
        return self.text.cache_specs()

    # --- images --------------------------------------------------------------------------------
    def load_processor(self, folder: str | Path | None = None) -> None:
        """The folder's saved settings (models/vision_settings.py), else transformers' defaults with
        the tower's patch size. A patch size or downsample factor other than the model's, or images
        without their special tokens, are refused."""
        settings = read_settings(folder)
        prep = Preprocessing(downsample_factor=self.factor, encoder_patch_size=self.vision_args.patch_size)
        if settings.image:
            prep = Preprocessing.from_settings(settings)
        expect(settings, "lfm2_vl", "downsample_factor", prep.downsample_factor, self.factor,
               "it must be the config's downsample_factor")
        expect(settings, "lfm2_vl", "encoder_patch_size", prep.encoder_patch_size, self.vision_args.patch_size,
               "it must be the vision tower's patch_size")
        expect(settings, "lfm2_vl", "use_image_special_tokens", settings.processor.get("use_image_special_tokens"),
               True, "turnkv delimits every image with its special tokens")
        self.prep, self.image_salt = prep, salt("lfm2_vl", asdict(prep))

    def prepare_image(self, img) -> ImageInput:
        pixels, mask, shapes, rows, cols, size = preprocess(img, self.prep)
        f = self.factor
        n = int(sum((h // f) * (w // f) for h, w in shapes.tolist()))
        digest = content_digest(img, self.image_salt)
        return ImageInput(digest, image_id_of(digest), pixels, mask, n, (rows, cols), self.image_token_id,
                          {"spatial_shapes": shapes, "resized": size})

    def image_prompt(self, image: ImageInput) -> str:
        """transformers' Lfm2VlProcessor._build_image_tokens (with the image special tokens)."""
        p, (rows, cols) = self.prep, image.grid
        per_tile = math.ceil((p.tile_size // p.encoder_patch_size) / p.downsample_factor) ** 2
        h, w = image.extra["resized"]
        for_image = (math.ceil((h // p.encoder_patch_size) / p.downsample_factor)
                     * math.ceil((w // p.encoder_patch_size) / p.downsample_factor))
        parts = ["<|image_start|>"]
        if rows > 1 or cols > 1:
            for r in range(rows):
                for c in range(cols):
                    parts += [f"<|img_row_{r + 1}_col_{c + 1}|>", "<image>" * per_tile]
            if p.use_thumbnail:
                parts += ["<|img_thumbnail|>", "<image>" * for_image]
        else:
            parts.append("<image>" * for_image)
        parts.append("<|image_end|>")
        return "".join(parts)

    @torch.inference_mode()
    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """[n_rows, hidden]: each tile (and the thumbnail) through the tower, its patches' f x f
        blocks unshuffled (row offset outer, column offset inner) and projected, in order."""
        out, f = [], self.factor
        for e, (h, w) in enumerate(image.extra["spatial_shapes"].tolist()):
            x = self.vision(image.pixel_values[e, : h * w].to(self.dtype), h, w)       # [h*w, C]
            C = x.shape[-1]
            x = x.view(h // f, f, w // f, f, C).permute(0, 2, 1, 3, 4).reshape(-1, f * f * C)
            if self.ln is not None:
                x = F.layer_norm(x, (x.shape[-1],), self.ln[0], self.ln[1])
            out.append(F.linear(self.act(F.linear(x, self.w1, self.b1)), self.w2, self.b2))
        return torch.cat(out)

    # --- text ----------------------------------------------------------------------------------
    def forward(self, batch):
        x = merge_embeddings(batch.tokens, lambda ids: embedding(ids, self.text.embed, self.dtype), batch.images)
        return self.text.forward_embeds(x, batch)

    def head(self, x):
        return self.text.head(x)
