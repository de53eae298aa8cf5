"""A GGUF's tokenizer gives llama.cpp's token ids for the same file (issue: model files as users
have them). The expected ids are llama.cpp's own `llama-tokenize` output, recorded by
tests/gguf_fixtures/record_llama_tokens.py for the bundled models and the converter-made fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnkv.loading import ModelLoadError, load_tokenizer
from turnkv.loading.pretokenizers import apply_gguf_pre_tokenizer, llama_cpp_pre_tokenizer
from turnkv.loading.pretokenizers_table import NAMES

HERE = Path(__file__).resolve().parent
RECORD = json.loads((HERE / "gguf_fixtures" / "llama_cpp_tokens.json").read_text(encoding="utf-8"))
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _path(name: str) -> str:
    if name.startswith("fixture:"):
        family = name.split(":", 1)[1]
        return str(HERE / "gguf_fixtures" / family / f"{family}-f32.gguf")
    return name


@pytest.fixture(scope="module", params=sorted(RECORD["models"]))
def model(request):
    return request.param, load_tokenizer(_path(request.param))


def test_token_ids_equal_llama_cpp_on_the_mixed_corpus(model):
    name, tok = model
    expected = RECORD["models"][name]
    for text, ids in zip(RECORD["texts"], expected):
        assert tok.encode(text, add_special_tokens=False) == ids, (name, text)


# recorded for the bundled models only (the fixtures share one tiny vocabulary)
@pytest.mark.skipif(not GPL3.is_file(), reason="Debian's /usr/share/common-licenses/GPL-3 is not on this machine")
@pytest.mark.parametrize("name", [n for n, ids in sorted(RECORD["models"].items()) if len(ids) > len(RECORD["texts"])])
def test_token_ids_equal_llama_cpp_on_the_gpl3_text(name):
    tok = load_tokenizer(_path(name))
    text = GPL3.read_text(encoding="utf-8")
    if len(text) != RECORD["gpl3_chars"]:
        pytest.skip("this machine's GPL-3 text is not the one recorded")
    assert tok.encode(text, add_special_tokens=False) == RECORD["models"][name][-1]


def test_the_bundled_smollm2_splits_digits_as_llama_cpp_does():
    """SmolLM2's GGUF names the `smollm` pre-tokenizer: every digit is split off first, so a run of
    spaces before a digit stays one piece (GPT-2's regex alone gives one space to the digit)."""
    tok = load_tokenizer("smollm2-135m")
    spaces, one = tok.token_to_id("ĠĠ"), tok.token_to_id("1")
    assert tok.encode("a  1", add_special_tokens=False)[1:] == [spaces, one]


def test_every_llama_cpp_name_builds_a_pre_tokenizer():
    import tokenizers

    for name in NAMES:
        spec = llama_cpp_pre_tokenizer(name)
        built = tokenizers.Tokenizer.from_str(json.dumps({
            "version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": spec}))
        assert built.pre_tokenizer is not None, name


def test_an_unknown_pre_tokenizer_is_a_clear_load_error():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(ModelLoadError, match="no-such-pre"):
        apply_gguf_pre_tokenizer({"model": {"type": "BPE"}}, meta)


def test_a_sentencepiece_vocabulary_is_left_as_converted():
    converted = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Metaspace"}}
    assert apply_gguf_pre_tokenizer(dict(converted), {"tokenizer.ggml.model": "llama"}) == converted
