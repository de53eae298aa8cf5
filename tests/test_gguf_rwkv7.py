"""RWKV-7's GGUF (llama.cpp's ``rwkv7`` layout, tests/gguf_fixtures/rwkv7: the converter's own output
for the tiny rwkv7-hf folder beside it) is held to the folder by tests/test_gguf_families.py; here,
what is this layout's own: the world tokenizer a released RWKV-7 GGUF carries (tokenizer.ggml.model
"rwkv"), on tests/gguf_fixtures/rwkv7_world (a tiny random model converted with RWKV's real world
vocabulary), against BlinkDL's ``rwkv`` package (the reference tokenizer) and llama.cpp, and
structured output over that vocabulary (llguidance built from its tokens' bytes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnkv.loading import load_checkpoint

FIXTURE = Path(__file__).resolve().parent / "gguf_fixtures" / "rwkv7_world" / "rwkv7-world-f16.gguf"
LLAMA_TOKENIZE = (Path.home() / ".cache" / "turnkv-peers" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
                  / "build" / "bin" / "llama-tokenize")

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # tabs\tand spaces\n",
    "   leading, trailing and   runs\n\n\n\nof whitespace   \r\n \t ",
    "0 1 12 123 1234 12345 3.14159265358979 1e-10 0x7fff 2026-12-06 100,000,000",
    "中文分词测试：今天天气很好。日本語のテキストです。한국어 문장입니다.",
    "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم. שלום עולם. हिन्दी पाठ। ภาษาไทย",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 ✨ and symbols ≤ ≥ ∑ ∫ → € £ ¥ © ®",
    "JSON {\"key\": [1, 2, null], \"nested\": {\"a\": \"b\\\\n\"}} <html><body>&amp;</body></html>",
    "\\x00 \\n backslashes \\\\ and quotes ' \" ''' \"\"\" `code`",
    "User: hi\n\nAssistant: hello\n\n",
]


@pytest.fixture(scope="module")
def tok():
    return load_checkpoint(FIXTURE, progress=False).tokenizer


@pytest.fixture(scope="module")
def reference():
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    import rwkv

    return TRIE_TOKENIZER(str(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"))


def test_ids_equal_the_reference_tokenizer_and_round_trip(tok, reference):
    assert tok.vocab_size == 65536
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ids      # no BOS: llama.cpp adds none
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[6])) < len(CORPUS[6].encode("utf-8"))   # multi-byte tokens matched


@pytest.mark.skipif(not LLAMA_TOKENIZE.is_file(), reason="llama.cpp's llama-tokenize is not built here")
def test_ids_equal_llama_cpp(tok, tmp_path):
    text = "\n".join(CORPUS)     # --no-escape: the tool would turn the corpus's "\\n" into a newline
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    proc = subprocess.run([str(LLAMA_TOKENIZE), "-m", str(FIXTURE), "-f", str(tmp_path / "corpus.txt"), "--ids",
                           "--no-escape", "--log-disable"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = [int(x) for x in proc.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    assert tok.encode(text) == expected


def test_streamed_text_equals_decode_across_split_characters(tok):
    # the world vocabulary splits some characters across tokens (an emoji's 4 bytes as 2 + 1 + 1)
    ids = tok.encode(CORPUS[6] + CORPUS[4])
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    stream = tok.stream_decoder()
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    assert text == tok.decode(ids) == CORPUS[6] + CORPUS[4]


def test_chat_template_specials_and_message_boundaries(tok):
    # the converter's template; "<s>" (id 0) starts it and "\n\n" (id 261) ends a turn, as in llama.cpp
    assert tok.bos_token_id == 0 and tok.eos_token_ids == {0, 261}
    msgs = [{"role": "user", "content": "Bonjour 😀"}, {"role": "assistant", "content": "Salut !"},
            {"role": "user", "content": "中文？"}]
    chat = tok.render_chat(msgs)
    assert chat.text == "<s>User: Bonjour 😀\n\nAssistant: Salut !\n\nUser: 中文？\n\nAssistant:"
    assert chat.ids[0] == 0 and chat.ids[1:] == tok.encode(chat.text[3:])
    assert len(chat.boundaries) == 3
    for n, msg in zip(chat.boundaries, msgs):
        assert tok.decode(chat.ids[:n]).endswith(msg["content"] + "\n\n")
    assert tok.decode(chat.ids, skip_special_tokens=True) == chat.text[3:]


def test_generate_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "turnkv.cli", "generate", "-m", str(FIXTURE), "-p", "Hello 世界",
                           "--max-tokens", "6", "--temperature", "0"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "TTFT" in proc.stderr
    assert proc.stdout.strip()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "city": {"enum": ["Paris", "東京", "Zürich"]}},
          "required": ["ok", "n", "city"], "additionalProperties": False}


def test_the_grammar_mask_over_the_world_vocabulary(tok):
    # llguidance has no tokenizer.json here: it gets the tokens' bytes and the trie's tokenize
    pytest.importorskip("llguidance")
    import torch

    from turnkv.engine.grammar import Grammar

    m = Grammar.json_schema(tok, SCHEMA).matcher()

    def allowed() -> set[int]:
        return set(torch.nonzero(torch.isfinite(m.mask(torch.zeros(tok.vocab_size)))).flatten().tolist())
    first = allowed()     # the object's forced start, as the trie spells it
    assert first and all(tok.decode([t]).startswith("{") for t in first) and not first & tok.eos_token_ids
    for t in tok.encode('{"ok": true, "n": 7, "city": "東京"}'):
        assert t in allowed(), tok.decode([t])
        m.advance(t)
    assert allowed() == tok.eos_token_ids       # complete: only the end of turn ("<s>" or "\n\n")


def test_json_schema_reply_through_the_server_follows_the_schema():
    """A random model's reply constrained by response_format json_schema, over HTTP: it parses and
    validates against the schema, and it ends because the document is complete."""
    pytest.importorskip("llguidance")
    import httpx
    import json

    import jsonschema

    from live_server import serving
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache
    from turnkv.server.app import create_app

    eng = Engine.load(str(FIXTURE), progress=False, prompt_cache=PromptCache(1 << 26))
    body = {"messages": [{"role": "user", "content": "Réponds en JSON 🙂"}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    with serving(create_app(eng)) as url:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_chat_turns_reuse_the_earlier_turns_through_the_world_tokenizer():
    # a recurrent state restores only at a message boundary the tokenizer found: turns 2 and 3 reuse
    # what the earlier turns computed and generate what a cold engine generates
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache
    from turnkv.engine.sampling import SamplingParams

    on = Engine.load(str(FIXTURE), progress=False, prompt_cache=PromptCache(1 << 28))
    off = Engine(on.model, on.tokenizer, fingerprint=on.fingerprint, prompt_cache=PromptCache(0),
                 max_context=on.max_context)
    history = [{"role": "system", "content": "Réponds en une phrase 🙂"}]
    for turn, text in enumerate(["Bonjour 😀", "中文？", "1 + 1 =\tdeux"]):
        history.append({"role": "user", "content": text})
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        a, b = on.generate(on.chat_request(history, params)), off.generate(off.chat_request(history, params))
        assert a.token_ids == b.token_ids and b.usage.cached_tokens == 0
        if turn:   # all the previous turn computed: its prompt and its reply but the last sampled token
            assert a.usage.cached_tokens == last.usage.prompt_tokens + last.usage.completion_tokens - 1, a.usage
        history.append({"role": "assistant", "content": a.text})
        last = a
