"""llguidance's view of a tokenizer's vocabulary, with each token's bytes kept on disk.

From a tokenizer.json llguidance parses the whole file into a tokenizers Tokenizer (merges
included), derives each token's bytes from it, then builds its token trie and its slices. For
Gemma 3's 262k entries on a 2-core Zen 4 that is ~2.5-3 s (the parse ~1.2 s, trie and slices
~1.1 s), all of it holding the GIL (the Python binding does not release it). The bytes are the
same on every start, so the first build stores what llguidance derived (each token's bytes, which
are special) under the cache dir, keyed by the SHA-256 of the tokenizer.json bytes the tokenizer
was built from (taken at its load, so a hit reads no tokenizer.json), the vocabulary size, the
EOS ids and llguidance's version; later builds hand those bytes to llguidance's
``TokenizerWrapper`` with the same tokenizer's encode, which builds the same trie and slices
without the parse (~1.1 s for Gemma 3). A cache file that is missing, unreadable or fails its
checksum is rebuilt from the tokenizer.json; a cache dir that cannot be written only costs the
next start the full build. A tokenizer.json changed or gone since the load is not used: a miss
then builds the view from the backend in memory (its JSON), never cached.

llguidance tokenizes (forced bytes only, which turnkv does not use) with the file's tokenizer
after removing a ``Prepend`` normalizer and setting Metaspace's prepend scheme to never: a
tokenizer.json with either is always built from the file and never stored, so the tokenize
handed back with cached bytes is the file's own, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("turnkv.grammar")

FORMAT = 1
_MAGIC = b"turnkv grammar view\n"


class BytesVocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer: ``tokens`` (bytes), the EOS and
    BOS ids, the special tokens' ids, and a call that tokenizes bytes."""

    def __init__(self, tokens: list[bytes], tokenize, eos: int, bos: int | None, special: list[int] = ()):
        self.tokens, self.tokenize = tokens, tokenize
        self.eos_token_id, self.bos_token_id = eos, bos
        self.special_token_ids = list(special)

    def __call__(self, data: bytes) -> list[int]:
        return self.tokenize(data)


def build(llg, tokenizer):
    """llguidance's ``LLTokenizer`` for a turnkv Tokenizer; see the module docstring."""
    return build_with_origin(llg, tokenizer)[0]


def build_with_origin(llg, tokenizer):
    """``(view, origin)``: origin "cache" when the bytes came from the cache file, "file" when
    llguidance parsed the tokenizer.json (and the cache was written), "backend" for a tokenizer
    without one (its backend's JSON, or RWKV's own bytes), never cached."""
    n, eos = tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
    backend = tokenizer.backend
    if hasattr(backend, "grammar_tokens"):      # RWKV's world trie: no tokenizer.json at all
        vocab = BytesVocab(backend.grammar_tokens(), backend.tokenize_bytes, min(eos), tokenizer.bos_token_id)
        return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n, eos_token=eos), "backend"
    cache = cache_file(tokenizer, n, eos, llg)
    if cache is None:       # no tokenizer.json: the backend's own JSON
        return llg.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos), "backend"
    stored = read_tokens(cache, n)
    if stored is not None:      # (a tokenizer.json with a Prepend or Metaspace is never stored)
        tokens, special = stored
        vocab = BytesVocab(tokens, _encoder(backend), eos[0], tokenizer.bos_token_id, special)
        return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n, eos_token=eos), "cache"
    from ..loading.tokenizer import loaded_json

    data = loaded_json(tokenizer)
    if data is None:        # the file is gone or holds another vocabulary now
        return llg.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos), "backend"
    view = llg.LLTokenizer(data.decode("utf-8"), n_vocab=n, eos_token=eos)
    if b'"Prepend"' in data or b'"Metaspace"' in data:    # llguidance tokenizes with a changed copy
        return view, "file"
    write_tokens(cache, *token_bytes(view, n))
    return view, "file"


def _encoder(backend):
    def encode(data: bytes) -> list[int]:
        return backend.encode(data.decode("utf-8"), add_special_tokens=False).ids
    return encode


def cache_file(tokenizer, n_vocab: int, eos: list[int], llg) -> Path | None:
    """Where the view of ``tokenizer``'s vocabulary is kept, keyed by the SHA-256 of the
    tokenizer.json bytes it was built from (taken at its load, ``Tokenizer.file_key``); None for a
    tokenizer not built from one."""
    from ..loading.tokenizer import cache_root

    key = tokenizer.file_key(json.dumps([FORMAT, n_vocab, eos, getattr(llg, "__version__", "")]).encode())
    return None if key is None else cache_root() / "grammar-views" / f"{key}.bin"


def token_bytes(view, n_vocab: int) -> tuple[list[bytes], list[int]]:
    """Each token's bytes as ``view`` holds them (a special token's without llguidance's 0xff
    mark) and the special tokens' ids. ``decode_bytes`` writes a token without bytes as
    ``<[id]>``: such a token is empty unless its bytes really are that text."""
    tokens, special = [], []
    for i in range(n_vocab):
        data = view.decode_bytes([i])
        if view.is_special_token(i):
            special.append(i)
        elif data == b"<[%d]>" % i and view.greedy_tokenize(data.decode()) != [i]:
            data = b""
        tokens.append(data)
    return tokens, special


def write_tokens(path: Path, tokens: list[bytes], special: list[int]) -> None:
    """Written whole or not at all (a temporary file renamed over it); a failure is logged."""
    lengths = np.fromiter(map(len, tokens), dtype="<u4", count=len(tokens))
    payload = lengths.tobytes() + b"".join(tokens)
    header = json.dumps({"n": len(tokens), "special": special,
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".view-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + header + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        log.warning("turnkv: cannot store the grammar engine's vocabulary view in %s (%s)", path.parent, err)


def read_tokens(path: Path, n_vocab: int) -> tuple[list[bytes], list[int]] | None:
    """What ``write_tokens`` stored for ``n_vocab`` tokens, or None when the file is missing or
    not exactly that (another size, a wrong checksum, cut short)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        if not blob.startswith(_MAGIC):
            raise ValueError("no header")
        end = blob.index(b"\n", len(_MAGIC))
        header = json.loads(blob[len(_MAGIC):end])
        payload = memoryview(blob)[end + 1:]
        if header["n"] != n_vocab or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("another vocabulary or a damaged file")
        lengths = np.frombuffer(payload[:4 * n_vocab], dtype="<u4").astype(np.int64)
        ends = np.cumsum(lengths) + 4 * n_vocab
        if len(lengths) != n_vocab or (n_vocab and ends[-1] != len(payload)):
            raise ValueError("cut short")
        data = bytes(payload)
        tokens = [data[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist())]
        return tokens, [int(i) for i in header["special"]]
    except (ValueError, KeyError, TypeError) as err:
        log.warning("turnkv: the grammar engine's cached vocabulary view %s is unusable (%s); rebuilding", path, err)
        return None
