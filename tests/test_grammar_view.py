"""The grammar engine's view of the vocabulary built from its on-disk cache
(turnkv/engine/grammar_view.py) is the view llguidance builds from the tokenizer.json: the same
bytes and special marks for every token, the same EOS ids, the same masks along a tool call and a
JSON document, the same tokenize; a damaged or unwritable cache costs a full build, never a wrong
view; a build that fails publishes nothing and the next grammar builds again."""

from __future__ import annotations

import hashlib
import json
import threading
from types import SimpleNamespace

import llguidance as llg
import pytest
import tokenizers

from turnkv.engine import grammar_view
from turnkv.engine.grammar import JSON_SEPARATORS, ll_tokenizer
from turnkv.loading import load_tokenizer, shipped_template
from turnkv.loading.bundled import find_bundled
from turnkv.loading.tokenizer import Tokenizer
from turnkv.server import tools as T

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok():
    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("bundled model smollm2-135m is not installed")
    return load_tokenizer("smollm2-135m").with_template(shipped_template("chatml-tools"))


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path))
    return tmp_path / "grammar-views"


def reference(tok):
    """The view as llguidance builds it from the tokenizer's JSON, no cache involved."""
    return llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))


def masks_along(view, grammar: str, tokens: list[int]) -> list[bytes]:
    m = llg.LLMatcher(view, grammar, log_level=0)
    out = []
    for t in tokens:
        out.append(bytes(m.compute_bitmask()))
        assert m.consume_token(t), m.get_error()
    out.append(bytes(m.compute_bitmask()))
    return out


def assert_same_view(view, ref, tok):
    n = ref.vocab_size
    assert view.vocab_size == n and view.eos_tokens == ref.eos_tokens
    assert [view.decode_bytes([i]) for i in range(n)] == [ref.decode_bytes([i]) for i in range(n)]
    assert [i for i in range(n) if view.is_special_token(i)] == [i for i in range(n) if ref.is_special_token(i)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \u00e9t\u00e9 \u65e5"}}\n</tool_call>'
    lark = T.call_grammar(T.HERMES, TOOLS, ["get_weather"])
    doc = json.dumps({"ok": True, "n": 7, "s": "caf\u00e9 \u65e5\u672c"}, ensure_ascii=False)
    schema = llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), overrides=JSON_SEPARATORS)
    for grammar, text in ((lark, call), (schema, doc)):
        ids = tok.encode(text, add_special_tokens=False)
        assert masks_along(view, grammar, ids) == masks_along(ref, grammar, ids)
    for text in ("hello world", ' {"a": 1}', "<|im_start|>user\nhi", "h\u00e9llo \u65e5\u672c"):
        assert view.tokenize_str(text) == ref.tokenize_str(text)
        assert view.tokenize_str(text, parse_special=True) == ref.tokenize_str(text, parse_special=True)


def test_the_cached_view_is_the_view_llguidance_builds_from_the_file(tok, cache_dir):
    ref = reference(tok)
    first, origin = grammar_view.build_with_origin(llg, tok)
    assert origin == "file" and len(list(cache_dir.iterdir())) == 1
    # keyed as before the tokenizer kept its file's hash: views earlier versions stored stay in use
    salt = json.dumps([grammar_view.FORMAT, tok.vocab_size, sorted(tok.eos_token_ids), llg.__version__]).encode()
    assert next(cache_dir.iterdir()).stem == hashlib.sha256(tok.backend_file.read_bytes() + salt).hexdigest()
    assert_same_view(first, ref, tok)
    cached, origin = grammar_view.build_with_origin(llg, tok)
    assert origin == "cache"
    assert_same_view(cached, ref, tok)


@pytest.mark.slow
def test_gemma3s_cached_view_is_the_view_llguidance_builds_from_the_file(cache_dir):
    """Gemma 3's 262k vocabulary: byte-fallback tokens, 6k special tokens, spaces as U+2581."""
    if not find_bundled("gemma3-270m")[0]:
        pytest.skip("bundled model gemma3-270m is not installed")
    gemma = load_tokenizer("gemma3-270m").with_template(shipped_template("chatml-tools"))
    assert grammar_view.build_with_origin(llg, gemma)[1] == "file"
    view, origin = grammar_view.build_with_origin(llg, gemma)
    assert origin == "cache"
    assert_same_view(view, reference(gemma), gemma)


