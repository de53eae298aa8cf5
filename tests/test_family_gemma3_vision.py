"""Gemma 3 vision (SigLIP + projector + sliding-window / global text model): parity with
transformers 5.24 (image tokens attend to each other both ways, as with token_type_ids), reuse
of image turns through the engine past a wrapped window, and the media checkpoint right after the
last image (docs/images.md)."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import greedy
from turnkv.engine.engine import Engine, GenerationRequest
from turnkv.images import is_key, last_image_end, model_ids
from turnkv.prompt_cache.store import PromptCache
from vision_chat import edit_after_the_image, picture, req, warm_and_cold

IMAGE, BOI, EOI, BOS, SOT, EOT, NL = 250, 251, 252, 2, 253, 254, 10
WINDOW, SLACK, N_IMAGE = 16, 4, 16


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Gemma 3 vision model saved as transformers saves it (SigLIP on 32 px images in
    4 px patches, pooled to 16 image tokens; text window 16)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(0)
    cfg = Gemma3Config(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                         max_position_embeddings=4096),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=4),
        mm_tokens_per_image=N_IMAGE, image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # norms and biases away from their init, so they matter
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("gemma3v")
    hf.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
                            image_std=[0.5, 0.6, 0.7]).save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    folder, hf = tiny_folder
    ckpt = load_checkpoint(str(folder), dtype=torch.float32, progress=False)
    assert ckpt.architecture == "gemma3"
    model = family_class("gemma3").from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    model.load_processor(folder)
    return model, hf


def image_tokens(image) -> list[int]:
    """transformers' full_image_sequence, "\\n\\n<boi>" + soft tokens + "<eoi>\\n\\n", with keys."""
    return [NL, NL, BOI] + image.keys() + [EOI, NL, NL]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(11, 240) for _ in range(n)]


def engine(model, cache: bool = True, chunk: int = 8) -> Engine:
    return Engine(model, None, fingerprint="tiny-gemma3v", prompt_cache=PromptCache(1 << 30 if cache else 0),
                  prefill_chunk=chunk, max_context=4096, slack=SLACK)


def hf_logits(hf, ids, images, bidirectional=True):
    plain = torch.tensor([model_ids(ids, IMAGE)])
    kw = {"pixel_values": torch.cat([im.pixel_values for im in images])} if images else {}
    if bidirectional:
        kw["token_type_ids"] = (plain == IMAGE).long()
    with torch.no_grad():
        return hf(input_ids=plain, **kw).logits[0]


def test_logits_and_greedy_match_transformers(tiny):
    from turnkv.models.batch import Batch

    model, hf = tiny
    image = model.prepare_image(picture(0))
    assert image.n_rows == N_IMAGE and tuple(image.pixel_values.shape) == (1, 3, 32, 32)
    rng = random.Random(1)
    ids = [BOS] + words(rng, 7) + image_tokens(image) + words(rng, 9)
    ref = hf_logits(hf, ids, [image])
    eng = engine(model, cache=False)
    with torch.inference_mode():
        state = eng.pool.acquire(ids)
        embeds = {image.image_id: model.encode_image(image)}
        out = model.forward(Batch.build([(ids, state.caches, "all")], images=embeds))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    # the bidirectional image block matters: without token_type_ids transformers computes otherwise
    assert (hf_logits(hf, ids, [image], bidirectional=False) - ref).abs().max() > 1e-3
    # greedy through the engine (chunks of 8: the scheduler keeps the 16 image rows together)
    res = eng.generate(req(ids, [image], max_tokens=10))
    plain = torch.tensor([model_ids(ids, IMAGE)])
    with torch.no_grad():
        gen = hf.generate(input_ids=plain, pixel_values=image.pixel_values, token_type_ids=(plain == IMAGE).long(),
                          max_new_tokens=10, do_sample=False)
    assert res.token_ids == gen[0, len(ids):].tolist()
    torch.testing.assert_close(res.first_logits, ref[-1], atol=1e-4, rtol=0)


def test_partial_images_refused(tiny):
    model, _ = tiny
    image = model.prepare_image(picture(1))
    keys = image.keys()
    for ids in ([BOS, BOI] + keys[:5] + [EOI], [BOS, BOI] + keys[1:] + [EOI], [BOS] + keys[::-1]):
        with pytest.raises(ValueError, match="whole and in order"):
            engine(model).submit(req(ids, [image]), lambda ev: None)


