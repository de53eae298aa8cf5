"""Tokenizer against transformers: ids, text, chat rendering, boundaries, streaming."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil

import pytest

from turnkv.loading import ModelLoadError, load_checkpoint, load_tokenizer
from turnkv.loading.bundled import find_bundled, locate_bundled
from turnkv.loading.gguf import fingerprint
from turnkv.loading.tokenizer import END_OF_TURN_TOKENS, cache_root, shipped_template
from turnkv.registry import BUNDLED

BUNDLED_NAMES = ["smollm2-135m", "gemma3-270m"]
END_OF_TURN = {"smollm2-135m": "<|im_end|>", "gemma3-270m": "<end_of_turn>"}

TEXTS = [
    "Hello world!",
    "  two leading spaces, and a trailing one ",
    "line one\nline two\n\n\ttabbed  and   spaced",
    "Émile a mangé des crêpes à Noël — naïve façade, Øresund, İstanbul.",
    "你好，世界！日本語のテキスト。한국어 텍스트.",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 🦩🪿🫎 and script 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫≠",
    "special tokens inline: <|im_end|> <end_of_turn> <bos> <|im_start|>",
    "",
]

SYSTEM = "You are a terse assistant. Answer in one line."
CHATS = {
    "system_user_assistant_user": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France? 🇫🇷"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan — 日本?"},
    ],
    "user_only": [{"role": "user", "content": "  Hi there  "}],
    "user_assistant": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3"},
    ],
}


def _require(name: str):
    installed, _ = find_bundled(name)
    if not installed:
        pytest.skip(f"{BUNDLED[name].package} not installed ({BUNDLED[name].install})")
    return locate_bundled(name)


def _oracle(request, name: str) -> dict:
    """transformers' answers (tokenizer converted straight from the GGUF) for TEXTS and
    CHATS, cached in pytest's cache by file, library versions and inputs: the Gemma
    conversion alone takes ~18 s."""
    import tokenizers
    import transformers

    path = _require(name)
    template = shipped_template("gemma3") if name == "gemma3-270m" else None
    inputs = hashlib.sha256(json.dumps([TEXTS, CHATS, template], sort_keys=True).encode()).hexdigest()[:16]
    key = (
        f"turnkv/tokenizer-oracle/{name}/{fingerprint(path)[:16]}/{inputs}/"
        f"transformers-{transformers.__version__}/tokenizers-{tokenizers.__version__}"
    )
    cache = getattr(request.config, "cache", None)
    if cache is not None and (hit := cache.get(key, None)):
        return hit
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ref: dict = {"texts": [], "chats": {}}
    for text in TEXTS:
        ids = tok(text).input_ids
        ref["texts"].append({
            "ids": ids,
            "plain_ids": tok(text, add_special_tokens=False).input_ids,
            "decode": tok.decode(ids),
            "decode_skip": tok.decode(ids, skip_special_tokens=True),
        })
    for chat_name, messages in CHATS.items():
        for gen in (True, False):
            kw = {"add_generation_prompt": gen, "chat_template": template}
            ref["chats"][f"{chat_name}/{gen}"] = {
                "text": tok.apply_chat_template(messages, tokenize=False, **kw),
                "ids": list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)),
            }
    ref["eos_token_id"] = tok.eos_token_id
    ref["bos_token_id"] = tok.bos_token_id
    if cache is not None:
        cache.set(key, ref)
    return ref


@functools.lru_cache(maxsize=None)
def _tokenizer(name: str):
    """One load per model for the whole module (Gemma's 33 MB tokenizer.json takes ~1.5 s)."""
    _require(name)
    return load_tokenizer(name)


@pytest.fixture(scope="module", params=BUNDLED_NAMES)
def pair(request):
    return request.param, _tokenizer(request.param), _oracle(request, request.param)


# ------------------------------------------------------------ vs transformers


def test_encode_equals_transformers(pair):
    name, tok, ref = pair
    for text, expected in zip(TEXTS, ref["texts"]):
        assert tok.encode(text) == expected["ids"], text
        assert tok.encode(text, add_special_tokens=False) == expected["plain_ids"], text
    first = tok.encode("Hello")[0]
    if name == "gemma3-270m":
        assert first == tok.bos_token_id == 2  # Gemma adds <bos>
    else:
        assert first != tok.bos_token_id  # SmolLM2 does not


def test_decode_equals_transformers(pair):
    _, tok, ref = pair
    for text, expected in zip(TEXTS, ref["texts"]):
        assert tok.decode(expected["ids"]) == expected["decode"], text
        assert tok.decode(expected["ids"], skip_special_tokens=True) == expected["decode_skip"], text


def test_chat_rendering_equals_transformers(pair):
    _, tok, ref = pair
    assert tok.has_chat_template
    for chat_name, messages in CHATS.items():
        for gen in (True, False):
            expected = ref["chats"][f"{chat_name}/{gen}"]
            rendered = tok.render_chat(messages, add_generation_prompt=gen)
            assert rendered.text == expected["text"], chat_name
            assert rendered.ids == expected["ids"], chat_name


def test_special_ids(pair):
    name, tok, ref = pair
    assert tok.bos_token_id == ref["bos_token_id"]
    assert ref["eos_token_id"] in tok.eos_token_ids
    end_of_turn = tok.token_to_id(END_OF_TURN[name])
    assert end_of_turn is not None and end_of_turn in tok.eos_token_ids
    if name == "gemma3-270m":
        assert tok.eos_token_ids == {1, 106}  # <eos> from the GGUF, <end_of_turn> from the template
    else:
        assert tok.eos_token_ids == {2}  # the GGUF eos is <|im_end|> itself
    assert tok.vocab_size == {"smollm2-135m": 49152, "gemma3-270m": 262144}[name]


# -------------------------------------------------------------- boundaries


def test_boundaries_end_each_message(pair):
    name, tok, _ = pair
    messages = CHATS["system_user_assistant_user"]
    rendered = tok.render_chat(messages, add_generation_prompt=True)
    b = rendered.boundaries
    assert b == sorted(set(b)) and all(0 < x < len(rendered.ids) for x in b)
    # Gemma folds the system prompt into the first user turn: no boundary of its own
    assert len(b) == (3 if name == "gemma3-270m" else 4)
    eot = END_OF_TURN[name] + "\n"
    first = 1 if name == "gemma3-270m" else 0
    for count, boundary in zip(range(first + 1, len(messages) + 1), b):
        assert tok.decode(rendered.ids[:boundary]).endswith(eot)
        prefix = tok.render_chat(messages[:count], add_generation_prompt=False)
        assert rendered.ids[:boundary] == prefix.ids, f"boundary after message {count}"
        assert messages[count - 1]["content"].strip() in tok.decode(rendered.ids[:boundary])
    # without a generation prompt the last boundary is the very end
    closed = tok.render_chat(messages, add_generation_prompt=False)
    assert closed.boundaries[-1] == len(closed.ids)


def test_bounded_boundaries_are_the_first_and_last_messages(pair):
    """``boundary_messages=N`` renders N + 1 prefixes instead of one per message (linear, not
    quadratic, in the number of messages) and finds the same boundaries for the messages it looks at."""
    name, tok, _ = pair
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        messages += [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    messages.append({"role": "user", "content": "last question?"})
    full = tok.render_chat(messages).boundaries
    assert len(full) >= len(messages) - 1
    two = tok.render_chat(messages, boundary_messages=2)
    assert two.ids == tok.render_chat(messages).ids
    assert set(two.boundaries) <= set(full) and full[-2:] == two.boundaries[-2:]
    assert len(two.boundaries) <= 3
    if name != "gemma3-270m":      # Gemma folds the system prompt into the first user turn
        assert two.boundaries[0] == full[0]
    assert tok.render_chat(messages, boundary_messages=0).boundaries == []


def test_content_parts_join_like_strings(pair):
    _, tok, _ = pair
    plain = [{"role": "user", "content": "first part\nsecond part"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}]
    assert tok.render_chat(parts).ids == tok.render_chat(plain).ids


# ------------------------------------------------------------------ streaming


STREAM_TEXT = " ".join(TEXTS[:-1]) + " 🦩🪿🫎 𝔘𝔫𝔦 end."


def _stream(tok, ids, skip):
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def test_stream_decoder_equals_decode(pair):
    name, tok, _ = pair
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False)
    # the text really has characters split over several tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for skip in (True, False):
        pieces = _stream(tok, ids, skip)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    chat = tok.render_chat(CHATS["system_user_assistant_user"]).ids
    for skip in (True, False):
        assert "".join(_stream(tok, chat, skip)) == tok.decode(chat, skip_special_tokens=skip)


def test_stream_decoder_spaces(pair):
    _, tok, _ = pair
    for text in (" leading space", "word  double  spaces ", "\n\nnewlines first", "a b c d e f"):
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(_stream(tok, ids, True)) == tok.decode(ids, skip_special_tokens=True) == text


def test_stream_decoder_holds_incomplete_character(pair):
    _, tok, _ = pair
    ids = tok.encode("🦩", add_special_tokens=False)
    decoder = tok.stream_decoder()
    out = [decoder.push(i) for i in ids]
    if len(ids) > 1:
        assert out[:-1] == [""] * (len(ids) - 1)
    assert "".join(out) + decoder.flush() == "🦩"
    # an unfinished character stays held back until flush
    decoder = tok.stream_decoder()
    if len(ids) > 1:
        assert decoder.push(ids[0]) == ""
        assert decoder.flush() == tok.decode(ids[:1], skip_special_tokens=True)


# --------------------------------------------------------------- bad input


BAD_MESSAGES = [
    [],
    "hello",
    [{"role": "robot", "content": "beep"}],
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 7}]}],
    ["not a dict"],
]


