"""RWKV's "world" tokenizer from a GGUF (``tokenizer.ggml.model`` "rwkv"): a greedy longest-match
trie over the vocabulary's byte strings, with no merges and no pre-tokenizer, as llama.cpp's
``llm_tokenizer_rwkv`` runs it. The `tokenizers` library has no model for it, so ``RwkvWorldBackend``
stands in for a ``tokenizers.Tokenizer`` behind turnkv's Tokenizer (the methods it and the server call).

The converter stores each token as Python's ``repr`` of its bytes without the quotes (``\\n``,
``\\xe4``, ``\\\\``); ``unescape`` undoes it as llama.cpp's ``llama_unescape_rwkv_token`` does. Every
token goes into the trie, the control token ``<s>`` (id 0) and the ``[PADn]`` fillers included, as
llama.cpp does: a chat template's ``{{bos_token}}`` then encodes to id 0.
"""

from __future__ import annotations

import mmap
import struct
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from .errors import ModelLoadError
from .tokenizer import Tokenizer

_CONTROL = 3            # gguf.TokenType.CONTROL
_VALUE = -1             # the trie node's key for "a token ends here" (byte keys are 0..255)
_ESCAPES = {ord("t"): 9, ord("n"): 10, ord("r"): 13}


def unescape(text: str) -> bytes:
    """A vocabulary entry's bytes (llama.cpp's ``llama_unescape_rwkv_token``)."""
    out, raw, i = bytearray(), text.encode("utf-8"), 0
    while i < len(raw):
        c = raw[i]
        if c != 0x5C or i + 1 >= len(raw):   # not a backslash
            out.append(c)
            i += 1
        elif raw[i + 1] == ord("x"):
            out.append(int(raw[i + 2:i + 4], 16))
            i += 4
        else:
            out.append(_ESCAPES.get(raw[i + 1], raw[i + 1]))
            i += 2
    return bytes(out)


def _byte_level_table() -> dict[int, str]:
    # GPT-2's byte -> printable character map: what id_to_token shows, so the server's logprobs
    # (which read a ByteLevel decoder's pieces back to bytes) give each token's exact bytes
    from tokenizers.pre_tokenizers import ByteLevel

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(ByteLevel.alphabet())
    return table


@dataclass
class Encoding:
    ids: list[int]
    offsets: list[tuple[int, int]]   # character spans; a token that splits a character covers it


class RwkvWorldBackend:
    """Greedy longest-match over ``pieces`` (token id -> bytes); ids in ``control`` are skipped by
    ``decode(skip_special_tokens=True)``."""

    def __init__(self, pieces: list[bytes], control: Iterable[int] = ()):
        from tokenizers import decoders

        self.pieces = pieces
        self.control = frozenset(control)
        self.decoder = decoders.ByteLevel()
        self.model = self     # Tokenizer reads type(backend.model).__name__ (not "BPE")
        self._root: dict = {}
        for i, piece in enumerate(pieces):
            node = self._root
            for b in piece:
                node = node.setdefault(b, {})
            node.setdefault(_VALUE, i)   # the first id wins a duplicate, as llama.cpp's trie does
        table = _byte_level_table()
        self._names = ["".join(table[b] for b in p) for p in pieces]
        self._ids = {}
        for i, name in enumerate(self._names):
            self._ids.setdefault(name, i)

    def encode_bytes(self, data: bytes) -> list[tuple[int, int, int]]:
        """(id, start, end) byte spans, longest match first (llm_tokenizer_rwkv_session::tokenize)."""
        out, pos, n, root = [], 0, len(data), self._root
        while pos < n:
            node, best, end, i = root.get(data[pos]), None, pos + 1, pos
            while node is not None:
                if _VALUE in node:
                    best, end = node[_VALUE], i + 1
                i += 1
                if i >= n:
                    break
                node = node.get(data[i])
            if best is None:   # every single byte is a token in the world vocabulary
                raise ValueError(f"byte {data[pos]:#x} is not in the vocabulary")
            out.append((best, pos, end))
            pos = end
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        # llama.cpp adds no BOS for this vocabulary unless the file says so (bos_to_add decides)
        data = text.encode("utf-8")
        starts, pos = [], 0
        for ch in text:
            starts.append(pos)
            pos += len(ch.encode("utf-8"))
        starts.append(pos)
        spans = self.encode_bytes(data)
        offsets = [(bisect_right(starts, s) - 1, bisect_left(starts, e)) for _, s, e in spans]
        return Encoding([t for t, _, _ in spans], offsets)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.control))
        return data.decode("utf-8", errors="replace")

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.pieces)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._names[token_id] if 0 <= token_id < len(self._names) else None

    def get_added_tokens_decoder(self) -> dict:
        return {}

    def grammar_tokens(self) -> list[bytes]:
        """Each token's bytes as llguidance takes a vocabulary without a tokenizer.json
        (engine/grammar.py): a control token behind a 0xff byte, which marks it special, so a
        grammar never spells text with ``<s>``."""
        return [b"\xff" + p if i in self.control else p for i, p in enumerate(self.pieces)]

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """The trie's ids for ``data``, no BOS: what llguidance calls to tokenize a forced string."""
        return [t for t, _, _ in self.encode_bytes(data)]


def _read_strings(path: Path, offset: int, count: int) -> list[str]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        out, pos, unpack = [], offset, struct.Struct("<Q").unpack_from
        for _ in range(count):
            n = unpack(buf, pos)[0]
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        return out


def _array(path: Path, value, dtype) -> list:
    """A metadata array, whether the header parsed it (short) or left it lazy (GGUFArray)."""
    if isinstance(value, list):
        return value
    if dtype is str:
        return _read_strings(path, value.offset, value.count)
    return np.fromfile(path, dtype=dtype, count=value.count, offset=value.offset).tolist()


def load_rwkv_world_tokenizer(path: Path, metadata: dict, *, chat_template: str | None = None,
                              extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
    """The world tokenizer of a GGUF. EOS: the file's eos and eot ids (the converter writes eot
    261, "\\n\\n", as the end of a chat turn, which llama.cpp stops on too)."""
    try:
        pieces = [unescape(t) for t in _array(path, metadata["tokenizer.ggml.tokens"], str)]
        types = _array(path, metadata.get("tokenizer.ggml.token_type", []), np.int32)
    except (ValueError, KeyError, IndexError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot read RWKV's world vocabulary ({e})") from None
    backend = RwkvWorldBackend(pieces, [i for i, t in enumerate(types) if t == _CONTROL])
    special = {}
    for key in ("bos", "eos"):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(pieces):
            special[f"{key}_token"] = backend.id_to_token(tid)
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    eos = list(extra_eos_ids) + ([eot] if eot is not None else [])
    template = chat_template or metadata.get("tokenizer.chat_template")
    return Tokenizer(backend, special_tokens=special, chat_template=template, extra_eos_ids=eos, source=path)
