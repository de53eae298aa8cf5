"""The longest vocabulary entry, in characters: an upper bound on the text one token stands for,
which the server's prompt-size check multiplies by the context (server/requests.py
``max_token_chars``).

Scanning the vocabulary means building a dict of every entry (``get_vocab``), holding the GIL:
~35 ms for SmolLM2's 49k entries on a 2-core Zen 2, ~0.2 s for Gemma 3's 262k, paid by every
start before the server answers (``warm_up``). The answer depends only on the tokenizer.json, so
it is kept under the cache dir (``$TURNKV_CACHE_DIR``, default ~/.cache/turnkv) in
``token-chars/<key>.json``, keyed by the SHA-256 of the bytes the tokenizer was built from (taken
when it loaded: ``Tokenizer.file_key``, the file is not read again), and the next start reads it
instead of scanning. A tokenizer without a tokenizer.json (RWKV's world tokenizer) is scanned and
nothing is stored; a cache file that is unreadable or not a positive count is scanned again and
rewritten; a cache dir that cannot be written costs only the next start the scan."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .tokenizer import cache_root

FORMAT = 1
DEFAULT = 64       # no tokenizer, or an empty vocabulary: what the size check assumed before


def scan(tokenizer) -> int:
    """The longest entry of ``tokenizer``'s vocabulary (added tokens included), from the
    backend in memory."""
    vocab = tokenizer.backend.get_vocab() if tokenizer is not None else {}
    return max((len(t) for t in vocab), default=DEFAULT)


def cache_file(tokenizer) -> Path | None:
    """Where the count of ``tokenizer``'s vocabulary is kept; None for a tokenizer not built from
    a tokenizer.json."""
    key = tokenizer.file_key(b"|token-chars|%d" % FORMAT) if tokenizer is not None else None
    return None if key is None else cache_root() / "token-chars" / f"{key}.json"


def longest_token_chars(tokenizer) -> tuple[int, str]:
    """``(count, origin)``: origin "cache" when the count came from the cache file, "scan" when
    the vocabulary was scanned (and the count stored), "backend" for a tokenizer without a
    tokenizer.json (scanned, never stored)."""
    path = cache_file(tokenizer)
    if path is None:
        return scan(tokenizer), "backend"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))["max_token_chars"]
        if isinstance(stored, int) and stored > 0:
            return stored, "cache"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    count = scan(tokenizer)
    _store(path, count)
    return count, "scan"


def _store(path: Path, count: int) -> None:
    """Written whole or not at all (a temporary file renamed over it); an unwritable dir is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".token-chars-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"max_token_chars": count}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
