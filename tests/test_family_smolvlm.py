"""SmolVLM (Idefics3 family): parity with transformers on a prompt with an image, and reuse of
image turns through the engine (docs/images.md)."""

from __future__ import annotations

import random

import pytest
import torch

from turnkv.engine.engine import Engine
from turnkv.images import is_key, model_ids
from turnkv.prompt_cache.store import PromptCache
from vision_chat import picture, req, tiny_smolvlm_config, warm_and_cold

IMAGE, FAKE, GLOBAL, NL = 250, 251, 252, 10     # <image>, <fake_token_around_image>, <global-img>, "\n"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random SmolVLM saved as transformers saves it, with a preprocessor_config.json
    (tiles of 32 px, images up to 64 px: a 2 x 2 grid + the global tile, 4 rows each)."""
    from transformers import SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    torch.manual_seed(0)
    cfg = tiny_smolvlm_config(IMAGE)
    hf = SmolVLMForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # norms and biases away from 1 / 0, so they matter
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("smolvlm")
    hf.save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from turnkv.loading import load_checkpoint
    from turnkv.models.idefics3 import Idefics3Model

    folder, hf = tiny_folder
    ckpt = load_checkpoint(str(folder), dtype=torch.float32, progress=False)
    assert ckpt.architecture == "smolvlm"
    model = Idefics3Model.from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    model.load_processor(folder)
    return model, hf


def image_tokens(model, image) -> list[int]:
    """The prompt tokens of one image: transformers' processor expansion of <image>, with the
    image's keys where the <image> tokens stand."""
    keys, per = image.keys(), model.tile_rows
    rows, cols = image.grid
    out = []
    tile = 0
    for r in range(rows):
        for c in range(cols):
            out += [FAKE, 100 + r * 8 + c] + keys[tile * per:(tile + 1) * per]
            tile += 1
        out.append(NL)
    out += ([NL] if rows else []) + [FAKE, GLOBAL] + keys[tile * per:(tile + 1) * per] + [FAKE]
    assert (tile + 1) * per == image.n_rows
    return out


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(11, 240) for _ in range(n)]


def engine(model, cache: bool = True, **kw) -> Engine:
    return Engine(model, None, fingerprint="tiny-smolvlm", prompt_cache=PromptCache(1 << 30 if cache else 0),
                  prefill_chunk=16, max_context=4096, **kw)


def hf_logits(hf, ids, images):
    kw = {}
    if images:
        kw = dict(pixel_values=torch.cat([im.pixel_values for im in images])[None],
                  pixel_attention_mask=torch.cat([im.pixel_mask for im in images])[None])
    with torch.no_grad():
        return hf(input_ids=torch.tensor([model_ids(ids, IMAGE)]), **kw).logits[0]


def test_logits_and_greedy_match_transformers(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(0))
    assert image.grid == (2, 2) and image.n_rows == 5 * model.tile_rows
    rng = random.Random(1)
    ids = words(rng, 7) + image_tokens(model, image) + words(rng, 9)
    ref = hf_logits(hf, ids, [image])
    eng = engine(model, cache=False)
    state = eng.pool.acquire(ids)
    from turnkv.models.batch import Batch
    with torch.inference_mode():
        embeds = {image.image_id: model.encode_image(image)}
        out = model.forward(Batch.build([(ids, state.caches, "all")], images=embeds))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    # greedy through the engine (chunked prefill across the image) == transformers' generate
    res = eng.generate(req(ids, [image], max_tokens=12))
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.tensor([model_ids(ids, IMAGE)]), pixel_values=image.pixel_values[None],
                          pixel_attention_mask=image.pixel_mask[None], max_new_tokens=12, do_sample=False)
    assert res.token_ids == gen[0, len(ids):].tolist()
    torch.testing.assert_close(res.first_logits, ref[-1], atol=1e-4, rtol=0)


def chat(model, images, turns=3, seed=2, system=None):
    """Turn prompts built as a client would: system, user 1 (image + text), then text turns
    (the previous prompt + the reply + a new user message)."""
    rng = random.Random(seed)
    first = (system or words(rng, 12)) + sum((image_tokens(model, im) for im in images), []) + words(rng, 6)
    return first, [words(rng, 5) for _ in range(turns - 1)]


def test_image_turn_then_text_turns_reuse_equals_cold(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(3))
    first, users = chat(model, [image])
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [image], first, users)
    last_key = max(i for i, t in enumerate(first) if is_key(t))
    for a in res[1:]:     # every later turn restores the image's tokens instead of prefilling them
        assert a.usage.cached_tokens > last_key and a.stats.reuse_from in ("prefix", "truncated")
    enc = warm.encoder_cache.stats()
    assert enc["encoded"] == 1 and enc["misses"] == 1 and enc["hits"] == 0   # turns 2, 3 never touch it
    # the oracle: the last turn's first logits are transformers' on the whole conversation
    torch.testing.assert_close(res[-1].first_logits, hf_logits(hf, prompts[-1], [image])[-1], atol=1e-4, rtol=0)


