"""Which sequences run in the next step, and with how many tokens (nano-vllm's shape).

Every step takes each decoding sequence's next token first (a stream never waits for someone
else's prompt), then prefill chunks of the admitted sequences still prefilling, oldest first,
under ``max_batch_tokens`` (under ``prefill_chunk`` when it is larger and no sequence decodes).
A chunk never crosses the sequence's next checkpoint, so the engine can snapshot at message
boundaries between steps. At most ``max_seqs`` sequences hold a state
slot at a time; the rest wait, at most ``max_queue`` of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..images import image_run_cut
from ..models.batch import ALL, LAST, NONE
from .sequence import DECODE, PREFILL, Sequence

DEFAULT_MAX_SEQS = 8
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BATCH_TOKENS = 256


class QueueFull(Exception):
    """More requests are waiting than the queue holds (the server answers 429)."""


@dataclass
class Work:
    seq: Sequence
    tokens: list[int]
    logits: str           # LAST when this chunk ends the prompt or is a decode token; ALL with a draft
    prefill: bool
    draft: int = 0        # decode: draft tokens after the next token (docs/speculative.md)


class Scheduler:
    def __init__(self, max_seqs: int = DEFAULT_MAX_SEQS, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int = 512, whole_images: bool = False):
        if max_seqs < 1 or max_queue < 0 or max_batch_tokens < 1 or prefill_chunk < 1:
            raise ValueError("max_seqs, max_batch_tokens and prefill_chunk must be >= 1, max_queue >= 0")
        self.max_seqs, self.max_queue = max_seqs, max_queue
        # a full decode batch plus at least one prefill token, so a prompt always progresses
        self.max_batch_tokens = max(max_batch_tokens, max_seqs + 1)
        self.prefill_chunk = prefill_chunk
        # families whose image tokens attend to each other both ways (Gemma 3): a prefill chunk
        # never splits an image's run of keys
        self.whole_images = whole_images
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admissible(self) -> list[Sequence]:
        """Take waiting sequences while slots are free (the engine admits them)."""
        out = []
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting.popleft()
            self.running.append(seq)
            out.append(seq)
        return out

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def plan(self) -> list[Work]:
        work: list[Work] = []
        budget = self.max_batch_tokens
        decoding = [s for s in self.running if s.status == DECODE and s.next_token is not None]
        if not decoding:
            # no stream waits on this step: a prompt's chunk may take the whole prefill chunk
            # (the same bits in fewer, larger forwards)
            budget = max(budget, self.prefill_chunk)
        # drafts take what the decode tokens leave, less room for a prefill chunk
        prefilling = any(s.status == PREFILL and s.plan.follow is None for s in self.running)
        spare = budget - len(decoding) - (min(self.prefill_chunk, budget // 2) if prefilling else 0)
        for seq in decoding:
            draft = seq.draft(spare) if seq.spec is not None else []
            spare -= len(draft)
            work.append(Work(seq, [seq.next_token, *draft], ALL if draft else LAST, prefill=False, draft=len(draft)))
            budget -= 1 + len(draft)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status != PREFILL or seq.plan.follow is not None:
                continue
            end = seq.plan.chunk_end(min(self.prefill_chunk, budget), image_run_cut if self.whole_images else None)
            n = end - seq.pos
            work.append(Work(seq, seq.prompt[seq.pos:end], LAST if end == len(seq.prompt) else NONE, prefill=True))
            budget -= n
        return work