def test_image_turn_then_text_turns_past_the_window_reuse_equals_cold(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(3))
    rng = random.Random(2)
    first = [BOS] + words(rng, 6) + image_tokens(image) + words(rng, 6)
    users = [words(rng, 9) for _ in range(3)]
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [image], first, users)
    end = last_image_end(first)
    assert len(prompts[-1]) - end > WINDOW + SLACK          # the sliding rings wrapped past the image
    for p, a in zip(prompts[:-1], res[1:]):     # each later turn restores the whole previous turn
        assert a.usage.cached_tokens >= len(p) and a.stats.reuse_from == "prefix"
    enc = warm.encoder_cache.stats()
    assert enc["encoded"] == 1 and enc["hits"] == 0
    torch.testing.assert_close(res[-1].first_logits, hf_logits(hf, prompts[-1], [image])[-1], atol=1e-4, rtol=0)


def test_edit_after_the_image_restores_the_media_checkpoint(tiny):
    model, hf = tiny
    image = model.prepare_image(picture(4))
    rng = random.Random(5)
    system = [BOS] + words(rng, 5)
    # long enough after the image that no later entry can be cut back to it: the rings (window 16,
    # slack 4, 64-position blocks) have dropped the positions before the edit
    a = system + words(rng, 3) + image_tokens(image) + words(rng, 90)
    b = a[:last_image_end(a)] + [EOI, NL, NL] + words(rng, 90)      # the text after the image edited
    end = last_image_end(a)
    assert a[:end + 3] == b[:end + 3] and a[end + 3] != b[end + 3]
    edit_after_the_image(engine(model), engine(model, cache=False), image, system, a, b,
                         lambda ids: hf_logits(hf, ids, [image]))


def test_different_image_reuses_up_to_that_image(tiny):
    model, _ = tiny
    x, y = model.prepare_image(picture(6)), model.prepare_image(picture(7))
    rng = random.Random(8)
    head, tail = [BOS] + words(rng, 10), words(rng, 6)
    warm = engine(model)
    warm.generate(req(head + image_tokens(x) + tail, [x], boundaries=[len(head)]))
    ids = head + image_tokens(y) + tail
    res = warm.generate(req(ids, [y], boundaries=[len(head)]))
    first_key = next(i for i, t in enumerate(ids) if is_key(t))
    assert res.usage.cached_tokens == first_key == len(head) + 3      # exactly up to the new image
    cold = engine(model, cache=False).generate(req(ids, [y]))
    assert res.token_ids == cold.token_ids
    torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)


def test_second_image_in_turn_three_and_the_same_image_in_a_new_conversation(tiny):
    model, hf = tiny
    x, y = model.prepare_image(picture(11)), model.prepare_image(picture(12))
    rng = random.Random(13)
    first = [BOS] + words(rng, 6) + image_tokens(x) + words(rng, 5)
    users = [words(rng, 6), words(rng, 2) + image_tokens(y) + words(rng, 5)]      # turn 3 brings a second picture
    warm, cold = engine(model), engine(model, cache=False)
    prompts, res = warm_and_cold(warm, cold, [x, y], first, users)
    assert res[2].usage.cached_tokens >= len(prompts[1])       # the first picture restored, not encoded again
    assert res[2].stats.checkpoints >= 2                       # after the new picture, and the prompt end
    assert warm.encoder_cache.stats()["encoded"] == 2
    torch.testing.assert_close(res[2].first_logits, hf_logits(hf, prompts[2], [x, y])[-1], atol=1e-4, rtol=0)
    # the same picture in a new conversation: a prefix miss, an encoder-cache hit
    other = [BOS] + words(rng, 9) + image_tokens(x) + words(rng, 4)
    hits = warm.encoder_cache.stats()["hits"]
    again = warm.generate(req(other, [x]))
    assert again.usage.cached_tokens == 1 and warm.encoder_cache.stats()["hits"] == hits + 1      # only <bos>
    assert warm.encoder_cache.stats()["encoded"] == 2
    alone = engine(model, cache=False).generate(req(other, [x]))
    assert again.token_ids == alone.token_ids
    torch.testing.assert_close(again.first_logits, alone.first_logits, atol=1e-4, rtol=0)


