"""The model interface: one forward call runs a batch of sequences, each over its own state.

A step of the engine mixes sequences at different points (one decoding a token, another
prefilling a 256-token chunk of its prompt). The model sees them as one flat token tensor and a
``Span`` per sequence saying which rows are its tokens, which per-layer caches hold its state and
at which position its first token sits. A family runs everything that is row-wise (embedding,
norms, projections, MLPs, the lm_head) once over all rows, and everything that reads or writes
state (attention over the sequence's KV, recurrent and convolutional updates) once per span over
that span's own caches (``spans_apply``). Nothing in a row's result may depend on the other rows
of the call: that is what makes a sequence's tokens the same alone or batched (the kernels'
batch invariance, docs/batching.md).

``Model.forward(batch)`` returns the logits of the rows the spans asked for, in span order:
``"last"`` gives one row (the span's last token), ``"all"`` one per token, ``"none"`` nothing (a
prefill chunk that is not the end of its prompt); with ``Batch.head`` False, those rows' final
hidden states instead, whose logits ``Model.head`` gives. ``Model.step`` is the one-sequence
shorthand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

NONE, LAST, ALL = "none", "last", "all"
LOGITS = (NONE, LAST, ALL)


def logit_count(kind: str, length: int) -> int:
    """Logit rows a sequence of ``length`` tokens gets back for ``kind``: NONE 0, LAST 1, ALL each."""
    return {NONE: 0, LAST: 1, ALL: length}[kind]


@dataclass(frozen=True, eq=False)   # identity: a step may key per-span tables by span
class Span:
    """One sequence's share of a step: rows ``[start, start + length)`` of the token tensor."""

    caches: Sequence             # the sequence's per-layer state (cache/base.py LayerCache)
    start: int
    length: int
    position: int                # position of its first token (the caches' offset before the step)
    logits: str = LAST

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)

    def logit_count(self) -> int:
        return logit_count(self.logits, self.length)


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor          # [N] int64: every span's tokens, back to back
    spans: tuple[Span, ...]
    # image_id -> embeddings [n, hidden] of the images whose keys (turnkv/images.py) are in tokens
    images: dict | None = None
    # False: ``forward`` returns the final hidden states of the rows that want logits, for the
    # caller to run ``Model.head`` on (as few rows as it needs: speculative verification)
    head: bool = True
    # a list the forward appends its final hidden states to, every row's, before the final norm
    # (the MTP drafter's input: engine/mtp.py); None: not kept
    hidden: list | None = None

    @classmethod
    def build(cls, parts: Sequence[tuple[Sequence[int] | torch.Tensor, Sequence, str]], device="cpu",
              images: dict | None = None, head: bool = True, hidden: list | None = None) -> "Batch":
        """``parts``: (tokens, caches, logits) per sequence, in the order their logits come back."""
        spans, pieces, row = [], [], 0
        for tokens, caches, logits in parts:
            if logits not in LOGITS:
                raise ValueError(f"logits must be one of {LOGITS}, not {logits!r}")
            t = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.long)
            if t.dim() != 1 or t.shape[0] == 0:
                raise ValueError("each sequence of a batch needs at least one token")
            spans.append(Span(caches, row, t.shape[0], caches[0].offset if len(caches) else 0, logits))
            pieces.append(t)
            row += t.shape[0]
        if not spans:
            raise ValueError("an empty batch")
        tokens = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return cls(tokens.to(device=device, dtype=torch.long), tuple(spans), images or None, head, hidden)

    def logit_rows(self) -> torch.Tensor | slice | None:
        """Rows of the final hidden states whose logits are wanted: None (no row), a slice (a
        contiguous run, no gather), or an index tensor."""
        rows: list[int] = []
        for s in self.spans:
            if s.logits == LAST:
                rows.append(s.end - 1)
            elif s.logits == ALL:
                rows.extend(range(s.start, s.end))
        if not rows:
            return None
        if rows == list(range(rows[0], rows[-1] + 1)):
            return slice(rows[0], rows[-1] + 1)
        return torch.tensor(rows, dtype=torch.long, device=self.tokens.device)

    def logit_counts(self) -> list[int]:
        return [s.logit_count() for s in self.spans]


def split_logits(logits: torch.Tensor | None, parts: Sequence[tuple[str, int]]) -> list[torch.Tensor | None]:
    """``model.forward``'s logit rows per sequence, in batch order; ``parts``: (logits kind, token
    count) per sequence. LAST gets its one row, ALL its ``count`` rows, NONE None."""
    out, row = [], 0
    for kind, count in parts:
        n = logit_count(kind, count)
        out.append(None if n == 0 else logits[row] if kind == LAST else logits[row:row + n])
        row += n
    return out


def spans_apply(batch: Batch, fn: Callable[[Span], torch.Tensor], state_layer: int | None = None) -> torch.Tensor:
    """``fn(span)`` -> that span's rows ``[length, ...]``, for every span, stacked back in row
    order (no copy for a batch of one).

    ``state_layer``: ``fn`` updates layer ``state_layer``'s recurrent state. A span whose cache
    there keeps a trail (a verified draft: docs/speculative.md) is then run a token at a time, so
    that every token's state is kept and each is computed as plain decoding computes it."""
    spans = batch.spans
    if state_layer is not None and any(_keeps_trail(s, state_layer) for s in spans):
        spans = [one for s in spans for one in (_tokens_of(s) if _keeps_trail(s, state_layer) else (s,))]
    if len(spans) == 1:
        return fn(spans[0])
    return torch.cat([fn(s) for s in spans])


def _keeps_trail(span: Span, layer: int) -> bool:
    return span.length > 1 and getattr(span.caches[layer], "trail", None) is not None


def _tokens_of(span: Span) -> list[Span]:
    return [Span(span.caches, span.start + j, 1, span.position + j, span.logits) for j in range(span.length)]


def select_rows(x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
    """The hidden states of the rows whose logits were asked for (None: no logits this call)."""
    rows = batch.logit_rows()
    if rows is None:
        return None
    return x[rows]