def test_another_eos_set_is_another_cache_entry(tok, cache_dir):
    grammar_view.build_with_origin(llg, tok)
    other = Tokenizer(tok.backend, special_tokens=tok.special_tokens, chat_template=tok.chat_template,
                      extra_eos_ids=[0])
    other.backend_file, other.backend_hash = tok.backend_file, tok.backend_hash
    assert other.eos_token_ids != tok.eos_token_ids
    view, origin = grammar_view.build_with_origin(llg, other)
    assert origin == "file" and len(list(cache_dir.iterdir())) == 2
    assert view.eos_tokens == reference(other).eos_tokens


@pytest.mark.parametrize("damage", ["cut", "flip", "garbage", "empty"])
def test_a_damaged_cache_file_is_rebuilt_from_the_tokenizer_json(tok, cache_dir, damage):
    grammar_view.build_with_origin(llg, tok)
    (path,) = cache_dir.iterdir()
    blob = path.read_bytes()
    broken = {"cut": blob[:len(blob) // 2], "flip": blob[:-7] + bytes([blob[-7] ^ 1]) + blob[-6:],
              "garbage": b"\x00" * 64, "empty": b""}[damage]
    path.write_bytes(broken)
    view, origin = grammar_view.build_with_origin(llg, tok)
    assert origin == "file" and path.read_bytes() == blob      # the same bytes as the first build's
    assert view.vocab_size == tok.vocab_size
    assert grammar_view.build_with_origin(llg, tok)[1] == "cache"


def test_an_unwritable_cache_dir_costs_only_the_full_build(tok, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(blocker))
    for _ in range(2):
        view, origin = grammar_view.build_with_origin(llg, tok)
        assert origin == "file"
    assert view.eos_tokens == reference(tok).eos_tokens


def test_a_tokenizer_json_gone_or_changed_after_the_load(tok, cache_dir, tmp_path):
    """The view is keyed by the bytes the tokenizer was built from (hashed at its load): after the
    file changes or goes, the stored view of the loaded vocabulary still serves it; without one,
    the view is built from the backend in memory and nothing is stored."""
    import shutil

    copy = tmp_path / "tok" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(tok.backend_file, copy)
    loaded = Tokenizer.from_folder(copy.parent, chat_template=tok.chat_template)
    assert grammar_view.build_with_origin(llg, loaded)[1] == "file"
    copy.write_text(copy.read_text().replace('"<|im_end|>"', '"<|im_ended|>"'))   # another vocabulary now
    view, origin = grammar_view.build_with_origin(llg, loaded)
    assert origin == "cache"
    assert_same_view(view, reference(loaded), loaded)
    for stored in cache_dir.iterdir():
        stored.unlink()
    view, origin = grammar_view.build_with_origin(llg, loaded)
    assert origin == "backend" and view.vocab_size == tok.vocab_size and list(cache_dir.iterdir()) == []
    assert_same_view(view, reference(loaded), loaded)
    copy.unlink()
    assert grammar_view.build_with_origin(llg, loaded)[1] == "backend"


def test_a_failed_build_publishes_nothing_and_the_next_grammar_builds_again(cache_dir):
    """llguidance cannot take a WordPiece vocabulary (no byte-level or byte-fallback decoder): the
    warm-up thread logs it, the tokenizer keeps no view, and each grammar request tries again and
    gets llguidance's reason."""
    from turnkv.server.requests import grammar_warm_up_thread

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    backend.decoder = tokenizers.decoders.WordPiece()
    bad = Tokenizer(backend, special_tokens={"eos_token": "[UNK]"}, chat_template=shipped_template("chatml-tools"))
    thread = grammar_warm_up_thread(SimpleNamespace(tokenizer=bad), lambda: True, threading.Event())
    thread.join(30)
    assert not thread.is_alive() and getattr(bad, "_llguidance", None) is None
    for _ in range(2):
        with pytest.raises(ValueError, match="decoder"):
            ll_tokenizer(bad)
        assert getattr(bad, "_llguidance", None) is None
