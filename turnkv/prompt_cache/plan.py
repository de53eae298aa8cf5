"""The one owner of reuse: what a sequence restores when it starts, where its prefill chunks must
end so that it can snapshot, and what it stores after its first token and when it ends.

``Reuse`` is the engine's (one per engine: the prompt cache, the model's state kinds); ``begin``
gives every sequence a ``SeqPlan``, which the engine's step only asks: ``chunk_end`` (where the
next prefill chunk must stop), ``after_chunk``, ``prompt_done``, ``after_token``, ``finish``.

Full-attention KV can be truncated to any earlier length, so for an all-full-attention family the
end-of-generation snapshot serves every later prefix. Any other layer (sliding ring, chunked,
recurrent) can only be restored near the length it was taken at, so those families snapshot at
each message boundary during prefill too (and right after the prompt's last image, and at the end
of the prompt): an edited or regenerated turn then restores the last boundary before the change
instead of prefilling the whole conversation again.

Two more ways in: a *fork* (choices 1..n-1 of a request with n > 1) starts from the leader's
prompt-end snapshot; a *follower* (a request sharing a long prefix with one prefilling now) waits
for the leader to reach the end of that prefix, where the leader checkpoints, then begins again
and restores it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..cache.base import SnapshotMismatch
from ..cache.slots import SeqState, common_prefix
from ..cache.snapshot import ModelSnapshot
from ..cache.specs import CacheSpec, all_trimmable
from .store import Namespace, PromptCache

SHARE_MIN_TOKENS = 64        # a common prefix worth waiting for another sequence to compute


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
    reuse_from: str = "none"            # "none" | "prefix" | "truncated" | "exact" | "fork"
    origin: str = ""                    # the stored entry's origin: "checkpoint" | "prompt" | "generation"
    entry_length: int = 0
    lookup_ms: float = 0.0
    restore_ms: float = 0.0


@dataclass(eq=False)
class SeqPlan:
    """One sequence's reuse: its restore, its prefill progress (``pos``), the checkpoints ahead."""

    reuse: Reuse
    ns: Namespace
    prompt: list[int]
    boundaries: list[int] = field(default_factory=list)   # message ends (checkpoint candidates)
    media_end: int = 0                    # right after the prompt's last image (0: none)
    restored: Restored = field(default_factory=Restored)
    pos: int = 0                          # prompt tokens the state holds
    stops: list[int] = field(default_factory=list)   # checkpoint positions still ahead
    follow: tuple[SeqPlan, int] | None = None        # (leader, n): waiting for its first n tokens
    checkpoints: int = 0                  # snapshots this sequence stored before it ended
    prompt_end_pending: bool = False
    ended: bool = False

    @property
    def prefilling(self) -> bool:
        return not self.ended and self.follow is None and self.pos < len(self.prompt)

    def chunk_end(self, limit: int, image_cut=None) -> int:
        """Where the next prefill chunk ends: at most ``limit`` tokens, never past the next
        checkpoint; ``image_cut(prompt, start, end)`` may end it earlier (an image's tokens are
        never split), and a checkpoint inside the image is then dropped (not reachable)."""
        end = min(self.pos + limit, self.stops[0] if self.stops else len(self.prompt))
        if image_cut is not None:
            end = image_cut(self.prompt, self.pos, end)
            while self.stops and self.stops[0] < end:
                self.stops.pop(0)
        return end

    def after_chunk(self, state: SeqState, n: int) -> None:
        """``n`` more prompt tokens are in ``state``: snapshot when that is a checkpoint."""
        self.pos += n
        if self.stops and self.pos == self.stops[0]:
            self.stops.pop(0)
            self._store(state, None, "checkpoint")

    def prompt_done(self, computed: bool) -> None:
        """The state holds the whole prompt (``computed``: by prefill, not an exact restore). A
        family that cannot truncate snapshots it with its logits after the first token is out
        (not in TTFT), so a regenerate of the same prompt prefills nothing."""
        if self.restored.reuse_from != "fork":      # the leader counted the prompt
            self.reuse.record_prefill(len(self.prompt) - self.restored.cached, self.ns.owner)
        self.prompt_end_pending = computed and self.reuse.active and not self.reuse.trimmable

    def after_token(self, state: SeqState, first_logits: torch.Tensor | None) -> None:
        if self.prompt_end_pending:
            self.prompt_end_pending = False
            self._store(state, first_logits, "prompt")

    def fork_point(self, state: SeqState, logits: torch.Tensor) -> tuple[ModelSnapshot, torch.Tensor]:
        """What the request's other choices start from: the prompt's state and next-token logits
        (full-attention blocks are shared, not copied)."""
        return state.snapshot(), logits

    def follow_ready(self) -> bool:
        """A follower whose leader stored the shared prefix, or ended: to begin again."""
        if self.follow is None:
            return False
        leader, n = self.follow
        return leader.pos >= n or leader.ended

    def finish(self, state: SeqState, generated: int, last_logits: torch.Tensor | None) -> None:
        """The end-of-generation snapshot: prompt + generated tokens whose state is computed (the
        last sampled token is not). Its logits are those of the state's end only when the state
        holds the whole prompt and every generated token but the last."""
        self.ended = True
        complete = generated > 0 and state.length == len(self.prompt) + generated - 1
        if state.length > 0:
            self._store(state, last_logits if complete else None, "generation")

    def end(self) -> None:
        """Ended without storing (the sequence failed)."""
        self.ended = True

    def _store(self, state: SeqState, logits: torch.Tensor | None, origin: str) -> None:
        if self.reuse.active:
            self.reuse.cache.insert(self.ns, list(state.tokens), state.snapshot(logits), origin=origin)
            self.checkpoints += origin != "generation"


