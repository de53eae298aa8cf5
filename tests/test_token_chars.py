"""The longest vocabulary entry (the server's prompt-size bound, loading/token_chars.py) read from
its on-disk cache equals the scan of the tokenizer in memory: a miss scans and stores, a hit reads
the stored count, a changed tokenizer.json is another key (never the old count), a damaged or
unwritable cache costs a scan, never a wrong count, and a tokenizer whose file changed since the
load is scanned and nothing stored. A real tokenizer throughout (SmolLM2's)."""

from __future__ import annotations

import hashlib
import json
import shutil
from types import SimpleNamespace

import pytest

from turnkv.loading import load_tokenizer
from turnkv.loading import token_chars as TC
from turnkv.loading.bundled import find_bundled
from turnkv.loading.tokenizer import Tokenizer
from turnkv.server.requests import max_token_chars


@pytest.fixture(scope="module")
def source():
    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("bundled model smollm2-135m is not installed")
    return load_tokenizer("smollm2-135m").backend_file.parent


@pytest.fixture()
def folder(source, tmp_path, monkeypatch):
    """A copy of the tokenizer's folder, and an empty cache dir."""
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "tok"
    shutil.copytree(source, copy)
    return copy


def scanned(tok) -> int:
    return max(len(t) for t in tok.backend.get_vocab())


def stored_files(tmp_path):
    return sorted((tmp_path / "cache" / "token-chars").glob("*.json"))


def test_a_miss_scans_and_stores_and_a_hit_reads_the_same_count(folder, tmp_path):
    tok = Tokenizer.from_folder(folder)
    assert TC.longest_token_chars(tok) == (scanned(tok), "scan")
    assert len(stored_files(tmp_path)) == 1
    again = Tokenizer.from_folder(folder)         # a later start: another Tokenizer, the same file
    assert TC.longest_token_chars(again) == (scanned(tok), "cache")
    engine = SimpleNamespace(tokenizer=again)     # what the server's size check uses
    assert max_token_chars(engine) == scanned(tok) > 1


def test_the_cache_is_keyed_by_the_files_bytes(folder, tmp_path):
    """A tokenizer.json with one more (longer) added token is another key: its own scan, not the
    count stored for the old file, and both files stay."""
    tok = Tokenizer.from_folder(folder)
    old = TC.longest_token_chars(tok)[0]
    tok.backend.add_tokens(["<|" + "x" * (old + 20) + "|>"])
    tok.backend.save(str(folder / "tokenizer.json"))
    changed = Tokenizer.from_folder(folder)
    assert TC.longest_token_chars(changed) == (old + 24, "scan") == (scanned(changed), "scan")
    assert len(stored_files(tmp_path)) == 2
    assert TC.longest_token_chars(Tokenizer.from_folder(folder)) == (old + 24, "cache")


def test_a_damaged_cache_file_is_scanned_again_and_rewritten(folder, tmp_path):
    tok = Tokenizer.from_folder(folder)
    TC.longest_token_chars(tok)
    (path,) = stored_files(tmp_path)
    for damaged in ("", "{not json", json.dumps({"max_token_chars": 0}), json.dumps({"other": 5})):
        path.write_text(damaged)
        assert TC.longest_token_chars(tok) == (scanned(tok), "scan")
        assert json.loads(path.read_text()) == {"max_token_chars": scanned(tok)}


def test_an_unwritable_cache_dir_costs_a_scan(folder, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache dir would be")
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(blocker))
    tok = Tokenizer.from_folder(folder)
    assert TC.longest_token_chars(tok) == (scanned(tok), "scan")
    assert TC.longest_token_chars(tok) == (scanned(tok), "scan")


def test_a_file_changed_since_the_load_keeps_the_loaded_key(folder, tmp_path):
    """The backend in memory is what the server tokenizes with, and the key is the SHA-256 of the
    bytes it was built from, taken at the load: a tokenizer.json rewritten since changes neither
    its count nor its key, and a load of the new file gets its own."""
    tok = Tokenizer.from_folder(folder)
    other = Tokenizer.from_folder(folder)
    other.backend.add_tokens(["<|" + "y" * 300 + "|>"])
    other.backend.save(str(folder / "tokenizer.json"))
    assert TC.longest_token_chars(tok) == (scanned(tok), "scan")
    assert scanned(tok) < 300 and len(stored_files(tmp_path)) == 1
    assert TC.longest_token_chars(Tokenizer.from_folder(folder)) == (304, "scan")
    assert TC.longest_token_chars(tok) == (scanned(tok), "cache")
    assert TC.longest_token_chars(None) == (TC.DEFAULT, "backend")


def test_a_hit_reads_no_tokenizer_json_and_keeps_the_keys_of_earlier_starts(folder, tmp_path):
    """The file is read and hashed once, by the load: with it gone afterwards the count still
    comes from the cache, whose key is still SHA-256(file bytes + the salt) as before the
    tokenizer kept its hash (so what earlier versions stored stays in use)."""
    data = (folder / "tokenizer.json").read_bytes()
    count = TC.longest_token_chars(Tokenizer.from_folder(folder))[0]
    again = Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").unlink()
    assert TC.longest_token_chars(again) == (count, "cache")
    assert TC.cache_file(again).stem == hashlib.sha256(data + b"|token-chars|1").hexdigest()
    assert again.file_key(b"") == hashlib.sha256(data).hexdigest()
