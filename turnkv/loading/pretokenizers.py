"""A GGUF's BPE tokenizer splits text as llama.cpp splits it for the same file.

transformers' GGUF conversion gives every BPE vocabulary GPT-2's byte-level pre-tokenizer, but
llama.cpp picks the split regexes by the file's `tokenizer.ggml.pre` name (`smollm` splits every
digit on its own first, `llama-bpe` groups digits by three, ...). Token ids differ where the
regexes do (runs of spaces before a digit, long numbers), and with them prompts, prompt-cache keys
and perplexities. `apply_gguf_pre_tokenizer` rewrites the converted tokenizer.json to llama.cpp's
regexes, applied one after the other as llama.cpp applies them (each splits the pieces the one
before left, matches and the text between them kept), then the byte-level mapping.
"""

from __future__ import annotations

from .errors import ModelLoadError
from .pretokenizers_table import DEFAULT_REGEXES, IGNORE_MERGES, LLAMA_CPP_SOURCE, NAMES, REGEXES

# llama.cpp splits these with code of its own (unicode.cpp) instead of a regex engine: the regex
# that splits the same way. AFMoE's digits: a run of digits in groups of three from the right
# (12345 -> 12, 345).
_CUSTOM = {"\\p{AFMoE_digits}": "\\p{N}{1,3}(?=(?:\\p{N}{3})*(?!\\p{N}))"}


def pre_tokenizer_name(metadata: dict) -> str | None:
    """The file's pre-tokenizer name for a BPE vocabulary ("default" when it names none, as in
    llama.cpp), None for other vocabularies (SentencePiece, WordPiece: no split regexes)."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return None
    return str(metadata.get("tokenizer.ggml.pre") or "default")


def llama_cpp_pre_tokenizer(name: str) -> dict:
    """tokenizer.json's `pre_tokenizer` for llama.cpp's pre-tokenizer ``name``."""
    kind = NAMES.get(name)
    if kind is None:
        raise ModelLoadError(f"the GGUF's pre-tokenizer {name!r} (tokenizer.ggml.pre) is not one llama.cpp "
                             f"({LLAMA_CPP_SOURCE}) knows, so its token ids cannot be matched")
    splits = [{"type": "Split", "pattern": {"Regex": _CUSTOM.get(r, r)}, "behavior": "Isolated", "invert": False}
              for r in REGEXES.get(kind, DEFAULT_REGEXES)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def apply_gguf_pre_tokenizer(tokenizer_json: dict, metadata: dict) -> dict:
    """``tokenizer_json`` (a converted GGUF tokenizer) with llama.cpp's pre-tokenizer and merge
    rule for the file; unchanged for a vocabulary that is not BPE."""
    name = pre_tokenizer_name(metadata)
    if name is None or tokenizer_json.get("model", {}).get("type") != "BPE":
        return tokenizer_json
    tokenizer_json["pre_tokenizer"] = llama_cpp_pre_tokenizer(name)
    tokenizer_json["model"]["ignore_merges"] = name in IGNORE_MERGES
    return tokenizer_json