def test_different_image_reuses_up_to_that_image(tiny):
    model, _ = tiny
    a, b = model.prepare_image(picture(4)), model.prepare_image(picture(5))
    assert a.image_id != b.image_id
    first_a, _ = chat(model, [a], seed=6)
    first_b, _ = chat(model, [b], seed=6)     # same text, another picture
    warm = engine(model)
    warm.generate(req(first_a, [a]))
    res = warm.generate(req(first_b, [b]))
    first_key = next(i for i, t in enumerate(first_b) if is_key(t))
    assert first_a[:first_key] == first_b[:first_key] and first_a[first_key] != first_b[first_key]
    # reuse stops exactly at the image: the text before it and the <fake>/<row> tokens are reused
    assert res.usage.cached_tokens == first_key
    cold = engine(model, cache=False).generate(req(first_b, [b]))
    assert res.token_ids == cold.token_ids
    torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)


def test_same_image_new_conversation_hits_encoder_cache(tiny):
    model, _ = tiny
    image = model.prepare_image(picture(7))
    one, _ = chat(model, [image], seed=8)
    two, _ = chat(model, [image], seed=9)     # another system prompt: no common prefix
    assert one[0] != two[0]
    warm = engine(model)
    warm.generate(req(one, [image]))
    before = warm.encoder_cache.stats()
    res = warm.generate(req(two, [image]))
    after = warm.encoder_cache.stats()
    assert res.usage.cached_tokens == 0                           # prefix miss
    assert after["hits"] == before["hits"] + 1 and after["encoded"] == before["encoded"] == 1
    cold = engine(model, cache=False).generate(req(two, [image]))
    assert res.token_ids == cold.token_ids
    torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)


def test_image_request_batched_with_text_requests(tiny):
    model, _ = tiny
    image = model.prepare_image(picture(10))
    rng = random.Random(11)
    reqs = [req(words(rng, 20), [], 8), req(chat(model, [image], seed=12)[0], [image], 8), req(words(rng, 33), [], 8)]
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


def test_images_refused_where_they_do_not_belong(tiny):
    model, _ = tiny
    image = model.prepare_image(picture(13))
    ids = [5, 6] + image_tokens(model, image)
    with pytest.raises(ValueError, match="does not carry"):
        engine(model).submit(req(ids, []), lambda ev: None)
    from tiny import tiny_llama
    text_only = Engine(tiny_llama()[0], None, max_context=4096)
    with pytest.raises(ValueError, match="does not take images"):
        text_only.submit(req(ids, [image]), lambda ev: None)


def test_second_image_in_turn_three_reuses_the_first(tiny):
    model, hf = tiny
    a, b = model.prepare_image(picture(14)), model.prepare_image(picture(15))
    first, users = chat(model, [a], seed=16)
    users[1] = users[1][:2] + image_tokens(model, b) + users[1][2:]      # turn 3 brings a second picture
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [a, b], first, users)
    # turn 3 restores everything before the new picture, the first picture included
    assert res[2].usage.cached_tokens >= len(prompts[1])
    enc = warm.encoder_cache.stats()
    assert enc["encoded"] == 2 and enc["hits"] == 0
    torch.testing.assert_close(res[2].first_logits, hf_logits(hf, prompts[2], [a, b])[-1], atol=1e-4, rtol=0)


def test_idefics3_logits_match_transformers(tmp_path):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from turnkv.loading import load_checkpoint
    from turnkv.models.idefics3 import Idefics3Model

    torch.manual_seed(1)
    cfg = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=IMAGE)
    hf = Idefics3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    assert ckpt.architecture == "idefics3"
    model = Idefics3Model.from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    model.load_processor(tmp_path)
    image = model.prepare_image(picture(17, (30, 60)))
    ids = [3, 4, 5] + image_tokens(model, image) + [6, 7, 8, 9]
    res = engine(model, cache=False).generate(req(ids, [image], max_tokens=8))
    torch.testing.assert_close(res.first_logits, hf_logits(hf, ids, [image])[-1], atol=1e-4, rtol=0)
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.tensor([model_ids(ids, IMAGE)]), pixel_values=image.pixel_values[None],
                          pixel_attention_mask=image.pixel_mask[None], max_new_tokens=8, do_sample=False)
    assert res.token_ids == gen[0, len(ids):].tolist()


def test_engine_load_takes_the_folders_preprocessing(tiny_folder, tiny):
    folder, _ = tiny_folder
    eng = Engine.load(str(folder), progress=False, prompt_cache=PromptCache(1 << 30))
    assert eng.family == "idefics3" and eng.encoder_cache is not None
    image = eng.model.prepare_image(picture(18))
    assert image.grid == (2, 2) and image.n_rows == 20      # the folder's 64 px / 32 px tiles, not the defaults
    ids = [3, 4] + image_tokens(eng.model, image) + [5, 6]
    res = eng.generate(req(ids, [image]))
    assert res.token_ids == engine(tiny[0], cache=False).generate(req(ids, [image])).token_ids
