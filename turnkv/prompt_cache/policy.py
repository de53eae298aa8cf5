"""The one owner of reuse: what a sequence restores when it starts, where it snapshots while it
prefills, and what it stores when it ends.

Full-attention KV can be truncated to any earlier length, so for an all-full-attention family the
end-of-generation snapshot serves every later prefix. Any other layer (sliding ring, chunked,
recurrent) can only be restored near the length it was taken at, so those families snapshot at
each message boundary during prefill too (and right after the prompt's last image, and at the
end of the prompt): an edited or regenerated turn then restores the last boundary before the
change instead of prefilling the whole conversation again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..cache.base import SnapshotMismatch
from ..cache.slots import SeqState
from ..cache.specs import CacheSpec, all_trimmable
from .store import Namespace, PromptCache


def checkpoint_positions(specs: list[CacheSpec], boundaries: list[int], start: int, prompt_len: int,
                         media_end: int = 0) -> list[int]:
    """Sorted positions in ``(start, prompt_len)`` to snapshot at while prefilling
    ``tokens[start:prompt_len]``; ``boundaries`` are the token offsets where messages end,
    ``media_end`` the position right after the prompt's last image (0: none), the media
    checkpoint: an edit of the text after an image restores the image instead of prefilling it."""
    if all_trimmable(specs) or prompt_len <= start:
        return []
    return sorted({b for b in [*boundaries, media_end] if start < b < prompt_len})


@dataclass
class Restored:
    cached: int = 0                     # prompt tokens restored instead of prefilled
    logits: torch.Tensor | None = None  # the next-token logits, when the whole prompt was stored with them
    reuse_from: str = "none"            # "none" | "prefix" | "truncated" | "exact"
    origin: str = ""                    # the stored entry's origin: "checkpoint" | "prompt" | "generation"
    entry_length: int = 0
    lookup_ms: float = 0.0
    restore_ms: float = 0.0


class ReusePolicy:
    def __init__(self, cache: PromptCache | None, specs: list[CacheSpec], dtype: torch.dtype, slack: int,
                 identity):
        self.cache, self.specs, self.dtype, self.slack, self.identity = cache, specs, dtype, slack, identity
        self.trimmable = all_trimmable(specs)

    @property
    def active(self) -> bool:
        return self.cache is not None and self.cache.enabled

    def namespace(self, tenant: str = "", owner: str = "") -> Namespace:
        return Namespace(fingerprint=self.identity.fingerprint, dtype=str(self.dtype), modes=self.identity.modes,
                         slack=self.slack, tenant=tenant, owner=owner)

    # --- begin ---------------------------------------------------------------------------------
    def begin(self, state: SeqState, ns: Namespace, prompt: list[int]) -> Restored:
        """Look ``prompt`` up and restore the best entry into ``state`` (all or nothing); a miss
        leaves ``state`` empty."""
        t0 = time.perf_counter()
        hit = self.cache.lookup(ns, prompt) if self.active else None
        t1 = time.perf_counter()
        if hit is None:
            state.reset()
            return Restored(lookup_ms=(t1 - t0) * 1000)
        try:
            state.restore(hit.snapshot, hit.usable, prompt)
        except SnapshotMismatch as err:     # the store checks first; this is a last line of defence
            self.cache.record_refusal(err.reason)
            state.reset()
            return Restored()
        return Restored(
            cached=hit.usable, logits=hit.snapshot.logits.clone() if hit.use_logits else None,
            reuse_from="exact" if hit.use_logits else ("prefix" if hit.usable == hit.entry_length else "truncated"),
            origin=hit.origin, entry_length=hit.entry_length, lookup_ms=(t1 - t0) * 1000,
            restore_ms=(time.perf_counter() - t1) * 1000)

    # --- during prefill --------------------------------------------------------------------------
    def checkpoints(self, boundaries: list[int], start: int, prompt_len: int, media_end: int = 0) -> list[int]:
        return checkpoint_positions(self.specs, boundaries, start, prompt_len, media_end) if self.active else []

    def checkpoint(self, state: SeqState, ns: Namespace) -> None:
        self.cache.insert(ns, list(state.tokens), state.snapshot(), origin="checkpoint")

    @property
    def wants_prompt_end(self) -> bool:
        """Families that cannot truncate snapshot the whole prompt (with its logits), so a
        regenerate of the same prompt prefills nothing."""
        return self.active and not self.trimmable

    def prompt_end(self, state: SeqState, ns: Namespace, logits: torch.Tensor) -> None:
        self.cache.insert(ns, list(state.tokens), state.snapshot(logits), origin="prompt")

    # --- end -------------------------------------------------------------------------------------
    def finish(self, state: SeqState, ns: Namespace, logits: torch.Tensor | None) -> None:
        """The end-of-generation snapshot: prompt + generated tokens whose state is computed
        (the last sampled token is not); ``logits`` the next-token logits after exactly those."""
        if self.active and state.length > 0:
            self.cache.insert(ns, list(state.tokens), state.snapshot(logits), origin="generation")

    def record_prefill(self, n: int, owner: str = "") -> None:
        if self.active:
            self.cache.record_prefill(n, owner)
