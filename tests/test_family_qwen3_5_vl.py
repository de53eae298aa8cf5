"""Qwen3.5-VL (ViT + patch merger + the Qwen 3.5 gated delta-net hybrid under M-RoPE): parity with
transformers 5.24's Qwen3_5ForConditionalGeneration, reuse of image turns where a token's rotary
position is not its index (the rope delta rides in the state, docs/images.md), the media
checkpoint, a different image, and batching beside text requests."""

from __future__ import annotations

import json
import random

import pytest
import torch

from turnkv.engine.engine import Engine
from turnkv.models.batch import Batch
from turnkv.images import is_key, last_image_end, model_ids
from turnkv.models.qwen3_5_vl import Qwen3_5VlModel, _read_delta
from turnkv.prompt_cache.store import PromptCache
from vision_chat import edit_after_the_image, picture, req, tiny_qwen3_5_vl_config, warm_and_cold

IMAGE, START, END = 250, 251, 252
PREP = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 8 * 8 * 4, "max_pixels": 8 * 8 * 30,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Qwen3.5-VL saved as transformers saves it (4 px patches, merge 2, a 4 x 4
    position table, M-RoPE over t / h / w), with the processor settings in preprocessor_config.json."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = tiny_qwen3_5_vl_config(IMAGE, START, END)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # norms and biases away from their init, so they matter
        for _, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("qwen3_5vl")
    hf.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor",
                                                                 **PREP}))
    return folder, hf


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    folder, hf = tiny_folder
    ckpt = load_checkpoint(str(folder), dtype=torch.float32, progress=False)
    assert ckpt.architecture == "qwen3_5"
    model = family_class("qwen3_5").from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    assert isinstance(model, Qwen3_5VlModel) and model.family == "qwen3_5_vl"
    model.load_processor(folder)
    return model, hf


def image_tokens(image) -> list[int]:
    """<|vision_start|>, the image's keys (the processor's <|image_pad|> run), <|vision_end|>."""
    return [START, *image.keys(), END]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(11, 99) for _ in range(n)]


def engine(model, cache: bool = True) -> Engine:
    return Engine(model, None, fingerprint="tiny-qwen3_5vl", prompt_cache=PromptCache(1 << 30 if cache else 0),
                  prefill_chunk=16, max_context=4096)


def hf_inputs(ids, images) -> dict:
    plain = model_ids(ids, IMAGE)
    kw = {"input_ids": torch.tensor([plain]),
          "mm_token_type_ids": torch.tensor([[1 if t == IMAGE else 0 for t in plain]])}
    if images:
        kw.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                  image_grid_thw=torch.tensor([list(im.extra["grid_thw"]) for im in images]))
    return kw


def hf_logits(hf, ids, images):
    with torch.no_grad():
        return hf(**hf_inputs(ids, images)).logits[0]


def test_preprocessing_and_positions(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(0, (40, 72)))
    t, h, w = image.extra["grid_thw"]
    assert (t, h, w) == (1, 8, 14) and image.n_rows == 28 and image.grid == (4, 7)   # resized to max_pixels
    # the rope index: the M-RoPE positions of every row equal transformers' get_rope_index
    rng = random.Random(1)
    ids = words(rng, 5) + image_tokens(image) + words(rng, 4)
    want, delta = hf.model.get_rope_index(**{k: v for k, v in hf_inputs(ids, [image]).items()
                                             if k in ("input_ids", "mm_token_type_ids", "image_grid_thw")})
    got, end = model._positions(ids, 0, 0)
    assert torch.equal(got, want[:, 0]) and end == int(delta) == 7 - 28
    for cut in (3, 6, 30):                        # any chunking of the prompt gives the same positions
        a, d = model._positions(ids[:cut], 0, 0)
        b, _ = model._positions(ids[cut:], cut, d)
        assert torch.equal(torch.cat([a, b], 1), got)