def test_image_request_batched_with_text_requests(tiny):
    model, _ = tiny
    x = model.prepare_image(picture(14))
    rng = random.Random(15)
    reqs = [req([BOS] + words(rng, 20), [], 6), req([BOS] + words(rng, 3) + image_tokens(x) + words(rng, 7), [x], 6),
            req([BOS] + words(rng, 9) + image_tokens(x) + words(rng, 2), [x], 6), req([BOS] + words(rng, 33), [], 6)]
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


# --- the chat path: message boundaries and the media checkpoint from a rendered chat ------------

WORDS = ["user", "model", "you", "are", "helpful", "what", "is", "in", "this", "picture", "describe", "the",
         "colors", "tell", "me", "more", "a", "cat", "dog"]


def gemma_tokenizer():
    import tokenizers

    from turnkv.loading.tokenizer import Tokenizer, shipped_template

    vocab = {"[UNK]": 0, "<bos>": BOS, "\n": NL, "<image_soft_token>": IMAGE, "<start_of_image>": BOI,
             "<end_of_image>": EOI, "<start_of_turn>": SOT, "<end_of_turn>": EOT, "<eos>": 1}
    vocab.update({w: 20 + i for i, w in enumerate(WORDS)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[^\S\n]+"), "removed"),
        tokenizers.pre_tokenizers.Split("\n", "isolated")])
    backend.add_special_tokens([t for t in vocab if t.startswith("<")])
    return Tokenizer(backend, special_tokens={"eos_token": "<eos>", "bos_token": "<bos>"},
                     chat_template=shipped_template("gemma3"))


def test_vision_chat_has_boundaries_and_an_edit_after_the_image_restores_it(tiny):
    import base64
    import io

    model, _ = tiny
    buf = io.BytesIO()
    picture(9).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def chat(text):
        return [{"role": "system", "content": "you are helpful"},
                {"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": text}]}]
    eng = Engine(model, gemma_tokenizer(), fingerprint="tiny-gemma3v", prompt_cache=PromptCache(1 << 30),
                 prefill_chunk=8, max_context=4096, slack=SLACK)
    one = eng.chat_request(chat("describe the colors " * 30))     # long: see the test above
    end = last_image_end(one.prompt_ids)
    assert sum(map(is_key, one.prompt_ids)) == N_IMAGE and one.boundaries      # the message ends are found
    assert one.boundaries[-1] == len(one.prompt_ids) - 3     # the user turn ends before "<start_of_turn>model\n"
    one.params = greedy(4)
    r1 = eng.generate(one)
    assert r1.stats.checkpoints >= 2
    two = eng.chat_request(chat("tell me more a cat " * 20))      # the text after the image edited
    two.params = greedy(4)
    r2 = eng.generate(two)
    assert (r2.stats.restored_origin, r2.stats.restored_entry_length) == ("checkpoint", end)
    assert r2.usage.cached_tokens == end
    cold = Engine(model, gemma_tokenizer(), prompt_cache=PromptCache(0), max_context=4096).generate(
        GenerationRequest(two.prompt_ids, greedy(4), images=two.images))
    assert r2.token_ids == cold.token_ids
    torch.testing.assert_close(r2.first_logits, cold.first_logits, atol=1e-4, rtol=0)


def test_engine_load_takes_the_folder_and_its_preprocessing(tiny_folder, tiny):
    folder, _ = tiny_folder
    eng = Engine.load(str(folder), progress=False, prompt_cache=PromptCache(1 << 30), prefill_chunk=8, slack=SLACK)
    assert eng.family == "gemma3_vision" and eng.encoder_cache is not None and eng.scheduler.whole_images
    assert list(eng.model.processor.image_mean) == [0.5, 0.4, 0.3]      # the folder's, not the defaults
    image = eng.model.prepare_image(picture(10, (20, 70)))
    torch.testing.assert_close(image.pixel_values, tiny[0].prepare_image(picture(10, (20, 70))).pixel_values)
    ids = [BOS, 30, 31] + image_tokens(image) + [32, 33]
    res = eng.generate(req(ids, [image]))
    assert res.token_ids == engine(tiny[0], cache=False).generate(req(ids, [image])).token_ids
