"""The probe that decides whether speculative decoding can be exact on the loaded model
(docs/speculative.md, "Why the output cannot change"): whether its forward is chunk-invariant,
bit for bit, and whether its recurrent state can be picked back at any verified token; and the
switch that makes the recurrent layers keep every token's state for a verified draft's step."""

from __future__ import annotations

import random

import torch

from ..cache.recurrent import StateCache
from ..cache.specs import CacheSpec, make_caches
from ..models.batch import ALL, LAST, Batch

RECURRENT_STATE = "recurrent_state"          # a recurrent state not kept per verified token
NOT_CHUNK_INVARIANT = "not_chunk_invariant"  # the probe saw a token's logits change with the chunk


def blocked_reason(model, specs: list[CacheSpec], dtype, device, modes, slack: int) -> str:
    """Why drafts cannot be verified exactly on ``model`` ("" when they can): a forward that is
    not chunk-invariant, or a recurrent state that cannot be picked back at every verified token
    (the probe, up to 17 rows: both of the kernels' tile widths)."""
    return chunk_probe(model, specs, dtype, device, modes, slack, 16)


def keep_trails(caches) -> list:
    """``caches``, their recurrent layers keeping every token's state (a verified draft's step)."""
    for c in caches:
        if isinstance(c, StateCache):
            c.keep_trail()
    return caches


@torch.inference_mode()
def chunk_probe(model, specs: list[CacheSpec], dtype, device, modes, slack: int, k: int) -> str:
    """Whether ``k + 1`` tokens fed one at a time give the same logits, bit for bit, as the same
    tokens fed as a verified draft is (recurrent layers keeping their trail): as one chunk alone,
    as two chunks, beside another sequence's prefill chunk, and with the head run afterwards on
    blocks of the chunk's rows (``DraftLogits``), after a short prefill; and
    whether the state cut back inside the chunk then gives the single steps' logits too. On
    scratch caches with the engine's KV modes. "" when all hold, else the reason."""
    rng = random.Random(1234)
    vocab = int(model.vocab_size)
    prefix = torch.tensor([rng.randrange(vocab) for _ in range(13)])
    tail = torch.tensor([rng.randrange(vocab) for _ in range(k + 1)])

    def run(tokens, caches, logits=ALL):
        return model.forward(Batch.build([(tokens, caches, logits)], device))

    def fresh():
        caches = make_caches(specs, dtype, device, list(modes), slack)
        run(prefix, caches, LAST)
        return caches

    caches = fresh()
    want = torch.cat([run(tail[i:i + 1], caches, LAST) for i in range(len(tail))])
    cut = max(1, len(tail) // 2)
    caches = keep_trails(fresh())
    whole = run(tail, caches)
    if not all(c.can_truncate_to(len(prefix) + cut) for c in caches):
        return RECURRENT_STATE
    for c in caches:
        c.truncate(len(prefix) + cut)
    after_cut = torch.cat([whole[:cut]] + [run(tail[i:i + 1], caches, LAST) for i in range(cut, len(tail))])
    caches = keep_trails(fresh())
    first = run(tail[:cut], caches)
    for c in caches:
        c.truncate(len(prefix) + cut)      # what the engine does after a step: ends the trails
    split = torch.cat([first, run(tail[cut:], keep_trails(caches))]) if cut < len(tail) else whole
    other = make_caches(specs, dtype, device, list(modes), slack)
    beside = model.forward(Batch.build([(prefix[:5], other, LAST), (tail, keep_trails(fresh()), ALL)], device))[1:]
    hidden = model.forward(Batch.build([(tail, keep_trails(fresh()), ALL)], device, head=False))
    blocks = torch.cat([model.head(hidden[a:b]) for a, b in ((0, 1), (1, 4), (4, len(tail)))])   # DraftLogits
    same = all(torch.equal(want, got) for got in (whole, after_cut, split, beside, blocks))
    return "" if same else NOT_CHUNK_INVARIANT
