"""LFM2-VL (SigLIP 2 NaFlex + pixel-unshuffle projector + the LFM2 conv / attention hybrid): parity
with transformers 5.24, reuse of image turns on a recurrent hybrid, and the media checkpoint
(docs/images.md)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from turnkv.engine.engine import Engine
from turnkv.images import is_key, last_image_end, model_ids
from turnkv.prompt_cache.store import PromptCache
from vision_chat import edit_after_the_image, picture, req, tiny_lfm2_vl_config, warm_and_cold

IMAGE, START, END, THUMB, NL = 250, 251, 252, 253, 10
PREP = dict(tile_size=32, encoder_patch_size=4, min_image_tokens=4, max_image_tokens=16, downsample_factor=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random LFM2-VL saved as transformers saves it (patches of 4 px, a 4 x 4 position
    table, 32 px tiles), with the processor settings in preprocessor_config.json."""
    import json

    from transformers import Lfm2VlForConditionalGeneration

    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    torch.manual_seed(0)
    cfg = tiny_lfm2_vl_config(IMAGE)
    hf = Lfm2VlForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # norms and biases away from their init, so they matter
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("lfm2vl")
    hf.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Lfm2VlImageProcessor",
                                                                 **PREP}))
    ckpt = load_checkpoint(str(folder), dtype=torch.float32, progress=False)
    assert ckpt.architecture == "lfm2_vl"
    model = family_class("lfm2_vl").from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    model.load_processor(folder)
    return model, hf


def image_tokens(model, image) -> list[int]:
    """The processor's expansion (image special tokens on), keys in place of <image>."""
    keys, (rows, cols) = iter(image.keys()), image.grid
    per_tile = (PREP["tile_size"] // 4 // 2) ** 2
    out = [START]
    if rows > 1 or cols > 1:
        for r in range(rows):
            for c in range(cols):
                out += [100 + r * 8 + c] + [next(keys) for _ in range(per_tile)]
        out.append(THUMB)
    out += list(keys) + [END]
    return out


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(11, 99) for _ in range(n)]


def engine(model, cache: bool = True) -> Engine:
    return Engine(model, None, fingerprint="tiny-lfm2vl", prompt_cache=PromptCache(1 << 30 if cache else 0),
                  prefill_chunk=16, max_context=4096)


def hf_inputs(ids, images) -> dict:
    kw = {"input_ids": torch.tensor([model_ids(ids, IMAGE)])}
    if images:
        kw.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                  pixel_attention_mask=torch.cat([im.pixel_mask for im in images]),
                  spatial_shapes=torch.cat([im.extra["spatial_shapes"] for im in images]))
    return kw


def hf_logits(hf, ids, images):
    with torch.no_grad():
        return hf(**hf_inputs(ids, images)).logits[0]


def test_prompt_expansion_is_the_processors(tiny):
    from types import SimpleNamespace

    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    model, _ = tiny
    fake = SimpleNamespace(image_start_token="<|image_start|>", image_end_token="<|image_end|>",
                           image_thumbnail_token="<|img_thumbnail|>", image_token="<image>")
    for size in ((100, 150), (40, 50), (300, 90)):
        image = model.prepare_image(picture(0, size))
        rows, cols = image.grid
        h, w = image.extra["resized"]
        per_tile = math.ceil((PREP["tile_size"] // 4) / 2) ** 2
        for_image = math.ceil((h // 4) / 2) * math.ceil((w // 4) / 2)
        want = Lfm2VlProcessor._build_image_tokens(fake, rows, cols, per_tile, for_image, True, True)
        assert model.image_prompt(image) == want
        assert want.count("<image>") == image.n_rows


def test_logits_and_greedy_match_transformers(tiny):
    model, hf = tiny
    for size in ((100, 150), (40, 50)):           # a 2 x 3 grid of tiles + the thumbnail; one tile
        image = model.prepare_image(picture(1, size))
        rng = random.Random(2)
        ids = words(rng, 7) + image_tokens(model, image) + words(rng, 9)
        ref = hf_logits(hf, ids, [image])
        res = engine(model, cache=False).generate(req(ids, [image], max_tokens=10))
        torch.testing.assert_close(res.first_logits, ref[-1], atol=1e-4, rtol=0)
        with torch.no_grad():
            gen = hf.generate(**hf_inputs(ids, [image]), max_new_tokens=10, do_sample=False)
        assert res.token_ids == gen[0, len(ids):].tolist()
    assert image.grid == (1, 1) and model.prepare_image(picture(1, (100, 150))).grid == (2, 3)


def test_image_turn_then_text_turns_on_the_recurrent_hybrid(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(3, (100, 150)))
    rng = random.Random(4)
    first = words(rng, 8) + image_tokens(model, image) + words(rng, 6)
    users = [words(rng, 7) for _ in range(3)]
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [image], first, users)
    for p, u, a in zip(prompts[1:], users, res[1:]):   # the conv state past the image and the reply, exactly
        assert a.usage.cached_tokens == len(p) - len(u) and a.stats.reuse_from == "prefix"
    assert warm.encoder_cache.stats()["encoded"] == 1
    torch.testing.assert_close(res[-1].first_logits, hf_logits(hf, prompts[-1], [image])[-1], atol=1e-4, rtol=0)


def test_edit_after_the_image_restores_the_media_checkpoint(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(5, (40, 50)))
    rng = random.Random(6)
    system = words(rng, 6)
    a = system + words(rng, 3) + image_tokens(model, image) + words(rng, 10)
    end = last_image_end(a)
    b = a[:end] + [END] + words(rng, 10)          # the text after the image edited
    assert a[end + 1] != b[end + 1]
    edit_after_the_image(engine(model), engine(model, cache=False), image, system, a, b,
                         lambda ids: hf_logits(hf, ids, [image]))


def test_different_image_and_the_same_image_elsewhere(tiny):
    model, _ = tiny
    x, y = model.prepare_image(picture(7, (40, 50))), model.prepare_image(picture(8, (40, 50)))
    rng = random.Random(9)
    head, tail = words(rng, 10), words(rng, 6)
    warm = engine(model)
    warm.generate(req(head + image_tokens(model, x) + tail, [x], boundaries=[len(head)]))
    ids = head + image_tokens(model, y) + tail
    res = warm.generate(req(ids, [y], boundaries=[len(head)]))
    # the conv state cannot be cut back: reuse stops at the last checkpoint before the new image
    assert res.usage.cached_tokens == len(head) < next(i for i, t in enumerate(ids) if is_key(t))
    cold = engine(model, cache=False).generate(req(ids, [y]))
    assert res.token_ids == cold.token_ids
    torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)
    # x again in a new conversation: a prefix miss, an encoder-cache hit
    other = words(rng, 5) + image_tokens(model, x) + words(rng, 3)
    again = warm.generate(req(other, [x]))
    enc = warm.encoder_cache.stats()
    assert again.usage.cached_tokens == 0 and enc["hits"] == 1 and enc["encoded"] == 2
    alone = engine(model, cache=False).generate(req(other, [x]))
    assert again.token_ids == alone.token_ids