@pytest.mark.parametrize("messages", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_bad_messages_raise_value_error(pair, messages):
    _, tok, _ = pair
    with pytest.raises(ValueError):
        tok.render_chat(messages)


def test_template_refusal_is_value_error():
    tok = _tokenizer("gemma3-270m")
    with pytest.raises(ValueError, match="alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ------------------------------------------------------------------- caching


def test_converted_tokenizer_is_cached(tmp_path, monkeypatch):
    _require("smollm2-135m")
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    first = load_tokenizer("smollm2-135m")
    folder = tmp_path / "tokenizers" / fingerprint(locate_bundled("smollm2-135m"))
    assert first.source == folder and (folder / "tokenizer.json").is_file()
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    second = load_tokenizer("smollm2-135m")  # from the cache: nothing rewritten
    assert second.source == folder and (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    assert second.encode(TEXTS[5]) == first.encode(TEXTS[5])
    assert second.chat_template == first.chat_template and second.has_chat_template


def test_hf_folder_tokenizer(tmp_path):
    """An HF folder with tokenizer files gets its tokenizer (here: SmolLM2's, converted)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = _tokenizer("smollm2-135m")
    folder = tmp_path / "tiny-with-tokenizer"
    LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, eos_token_id=2, bos_token_id=1,
    )).save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source.source / file, folder / file)
    ckpt = load_checkpoint(folder, progress=False)
    tok = ckpt.tokenizer
    assert tok is not None and tok.source == folder
    assert tok.encode(TEXTS[3]) == source.encode(TEXTS[3])
    assert tok.render_chat(CHATS["user_only"]).ids == source.render_chat(CHATS["user_only"]).ids
    assert tok.eos_token_ids == {2}


def test_end_of_turn_tokens_are_known():
    assert "<|im_end|>" in END_OF_TURN_TOKENS and "<end_of_turn>" in END_OF_TURN_TOKENS


def test_shipped_gemma_template_shape():
    template = shipped_template("gemma3")
    assert template.startswith("{{ bos_token }}") and "<start_of_turn>model\\n" in template
    with pytest.raises(ModelLoadError):
        load_tokenizer("no-such-model")