class Reuse:
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

    def begin(self, state: SeqState, ns: Namespace, prompt: list[int], boundaries: list[int], media_end: int = 0,
              others: list[SeqPlan] = ()) -> SeqPlan:
        """Restore the best stored entry for ``prompt`` into ``state`` (all or nothing; a miss
        leaves it empty) and plan the checkpoints ahead; with ``others`` (the plans running now),
        follow one that is about to compute a longer common prefix instead."""
        plan = SeqPlan(self, ns, prompt, list(boundaries), media_end)
        self.restart(plan, state)
        if plan.restored.logits is None and others:
            self._follow(plan, others)
        return plan

    def restart(self, plan: SeqPlan, state: SeqState) -> SeqPlan:
        """(Again, for a follower whose leader got there:) restore and plan the checkpoints."""
        plan.follow = None
        plan.restored = self._restore(state, plan.ns, plan.prompt)
        plan.pos = plan.restored.cached
        plan.stops = (checkpoint_positions(self.specs, plan.boundaries, plan.pos, len(plan.prompt), plan.media_end)
                      if self.active else [])
        return plan

    def fork(self, state: SeqState, ns: Namespace, prompt: list[int], point: tuple) -> SeqPlan:
        """A choice of a request with n > 1, from its leader's ``fork_point``."""
        snap, logits = point
        state.restore(snap, len(prompt), prompt)
        return SeqPlan(self, ns, prompt, restored=Restored(cached=len(prompt), logits=logits, reuse_from="fork"),
                       pos=len(prompt))

    def record_prefill(self, n: int, owner: str = "") -> None:
        if self.active:
            self.cache.record_prefill(n, owner)

    def _restore(self, state: SeqState, ns: Namespace, prompt: list[int]) -> Restored:
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

    def _follow(self, plan: SeqPlan, others: list[SeqPlan]) -> None:
        """Two requests with one long common prefix (a shared system prompt) at the same time:
        the later waits while the earlier prefills that prefix, which then checkpoints exactly at
        its end, and the later restores it instead of computing it again."""
        if not self.active:
            return
        best, best_len = None, plan.pos + SHARE_MIN_TOKENS - 1
        for other in others:
            if other is plan or not other.prefilling or other.ns != plan.ns:
                continue
            n = common_prefix(other.prompt, plan.prompt)
            if n > best_len and other.pos < n:
                best, best_len = other, n
        if best is None:
            return
        if best_len not in best.stops:
            best.stops = sorted(best.stops + [best_len])
        plan.follow = (best, best_len)