def test_engine_load_takes_the_folders_preprocessing(tiny_folder, tiny):
    model, _ = tiny
    eng = Engine.load(str(tiny_folder[0]), progress=False, prompt_cache=PromptCache(0))
    assert eng.model.family == "qwen3_5_vl" and eng.encoder_cache is not None
    a, b = eng.model.prepare_image(picture(2, (40, 56))), model.prepare_image(picture(2, (40, 56)))
    assert torch.equal(a.pixel_values, b.pixel_values) and a.keys() == b.keys() and a.grid == b.grid


def test_logits_and_greedy_match_transformers(tiny):
    model, hf = tiny
    for size in ((40, 72), (16, 16)):
        image = model.prepare_image(picture(1, size))
        rng = random.Random(2)
        ids = words(rng, 7) + image_tokens(image) + words(rng, 9)
        ref = hf_logits(hf, ids, [image])
        # every position, prefilled in chunks of 7 that cut through the image
        from turnkv.cache.specs import make_caches
        caches, emb, rows = make_caches(model.cache_specs()), {image.image_id: model.encode_image(image)}, []
        for at in range(0, len(ids), 7):
            rows.append(model.forward(Batch.build([(ids[at:at + 7], caches, "all")], images=emb)))
        torch.testing.assert_close(torch.cat(rows), ref, atol=1e-4, rtol=0)
        res = engine(model, cache=False).generate(req(ids, [image], max_tokens=10))
        torch.testing.assert_close(res.first_logits, ref[-1], atol=1e-4, rtol=0)
        with torch.no_grad():
            gen = hf.generate(**hf_inputs(ids, [image]), max_new_tokens=10, do_sample=False)
        assert res.token_ids == gen[0, len(ids):].tolist()
        # without M-RoPE (positions = indices) the logits differ: the 3-D positions are exercised
        plain = hf(input_ids=torch.tensor([model_ids(ids, IMAGE)]), pixel_values=image.pixel_values,
                   image_grid_thw=torch.tensor([list(image.extra["grid_thw"])]),
                   position_ids=torch.arange(len(ids))[None],
                   mm_token_type_ids=hf_inputs(ids, [image])["mm_token_type_ids"])
        assert (plain.logits[0, -1] - ref[-1]).abs().max() > 1e-3


def test_image_turn_then_text_turns(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(3, (40, 56)))
    rng = random.Random(4)
    first = words(rng, 8) + image_tokens(image) + words(rng, 6)
    users = [words(rng, 7) for _ in range(3)]
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [image], first, users)
    for p, u, a in zip(prompts[1:], users, res[1:]):   # the state (and its rope delta) past the image, exactly
        assert a.usage.cached_tokens == len(p) - len(u) and a.stats.reuse_from == "prefix"
    assert warm.encoder_cache.stats()["encoded"] == 1
    torch.testing.assert_close(res[-1].first_logits, hf_logits(hf, prompts[-1], [image])[-1], atol=1e-4, rtol=0)


def test_stored_delta_is_the_image_shift(tiny):
    from turnkv.cache.specs import make_caches

    model, _ = tiny
    image = model.prepare_image(picture(3, (40, 56)))
    lh, lw = image.grid
    caches = make_caches(model.cache_specs())
    emb = {image.image_id: model.encode_image(image)}
    model.forward(Batch.build([([5, 6] + image_tokens(image)[:-3], caches, "none")], images=emb))
    assert _read_delta(caches[model.mrope_layer]) == 0           # the image is not finished yet
    model.forward(Batch.build([(image_tokens(image)[-3:] + [7], caches, "none")], images=emb))
    assert _read_delta(caches[model.mrope_layer]) == max(lh, lw) - lh * lw < 0
    from turnkv.cache.recurrent import StateCache
    from turnkv.models.qwen3_5_vl import _write_delta
    for dtype in (torch.bfloat16, torch.float16, torch.float32):   # exact in any state dtype
        cache = StateCache({"mrope": (4,)}, dtype)
        for delta in (0, -1, -127, -128, -99_999, -(128 ** 4 - 1)):
            _write_delta(cache, delta)
            assert _read_delta(cache) == delta


