"""Constrained decoding: a grammar (JSON schema or Lark) applied as a token mask at sampling.

Built on llguidance (docs/structured_output.md says why: measured against xgrammar and
outlines-core on the SmolLM2 tokenizer). A ``Grammar`` is compiled once per request (off the
engine thread); each sequence that uses it gets its own ``Matcher`` (llguidance's ``LLMatcher``),
which computes the allowed-token bitmask before each sample and consumes the sampled token after.
Sequences without a grammar have no matcher and do no mask work at all.

When the grammar is complete the mask allows only the end-of-sequence tokens, so generation ends
with finish_reason "stop" (or "length" if max_tokens cuts it first).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

from . import grammar_view

_LOCK = threading.Lock()
# JSON as Python's json.dumps writes it (", " and ": "), as chat templates' tojson does: a
# constrained tool call then renders back into the next prompt token for token.
JSON_SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled (the request's fault: a 400)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as err:     # a dependency in pyproject.toml; only a broken install lacks it
        raise RuntimeError("structured output needs the llguidance package (pip install llguidance)") from err
    return llguidance


def ll_tokenizer(tokenizer):
    """llguidance's view of a turnkv Tokenizer, built once per tokenizer and cached on it (~0.3 s
    for a 49k vocabulary; Gemma 3's 262k: ~3 s the first time, ~1.1 s once its tokens' bytes are
    on disk, engine/grammar_view.py). Published only whole; a failed build raises here and the
    next call builds again."""
    cached = getattr(tokenizer, "_llguidance", None)
    if cached is not None:
        return cached
    with _LOCK:
        cached = getattr(tokenizer, "_llguidance", None)
        if cached is None:
            cached = grammar_view.build(_llguidance(), tokenizer)
            tokenizer._llguidance = cached
    return cached


class Grammar:
    """A compiled, validated grammar for one tokenizer; ``matcher()`` starts one sequence on it."""

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.tok = ll_tokenizer(tokenizer)
        self.grammar = grammar
        error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if error:
            raise GrammarError(messages[0] if messages else "the grammar is invalid")

    @classmethod
    def json_schema(cls, tokenizer, schema: dict | None) -> "Grammar":
        """Any JSON object (``schema`` None: response_format json_object) or one matching ``schema``."""
        llg = _llguidance()
        if schema is None:
            schema = {"type": "object"}
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_SEPARATORS)
        except ValueError as err:
            raise GrammarError(f"the JSON schema cannot be used: {err}") from None
        return cls(tokenizer, grammar)

    @classmethod
    def lark(cls, tokenizer, source: str) -> "Grammar":
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_lark(source))

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.m = llg.LLMatcher(grammar.tok, grammar.grammar, log_level=0)
        n = grammar.tok.vocab_size
        self.words = (n + 31) // 32
        self.bits = torch.empty(self.words, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` with the tokens the grammar forbids at -inf (also any rows past the
        tokenizer's vocabulary, the padding some models have)."""
        if self.m.is_error():
            raise RuntimeError(f"grammar matcher failed: {self.m.get_error()}")
        self.m.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.words * 4)
        # one bit per token, least significant first (~0.07 ms for a 49k vocabulary)
        allowed = torch.from_numpy(np.unpackbits(self.bits.numpy().view(np.uint8), bitorder="little")).view(torch.bool)
        vocab = logits.shape[-1]
        if allowed.numel() < vocab:
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
        return torch.where(allowed[:vocab], logits, float("-inf"))

    def advance(self, token: int) -> None:
        # once complete the matcher stays stopped (its mask: the end-of-turn tokens only); a request
        # with ignore_eos keeps sampling them, which must not push the matcher into an error
        if not self.m.is_stopped():
            self.m.consume_token(int(token))

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, nothing consumed: llguidance's fast-forward tokens
        (the forced bytes' canonical tokenization, less the last tokens that a longer token
        allowed by the grammar could span). Drafts (docs/speculative.md): plain decoding may
        spell the same bytes with other tokens, which verification finds."""
        if self.m.is_stopped() or self.m.is_error():
            return []
        return self.m.compute_ff_tokens()

    def valid(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (nothing consumed)."""
        return self.m.validate_tokens(tokens) if tokens and not self.m.is_error() else 0

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()
