"""Gemma 3 vision (transformers ``gemma3``, Gemma3ForConditionalGeneration): a SigLIP vision
encoder, the multimodal projector (average pool to ``mm_tokens_per_image`` rows, Gemma RMSNorm,
projection) and the Gemma 3 text model (models/gemma3.py: sliding-window + global layers).

Image placeholder positions carry image keys (turnkv/images.py) and take the projected image rows
unscaled (the token embeddings are scaled by sqrt(hidden), the image features are not: transformers
scatters them after the scaled lookup). As in transformers 5.24 with ``token_type_ids``, the
image tokens of one run attend to each other both ways (on sliding layers within the window too):
the scheduler never splits a run across prefill chunks (``bidirectional_images``) and the engine
accepts only whole images (images.whole_images).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..images import ImageInput, content_digest, image_id_of, merge_embeddings
from .base import Model, embedding
from .gemma3 import Gemma3Model, image_blocks
from .gemma3 import ModelArgs as TextArgs
from .idefics3 import VisionArgs, VisionLayer
from .tensors import param, take
from .vision_settings import expect, read_settings, salt, transformers_processor



def _prefix(tensors: dict, candidates: tuple[str, ...], probe: str) -> str:
    """The first of ``candidates`` under which ``probe`` is a tensor name."""
    for p in candidates:
        if p + probe in tensors:
            return p
    return candidates[0]       # take() then names what is missing


class SiglipTower(nn.Module):
    """Patch embedding + learned positions (one per patch, no interpolation) + encoder + post LayerNorm."""

    def __init__(self, a: VisionArgs, t: dict, p: str, dtype):
        super().__init__()
        self.args = a
        self.patch_w = param(take(t, f"{p}.embeddings.patch_embedding.weight"), dtype)
        self.patch_b = param(take(t, f"{p}.embeddings.patch_embedding.bias"), dtype)
        self.pos = param(take(t, f"{p}.embeddings.position_embedding.weight"), dtype)
        self.layers = nn.ModuleList(VisionLayer(a, t, f"{p}.encoder.layers.{i}", dtype)
                                    for i in range(a.num_hidden_layers))
        self.post_w = param(take(t, f"{p}.post_layernorm.weight"), dtype)
        self.post_b = param(take(t, f"{p}.post_layernorm.bias"), dtype)
        for k in [k for k in t if k.startswith(f"{p}.head.")]:     # the pooling head: unused by Gemma 3
            del t[k]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(pixels, self.patch_w, self.patch_b, stride=self.args.patch_size).flatten(2).transpose(1, 2)
        x = x + self.pos[None, : x.shape[1]]
        for layer in self.layers:
            x = layer(x, None)
        return F.layer_norm(x, (x.shape[-1],), self.post_w, self.post_b, self.args.layer_norm_eps)


class Gemma3VisionModel(Model):
    family = "gemma3_vision"
    bidirectional_images = True     # the scheduler keeps each image's run in one prefill chunk

    def __init__(self, config: dict, tensors: dict, dtype: torch.dtype):
        super().__init__()
        from ..loading.hf import _add_rope_aliases

        self.config, self.dtype = config, dtype
        text_cfg = dict(config.get("text_config") or {})
        text_cfg.setdefault("model_type", "gemma3_text")
        _add_rope_aliases(text_cfg)
        # transformers 5 names (model.language_model.*) or the checkpoint layout it saves and Google
        # ships (language_model.model.*, vision_tower[.vision_model].*, multi_modal_projector.*)
        pre = _prefix(tensors, ("model.language_model.", "language_model.model."), "embed_tokens.weight")
        text_t = {("model." + k[len(pre):]): v for k, v in tensors.items() if k.startswith(pre)}
        for head in ("lm_head.weight", "language_model.lm_head.weight"):
            if head in tensors:
                text_t["lm_head.weight"] = tensors[head]
        self.text = Gemma3Model(TextArgs.from_dict(text_cfg), text_cfg, text_t, dtype)
        self.args = self.text.args
        self.vision_args = VisionArgs.from_dict(dict(config.get("vision_config") or {}))
        vp = _prefix(tensors, ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                               "vision_tower."), "embeddings.patch_embedding.weight")
        self.vision = SiglipTower(self.vision_args, tensors, vp[:-1], dtype)
        mp = _prefix(tensors, ("model.multi_modal_projector.", "multi_modal_projector."),
                     "mm_input_projection_weight")[:-1]
        self.proj = param(take(tensors, f"{mp}.mm_input_projection_weight"), dtype)      # [vision, text]
        self.proj_norm = param(1.0 + take(tensors, f"{mp}.mm_soft_emb_norm.weight").float(), torch.float32)
        self.mm_tokens = int(config.get("mm_tokens_per_image", 256))
        self.patches_side = self.vision_args.image_size // self.vision_args.patch_size
        self.kernel = self.patches_side // int(self.mm_tokens ** 0.5)
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index", 262144)))
        self.processor = None
        self.image_marker = "<start_of_image>"      # what the chat template renders for an image

    @classmethod
    def from_checkpoint(cls, config, tensors, dtype):
        return cls(config, tensors, dtype)

    def cache_specs(self):
        return self.text.cache_specs()

    # --- images --------------------------------------------------------------------------------
    def load_processor(self, folder: str | Path | None = None) -> None:
        """transformers' Pillow image processor (resize to the tower's size, rescale, normalize) from
        the folder's saved settings (models/vision_settings.py). Pan-and-scan crops, another image
        size or another ``image_seq_length`` than the tower's are refused."""
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        settings = read_settings(folder)
        side = self.vision_args.image_size
        proc = transformers_processor(Gemma3ImageProcessorPil, settings,
                                      {"size": {"height": side, "width": side}, "image_mean": [0.5] * 3,
                                       "image_std": [0.5] * 3})
        if proc.do_pan_and_scan:
            raise settings.refuse("gemma3", "do_pan_and_scan", proc.do_pan_and_scan,
                                  "turnkv encodes one crop per image")
        expect(settings, "gemma3", "size", dict(proc.size or {}), {"height": side, "width": side},
               "the learned positions fit one image size")
        expect(settings, "gemma3", "image_seq_length", settings.processor.get("image_seq_length"), self.mm_tokens,
               "the image tokens must be the config's mm_tokens_per_image")
        self.processor, self.image_salt = proc, salt("gemma3", proc.to_dict())

    def prepare_image(self, img) -> ImageInput:
        if self.processor is None:
            self.load_processor()
        pixels = self.processor(images=[img], return_tensors="pt")["pixel_values"]     # [1, 3, H, W]
        digest = content_digest(img, self.image_salt)
        return ImageInput(digest, image_id_of(digest), pixels, None, self.mm_tokens, (0, 0), self.image_token_id)

    def image_prompt(self, image: ImageInput) -> str:
        """transformers' Gemma3Processor.full_image_sequence."""
        return "\n\n<start_of_image>" + "<image_soft_token>" * image.n_rows + "<end_of_image>\n\n"

    @torch.inference_mode()
    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """[mm_tokens, hidden]: SigLIP, average pool, RMSNorm (1 + w, float32), projection."""
        h = self.vision(image.pixel_values.to(self.dtype))                  # [1, P*P, C]
        B, S, C = h.shape
        grid = h.transpose(1, 2).reshape(B, C, self.patches_side, self.patches_side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        xf = pooled.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.vision_args.layer_norm_eps)
        normed = (normed * self.proj_norm).to(pooled.dtype)
        return torch.matmul(normed, self.proj).type_as(h)[0]

    # --- text ----------------------------------------------------------------------------------
    def forward(self, batch):
        t = self.text
        x = merge_embeddings(batch.tokens, lambda ids: embedding(ids, t.embed, self.dtype) * t.embed_scale,
                             batch.images)
        return t.forward_embeds(x, batch, image_blocks(batch))

    def head(self, x):
        return self.text.head(x)
