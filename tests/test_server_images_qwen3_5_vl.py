"""Images over HTTP on a hybrid vision family (docs/images.md): a real uvicorn server in-process on a
tiny random Qwen3.5-VL (gated delta-net hybrid under M-RoPE) with a word-level tokenizer and a
ChatML template that renders images as Qwen's does. Turn 2 restores the state past the image (the
delta-net state and its rope delta), reports the image's tokens as cached, and equals a cold server."""

from __future__ import annotations


import httpx
import pytest

from live_server import serving
from test_family_qwen3_5_vl import END, IMAGE, START, tiny, tiny_folder  # noqa: F401  (fixtures)
from test_server_images import data_url, post
from turnkv.engine.engine import Engine
from turnkv.prompt_cache.store import PromptCache
from turnkv.server.app import create_app
from vision_chat import picture

WORDS = ["user", "assistant", "system", "what", "is", "in", "this", "picture", "tell", "me", "more", "you", "are",
         "helpful"]
# the image part of Qwen's chat templates: <|vision_start|><|image_pad|><|vision_end|>
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_tokenizer():
    import tokenizers

    from turnkv.loading.tokenizer import Tokenizer

    vocab = {"[UNK]": 0, "\n": 10}
    vocab.update({w: 20 + i for i, w in enumerate(WORDS)})
    vocab.update({f"w{i}": i for i in range(1, IMAGE) if i not in vocab.values()})   # every id decodes to a word
    vocab.update({"<|image_pad|>": IMAGE, "<|vision_start|>": START, "<|vision_end|>": END,
                  "<|im_end|>": 253, "<|im_start|>": 254})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    pre = tokenizers.pre_tokenizers   # "\n" is a token (as in Qwen's BPE): messages end on token boundaries
    backend.pre_tokenizer = pre.Sequence([pre.Split(tokenizers.Regex("\n"), "isolated"), pre.Split(" ", "removed")])
    backend.add_special_tokens([t for t in vocab if t.startswith("<")])
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=TEMPLATE)


def vision_engine(model, cache=True) -> Engine:
    return Engine(model, tiny_tokenizer(), fingerprint="tiny-qwen3_5vl",
                  prompt_cache=PromptCache(1 << 30 if cache else 0), prefill_chunk=16, max_context=4096)


@pytest.fixture(scope="module")
def servers(tiny):  # noqa: F811
    """A warm server (prompt cache on) and a cold one (off), both real uvicorn servers."""
    model = tiny[0]
    with serving(create_app(vision_engine(model, True))) as warm, \
            serving(create_app(vision_engine(model, False))) as cold:
        yield warm, cold, model


def test_turn_two_reuses_the_image_on_the_hybrid_and_equals_a_cold_server(servers):
    warm, cold, model = servers
    img = picture(31, (40, 56))
    turn1 = [{"role": "system", "content": "you are helpful"},
             {"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                          {"type": "image_url", "image_url": {"url": data_url(img)}}]}]
    r1 = post(warm, turn1)
    assert r1.status_code == 200, r1.text
    assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = r1.json()["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "tell me more"}]
    r2, ref = post(warm, turn2), post(cold, turn2)
    assert r2.status_code == 200 and ref.status_code == 200, (r2.text, ref.text)
    prompt = vision_engine(model, cache=False).chat_request(turn2).prompt_ids
    keys = [i for i, t in enumerate(prompt) if t >= 1 << 62]
    image = model.prepare_image(img)
    assert len(keys) == image.n_rows                       # the image's rows are in the prompt
    usage = r2.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt) == ref.json()["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > keys[-1]      # every image token reused
    # in fact all of turn 1: its prompt and the reply's tokens that were fed back (all but the last)
    first = vision_engine(model, cache=False).chat_request(turn1).prompt_ids
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(first) + r1.json()["usage"]["completion_tokens"] - 1
    assert ref.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = r2.json()["choices"][0]["message"]["content"]
    assert text and text == ref.json()["choices"][0]["message"]["content"]
    stats = httpx.get(warm + "/v1/cache/stats", timeout=10).json()
    assert stats["images"]["encoded"] == 1                 # turn 2 did not encode the image again
