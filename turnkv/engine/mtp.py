"""``--speculative mtp``: drafts from the checkpoint's multi-token-prediction block (models/mtp.py),
one sequence's ``MtpDrafter`` each (drafters.py registers it; docs/speculative.md, "MTP").

The block needs, for every position ``i`` it has seen, the trunk's final hidden state there and the
token at ``i + 1``, and keeps its own K/V over those positions. The engine hands every step's
hidden rows of an ``mtp`` sequence to its drafter (``feed_hidden``: the forward appends its final
hidden states to ``Batch.hidden``); the drafter keeps those the block has not consumed yet. At a
draft, the rows the trunk confirmed (those of positions before the sequence's state length: a
rejected draft token's row is dropped) run through the block as one chunk, which extends its K/V;
the last row's logits give the first draft token, and each further token runs the block one row on
its own output (the chained rows' K/V are cut again before the drafter returns: they came from
drafted tokens, not from the trunk). So the block's K/V always follows the accepted tokens.

Where the trunk never computed hidden states for a prefix (a prompt-cache hit, a fork of a shared
prompt) the block attends over the positions from where this sequence's forwards start (RoPE at the
true positions): a shorter context for the drafter, nothing else. A drafter changes no output token
(verification keeps what plain decoding samples); only the tokens it gets right save steps."""

from __future__ import annotations

import torch

from ..cache.storage import NATIVE
from ..images import is_key
from ..models.base import rms_norm

MTP = "mtp"


def wants_hidden(engine, w) -> bool:
    """Whether this step keeps the hidden rows of work ``w``'s sequence: it drafts with ``mtp``, from
    its prefill on (while speculation is not blocked on the model) and then while it has drafts."""
    seq = w.seq
    if (seq.params.speculative or engine.speculative) != MTP or getattr(engine.model, "mtp", None) is None:
        return False
    return not engine.speculation_blocked() if w.prefill else seq.spec is not None


def hidden_sink(engine, work) -> list | None:
    """``Batch.hidden`` for a step: a list where any of its sequences drafts with ``mtp``."""
    return [] if any(wants_hidden(engine, w) for w in work) else None


def feed_hidden(engine, work, batch) -> None:
    """Each ``mtp`` sequence's rows of the step's hidden states to its drafter (made at its first)."""
    if not batch.hidden:
        return
    x = batch.hidden[0]
    for w, span in zip(work, batch.spans):
        if wants_hidden(engine, w):
            w.seq.drafter = engine.drafters[MTP](engine, w.seq)
            w.seq.drafter.observe(span.position, x[span.rows])


class MtpDrafter:
    """The MTP block's state for one sequence: its K/V (the positions before ``start`` from where
    the sequence's forwards began), the trunk's hidden rows of positions ``start ..`` not yet run
    through it, and the block's output at ``start - 1`` (``tail``: where a draft starts)."""

    kind = MTP

    def __init__(self, trunk):
        self.trunk, self.head = trunk, trunk.mtp
        self.reset(0)

    def reset(self, position: int) -> None:
        self.cache = self.head.new_cache(NATIVE)
        self.start, self.rows, self.tail = position, None, None
        self.last = None           # the trunk's row and the token the tail was computed from
        self.off = False           # an image key in the context: the block has no embedding for it

    def observe(self, position: int, rows: torch.Tensor) -> None:
        """The trunk's final hidden states (before its final norm) of positions ``position ..``."""
        known = self.start + (0 if self.rows is None else len(self.rows))
        if not self.start <= position <= known:     # a first step past a restored prefix (or a gap)
            self.reset(position)
        keep = position - self.start
        rows = rows.detach().clone()
        self.rows = rows if keep == 0 or self.rows is None else torch.cat([self.rows[:keep], rows])

    def draft(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens after ``history`` (the state's tokens and the next one)."""
        if not self.catch_up(history) or self.tail is None or k <= 0:
            return []
        head, trunk, at = self.head, self.trunk, len(history) - 1
        confirmed, out, drafts = self.cache.offset, self.tail, []
        with torch.inference_mode():
            while True:
                drafts.append(int(torch.argmax(head.logits(trunk, out)[-1])))
                if len(drafts) == k:
                    break
                out = head(trunk, torch.tensor(drafts[-1:]), out, at + len(drafts) - 1, self.cache)
        self.cache.truncate(confirmed)         # the chained rows came from drafts, not from the trunk
        return drafts

    def catch_up(self, history: list[int]) -> bool:
        """Run the confirmed rows (positions ``start .. len(history) - 2``) through the block; False
        when the drafter cannot draft here."""
        end = len(history) - 1                 # positions the state holds; history[end]: the next token
        n = end - self.start
        if self.off or n < 0 or n > (0 if self.rows is None else len(self.rows)):
            return False
        if n == 0 and (self.tail is None or self.last[1] == history[end]):
            return True
        if n == 0:      # asked again at the same point with another next token: its row again
            self.cache.truncate(self.cache.offset - 1)
            self.start, self.rows = end - 1, torch.cat([self.last[0], self.rows])
        tokens = history[self.start + 1:end + 1]
        if any(is_key(t) for t in tokens):
            self.off = True
            return False
        rows, self.rows = self.rows[:end - self.start], self.rows[end - self.start:]
        with torch.inference_mode():
            hidden = rms_norm(rows, self.trunk.norm, self.trunk.args.rms_norm_eps)    # H_i: after the final norm
            out = self.head(self.trunk, torch.tensor(tokens), hidden, self.start, self.cache)
        self.tail, self.start, self.last = out[-1:], end, (rows[-1:], tokens[-1])
        return True
