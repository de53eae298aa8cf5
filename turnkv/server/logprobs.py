"""Logprobs in OpenAI's two response shapes, from the engine's ``TokenLogprob`` entries.

The values are the engine's: ``log_softmax`` of the raw logits the model gave at each position
(before logit_bias, penalties, temperature and top-k/top-p/min-p), as vLLM's default
``raw_logprobs``. This module only names the tokens: ``token`` is the token's own text and
``bytes`` its exact UTF-8 bytes (a byte-level BPE token may hold part of a character: its
``token`` then shows U+FFFD, its ``bytes`` the real bytes). A model served without a tokenizer
names tokens ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids`` form).
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..engine.sampling import TokenLogprob

# log_softmax of finite logits is finite; a model that masks logits to -inf would otherwise put
# -Infinity (not JSON) in a response. vLLM clamps the same way.
LOGPROB_FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token id -> (text, bytes), cached (a response names the same tokens again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = False
        self.added: set[int] = set()
        if tokenizer is not None:
            backend = tokenizer.backend
            self.byte_level = type(backend.decoder).__name__ == "ByteLevel"
            self.added = set(backend.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._name(token_id)
        return hit

    def length(self, token_id: int) -> int:
        """How much of the response text the token is (nothing without a tokenizer: no text then)."""
        return len(self(token_id)[0]) if self.tokenizer is not None else 0

    def _name(self, token_id: int) -> tuple[str, list[int] | None]:
        piece = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None else None
        if piece is None:
            return f"token_id:{token_id}", None
        if token_id in self.added:
            raw = piece.encode("utf-8")
        elif self.byte_level:
            table = _byte_level_decoder()
            raw = bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode("utf-8")
        else:   # SentencePiece-style: "▁" for a space, <0xNN> byte fallback pieces
            m = _BYTE_PIECE.fullmatch(piece)
            raw = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def chat_content(entries: list[TokenLogprob], names: TokenText) -> list[dict]:
    """``choices[i].logprobs.content`` of a chat completion (or of one stream chunk)."""
    out = []
    for e in entries:
        text, raw = names(e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = names(tid)
            top.append({"token": t, "logprob": _lp(lp), "bytes": b})
        out.append({"token": text, "logprob": _lp(e.logprob), "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(entries: list[TokenLogprob] | None, names: TokenText) -> dict | None:
    return None if entries is None else {"content": chat_content(entries, names), "refusal": None}


def completion_logprobs(entries: list[TokenLogprob] | None, names: TokenText, offset: int = 0) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob, the
    sampled token always included, as OpenAI documents), text_offset (each token's start in the
    text, counting from ``offset``)."""
    if entries is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = names(e.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        top = {names(tid)[0]: _lp(lp) for tid, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += names.length(e.token_id)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def text_length(entries: list[TokenLogprob], names: TokenText) -> int:
    """How far the text offsets advance over ``entries`` (streaming keeps a running offset)."""
    return sum(names.length(e.token_id) for e in entries)
