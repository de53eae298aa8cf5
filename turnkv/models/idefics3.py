"""SmolVLM / Idefics3: a SigLIP-style vision encoder (NaViT position buckets), a pixel-shuffle
connector and a Llama decoder (models/llama.py) whose ``<image>`` rows take the image embeddings.

The decoder runs the batched interface unchanged: image placeholder positions carry image keys
(turnkv/images.py) and ``Batch.images`` the embeddings, which replace the token embedding on those
rows. Encoding is per image (``encode_image``), called by the engine through its encoder cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..images import ImageInput, content_digest, image_id_of, merge_embeddings
from .base import BaseArgs, Model, embedding
from .llama import LlamaModel
from .llama import ModelArgs as LlamaArgs
from .tensors import param, take
from .vision_settings import expect, read_settings, salt, transformers_processor


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")


@dataclass
class VisionArgs(BaseArgs):
    computes = {"hidden_act": ACTIVATIONS}
    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision hidden_act {name!r} is not supported")


class VisionLayer(nn.Module):
    def __init__(self, a: VisionArgs, t: dict, p: str, dtype):
        super().__init__()
        self.heads, self.eps = a.num_attention_heads, a.layer_norm_eps
        self.d = a.hidden_size // a.num_attention_heads
        w = lambda n: param(take(t, f"{p}.{n}"), dtype)  # noqa: E731
        self.ln1_w, self.ln1_b = w("layer_norm1.weight"), w("layer_norm1.bias")
        self.ln2_w, self.ln2_b = w("layer_norm2.weight"), w("layer_norm2.bias")
        self.wqkv = param(torch.cat([take(t, f"{p}.self_attn.{n}_proj.weight") for n in "qkv"]), dtype)
        self.bqkv = param(torch.cat([take(t, f"{p}.self_attn.{n}_proj.bias") for n in "qkv"]), dtype)
        self.wo, self.bo = w("self_attn.out_proj.weight"), w("self_attn.out_proj.bias")
        self.fc1_w, self.fc1_b = w("mlp.fc1.weight"), w("mlp.fc1.bias")
        self.fc2_w, self.fc2_b = w("mlp.fc2.weight"), w("mlp.fc2.bias")
        self.act = _act(a.hidden_act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, S, C = x.shape
        h = F.layer_norm(x, (C,), self.ln1_w, self.ln1_b, self.eps)
        q, k, v = F.linear(h, self.wqkv, self.bqkv).view(B, S, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.d ** -0.5)
        x = x + F.linear(a.transpose(1, 2).reshape(B, S, C), self.wo, self.bo)
        h = F.layer_norm(x, (C,), self.ln2_w, self.ln2_b, self.eps)
        return x + F.linear(self.act(F.linear(h, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)


class VisionTower(nn.Module):
    """Patch embedding + position buckets + bidirectional encoder + post LayerNorm."""

    def __init__(self, a: VisionArgs, t: dict, p: str, dtype):
        super().__init__()
        self.args = a
        self.side = a.image_size // a.patch_size
        self.patch_w = param(take(t, f"{p}.embeddings.patch_embedding.weight"), dtype)
        self.patch_b = param(take(t, f"{p}.embeddings.patch_embedding.bias"), dtype)
        self.pos = param(take(t, f"{p}.embeddings.position_embedding.weight"), dtype)
        self.layers = nn.ModuleList(VisionLayer(a, t, f"{p}.encoder.layers.{i}", dtype)
                                    for i in range(a.num_hidden_layers))
        self.post_w = param(take(t, f"{p}.post_layernorm.weight"), dtype)
        self.post_b = param(take(t, f"{p}.post_layernorm.bias"), dtype)

    def positions(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """NaViT position ids [B, h*w]: each real patch's fractional coordinate bucketed onto the
        ``side x side`` grid of the position table; padding patches take 0 (transformers' rule)."""
        B, mh, mw = patch_mask.shape
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side)
        nh = patch_mask[:, :, 0].sum(dim=1)
        nw = patch_mask[:, 0, :].sum(dim=1)
        fh = torch.clamp(torch.arange(mh, dtype=torch.float32)[None, :] * (1.0 / nh)[:, None], max=1.0 - 1e-6)
        fw = torch.clamp(torch.arange(mw, dtype=torch.float32)[None, :] * (1.0 / nw)[:, None], max=1.0 - 1e-6)
        bh = torch.bucketize(fh, boundaries, right=True)
        bw = torch.bucketize(fw, boundaries, right=True)
        ids = (bh[:, :, None] * self.side + bw[:, None, :]).reshape(B, -1)
        return torch.where(patch_mask.view(B, -1), ids, torch.zeros_like(ids))

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        P = self.args.patch_size
        x = F.conv2d(pixels, self.patch_w, self.patch_b, stride=P).flatten(2).transpose(1, 2)
        x = x + F.embedding(self.positions(patch_mask), self.pos)
        B, S, C = x.shape
        keys = patch_mask.view(B, S)
        mask = None if bool(keys.all()) else keys[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return F.layer_norm(x, (C,), self.post_w, self.post_b, self.args.layer_norm_eps)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, S, C] -> [B, S / scale^2, C * scale^2], exactly transformers' Idefics3Connector order."""
    bsz, seq, dim = x.size()
    side = int(seq ** 0.5)
    x = x.view(bsz, side, side, dim)
    x = x.view(bsz, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(bsz, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(bsz, seq // (scale * scale), dim * scale * scale)


class Idefics3Model(Model):
    family = "idefics3"

    def __init__(self, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.model_type = config.get("model_type", "idefics3")
        text_cfg = dict(config.get("text_config") or {})
        text_t = {("model." + k[len("model.text_model."):]): v for k, v in tensors.items()
                  if k.startswith("model.text_model.")}
        if "lm_head.weight" in tensors:
            text_t["lm_head.weight"] = tensors["lm_head.weight"]
        text_args = LlamaArgs.from_dict(text_cfg)
        if "lm_head.weight" not in tensors:
            text_args.tie_word_embeddings = True
        self.text = LlamaModel(text_args, text_cfg, text_t, dtype)
        self.args = self.text.args
        self.vision_args = VisionArgs.from_dict(dict(config.get("vision_config") or {}))
        self.vision = VisionTower(self.vision_args, tensors, "model.vision_model", dtype)
        self.scale = int(config.get("scale_factor", 2))
        self.proj = param(take(tensors, "model.connector.modality_projection.proj.weight"), dtype)
        self.image_token_id = int(config.get("image_token_id", 128257))
        side = self.vision_args.image_size // self.vision_args.patch_size
        self.tile_rows = side * side // (self.scale * self.scale)   # embeddings per tile
        self.processor = None
        self.image_marker = "<image>"      # what the chat template renders for an image

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(config, tensors, dtype)

    def cache_specs(self):
        return self.text.cache_specs()

    # --- images --------------------------------------------------------------------------------
    def load_processor(self, folder: str | Path | None = None) -> None:
        """transformers' Pillow image processor for this family from the folder's saved settings
        (models/vision_settings.py), else the defaults sized to the tower. A tile size or an
        ``image_seq_len`` other than the tower's is refused: the rows would not match the tokens."""
        if self.model_type == "smolvlm":
            from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as cls
        else:
            from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as cls
        settings = read_settings(folder)
        tile = self.vision_args.image_size
        proc = transformers_processor(cls, settings, {"size": {"longest_edge": 4 * tile},
                                                      "max_image_size": {"longest_edge": tile}})
        family = self.model_type
        expect(settings, family, "max_image_size.longest_edge", (proc.max_image_size or {}).get("longest_edge"), tile,
               "each tile must be the vision tower's image_size")
        expect(settings, family, "image_seq_len", settings.processor.get("image_seq_len"), self.tile_rows,
               "the <image> tokens per tile must be the rows the connector makes")
        self.processor, self.image_salt = proc, salt(family, proc.to_dict())

    def prepare_image(self, img) -> ImageInput:
        """A decoded PIL image -> its ImageInput (tiles as the processor makes them)."""
        if self.processor is None:
            self.load_processor()
        out = self.processor(images=[[img]], return_row_col_info=True, return_tensors="pt")
        pixels, mask = out["pixel_values"][0], out["pixel_attention_mask"][0]
        digest = content_digest(img, self.image_salt)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        return ImageInput(digest, image_id_of(digest), pixels, mask, pixels.shape[0] * self.tile_rows,
                          (rows, cols), self.image_token_id)

    def image_prompt(self, image: ImageInput) -> str:
        """The text that stands for ``image`` in the prompt (transformers' processor expansion of
        ``<image>``), whose ``<image>`` tokens the engine turns into the image's keys."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        return get_image_prompt_string(image.grid[0], image.grid[1], self.tile_rows, "<fake_token_around_image>",
                                       "<image>", "<global-img>")

    @torch.inference_mode()
    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """[n_rows, hidden]: every tile through the vision tower and the connector, in tile order."""
        pixels = image.pixel_values.to(self.dtype)
        real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels[0].numel()   # transformers drops all-zero tiles
        real[0] |= ~real.any()
        pixels = pixels[real].contiguous()
        if image.pixel_mask is None:
            pmask = torch.ones(pixels.shape[0], pixels.shape[2], pixels.shape[3], dtype=torch.bool)
        else:
            pmask = image.pixel_mask[real].bool()
        P = self.vision_args.patch_size
        patch_mask = pmask.unfold(1, P, P).unfold(2, P, P).sum(dim=(-1, -2)) > 0
        h = self.vision(pixels, patch_mask)
        feats = F.linear(pixel_shuffle(h, self.scale), self.proj)
        return feats.reshape(-1, feats.shape[-1])

    # --- text ----------------------------------------------------------------------------------
    def forward(self, batch):
        x = merge_embeddings(batch.tokens, lambda ids: embedding(ids, self.text.embed, self.dtype), batch.images)
        return self.text.forward_embeds(x, batch)

    def head(self, x):
        return self.text.head(x)
