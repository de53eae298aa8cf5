"""Images over HTTP (docs/images.md): OpenAI image_url content parts on /v1/chat/completions,
through a real uvicorn server in-process on a tiny random SmolVLM with a word-level tokenizer and
SmolVLM's chat template. The second turn reuses the image's tokens and equals a cold run; bad
images get a 400 with an OpenAI error body."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from live_server import serving
from test_family_smolvlm import FAKE, GLOBAL, IMAGE, picture, tiny, tiny_folder  # noqa: F401  (fixtures)
from turnkv.engine.engine import Engine
from turnkv.prompt_cache.store import PromptCache
from turnkv.server.app import create_app

WORDS = ["User", "Assistant", "System", ":", "what", "is", "in", "this", "picture", "and", "now", "tell", "me",
         "more", "a", "cat", "dog", "you", "are", "helpful"]


def tiny_tokenizer():
    import tokenizers
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from turnkv.loading.tokenizer import Tokenizer

    vocab = {"[UNK]": 0, "\n": 10}
    vocab.update({w: 20 + i for i, w in enumerate(WORDS)})
    vocab.update({f"<row_{r}_col_{c}>": 100 + (r - 1) * 8 + (c - 1) for r in range(1, 5) for c in range(1, 5)})
    specials = {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL,
                "<end_of_utterance>": 253, "<|im_start|>": 254}
    vocab.update(specials)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([t for t in vocab if t.startswith("<")])
    return Tokenizer(backend, special_tokens={"eos_token": "<end_of_utterance>", "bos_token": "<|im_start|>"},
                     chat_template=DEFAULT_CHAT_TEMPLATE)


def data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def vision_engine(model, cache=True) -> Engine:
    return Engine(model, tiny_tokenizer(), fingerprint="tiny-smolvlm",
                  prompt_cache=PromptCache(1 << 30 if cache else 0), prefill_chunk=32, max_context=4096, max_image_pixels=80 * 80)


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    model = tiny[0]
    eng = vision_engine(model)
    with serving(create_app(eng)) as url:
        yield url, model


def post(url, messages, max_tokens=6):
    return httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=120)


def test_image_chat_over_http_reuses_the_image_and_equals_cold(server):
    url, model = server
    img = picture(21)
    turn1 = [{"role": "system", "content": "you are helpful"},
             {"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                          {"type": "image_url", "image_url": {"url": data_url(img)}}]}]
    r1 = post(url, turn1)
    assert r1.status_code == 200, r1.text
    reply = r1.json()["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "tell me more"}]
    r2 = post(url, turn2)
    assert r2.status_code == 200, r2.text
    cold = vision_engine(model, cache=False)
    gen = cold.chat_request(turn2)
    image_end = max(i for i, t in enumerate(gen.prompt_ids) if t >= 1 << 62) + 1
    usage = r2.json()["usage"]
    assert usage["prompt_tokens"] == len(gen.prompt_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= image_end     # the image's tokens were reused
    gen.params.max_tokens, gen.params.temperature = 6, 0.0
    assert r2.json()["choices"][0]["message"]["content"] == cold.generate(gen).text
    stats = httpx.get(url + "/v1/cache/stats", timeout=10).json()
    assert stats["images"]["encoded"] == 1 and stats["images"]["entries"] == 1


@pytest.mark.parametrize("url_of, needle", [
    (lambda: "https://example.com/cat.png", "not fetched"),
    (lambda: "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "could not be decoded"),
    (lambda: data_url(picture(22, (90, 90))), "max-image-pixels"),
    (lambda: data_url(picture(23).convert("RGB"), "BMP"), "could not be decoded"),
])
def test_bad_images_get_400(server, url_of, needle):
    url, _ = server
    r = post(url, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_of()}}]}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_jpeg_and_webp_decode_and_text_only_models_refuse(server):
    url, _ = server
    for fmt in ("JPEG", "WEBP"):
        image = {"type": "image_url", "image_url": {"url": data_url(picture(24), fmt)}}
        r = post(url, [{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}], max_tokens=2)
        assert r.status_code == 200, r.text
    # text may not smuggle in the image marker: it would take an image's place
    r = post(url, [{"role": "user", "content": [{"type": "text", "text": "what is <image> this"},
                                                {"type": "image_url", "image_url": {"url": data_url(picture(24))}}]}])
    assert r.status_code == 400 and "must not contain" in r.json()["error"]["message"]
    from tiny import tiny_llama
    text_only = Engine(tiny_llama()[0], tiny_tokenizer(), max_context=4096)
    with pytest.raises(ValueError, match="does not take images"):
        text_only.chat_request([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(picture(25))}}]}])


def test_anthropic_image_blocks_are_the_same_prompt_as_image_url_parts(server):
    """/v1/messages: a base64 image block renders as the chat path's image_url part (same prompt,
    same greedy reply), the repeat restores the image from the cache, and a url source that is not
    a data URL is refused in Anthropic's error shape."""
    url, _ = server
    png = data_url(picture(26))
    chat = post(url, [{"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                                   {"type": "image_url", "image_url": {"url": png}}]}]).json()
    source = {"type": "base64", "media_type": "image/png", "data": png.split(",", 1)[1]}
    body = {"model": "m", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"}, {"type": "image", "source": source}]}]}
    r = httpx.post(url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    u = msg["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"] - 1     # all but the last token
    bad = {**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]}
    r = httpx.post(url + "/v1/messages", json=bad, timeout=120)
    assert r.status_code == 400 and r.json()["type"] == "error" and "not fetched" in r.json()["error"]["message"]