def test_edit_after_the_image_restores_the_media_checkpoint(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(5, (16, 24)))
    rng = random.Random(6)
    system = words(rng, 6)
    a = system + words(rng, 3) + image_tokens(image) + words(rng, 10)
    end = last_image_end(a)
    b = a[:end] + [END] + words(rng, 10)          # the text right after the image edited
    assert a[end + 1] != b[end + 1]
    edit_after_the_image(engine(model), engine(model, cache=False), image, system, a, b,
                         lambda ids: hf_logits(hf, ids, [image]))


def test_different_image_stops_reuse_at_it(tiny):
    model, _ = tiny
    x, y = model.prepare_image(picture(7, (16, 24))), model.prepare_image(picture(8, (16, 24)))
    rng = random.Random(9)
    head, tail = words(rng, 10), words(rng, 6)
    warm = engine(model)
    warm.generate(req(head + image_tokens(x) + tail, [x], boundaries=[len(head)]))
    ids = head + image_tokens(y) + tail
    res = warm.generate(req(ids, [y], boundaries=[len(head)]))
    # the delta-net state cannot be cut back: reuse stops at the last checkpoint before the new image
    assert res.usage.cached_tokens == len(head) < next(i for i, t in enumerate(ids) if is_key(t))
    cold = engine(model, cache=False).generate(req(ids, [y]))
    assert res.token_ids == cold.token_ids
    torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)


def test_image_request_batched_with_text_requests(tiny):
    model, _ = tiny
    image = model.prepare_image(picture(10, (40, 56)))
    rng = random.Random(11)
    chat = words(rng, 5) + image_tokens(image) + words(rng, 8)
    reqs = [req(words(rng, 20), [], 8), req(chat, [image], 8), req(words(rng, 33), [], 8)]
    alone = [engine(model, cache=False).generate(r) for r in reqs]
    eng = engine(model, cache=False)
    got: dict[int, object] = {}
    for i, r in enumerate(reqs):
        eng.submit(r, lambda ev, i=i: got.__setitem__(i, ev) if hasattr(ev, "token_ids") else None)
    while len(got) < len(reqs):
        assert eng.step()
    for i, r in enumerate(alone):
        assert got[i].token_ids == r.token_ids
        torch.testing.assert_close(got[i].first_logits, r.first_logits, atol=1e-5, rtol=0)


def test_second_image_in_turn_three_and_the_same_image_elsewhere(tiny):
    model, hf = tiny
    x, y = model.prepare_image(picture(12, (40, 56))), model.prepare_image(picture(13, (24, 40)))
    rng = random.Random(14)
    warm = engine(model)
    p1 = words(rng, 6) + image_tokens(x) + words(rng, 5)
    r1 = warm.generate(req(p1, [x]))
    p2 = p1 + r1.token_ids[:-1] + words(rng, 4)
    r2 = warm.generate(req(p2, [x]))
    p3 = p2 + r2.token_ids[:-1] + words(rng, 3) + image_tokens(y) + words(rng, 4)
    r3 = warm.generate(req(p3, [x, y]))
    # turn 3 restores turn 2 (the first image, its rope delta) and shifts again after the second
    assert r3.usage.cached_tokens == len(p2) + len(r2.token_ids) - 1
    cold = engine(model, cache=False).generate(req(p3, [x, y]))
    assert r3.token_ids == cold.token_ids
    torch.testing.assert_close(r3.first_logits, cold.first_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(r3.first_logits, hf_logits(hf, p3, [x, y])[-1], atol=1e-4, rtol=0)
    assert warm.encoder_cache.stats()["encoded"] == 2
    # x again in a new conversation: a prefix miss, an encoder-cache hit
    other = words(rng, 5) + image_tokens(x) + words(rng, 3)
    again = warm.generate(req(other, [x]))
    enc = warm.encoder_cache.stats()
    assert again.usage.cached_tokens == 0 and enc["hits"] == 1 and enc["encoded"] == 2
    assert again.token_ids == engine(model, cache=False).generate(req(other, [x])).token_ids
