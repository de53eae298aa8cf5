"""One request inside the engine: its tokens, its state slot, sampling and stop handling, and
where its events go.

A sequence moves WAITING -> PREFILL -> DECODE -> FINISHED. While prefilling, ``pos`` is how many
prompt tokens its state holds; once decoding, ``next_token`` is the sampled token the next step
feeds. Events (a TokenEvent per token, then the Result) go to ``sink``, a callable the submitter
passes: the server's posts them to the event loop, ``Engine.stream`` keeps them in a list.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.pool import SeqState
from ..prompt_cache.store import Namespace
from .sampling import Sampler, SamplingParams
from .text import StopMatcher

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    boundaries: list[int] = field(default_factory=list)   # message ends (checkpoint candidates)
    tenant: str = ""
    stop_token_ids: list[int] = field(default_factory=list)   # extra end-of-sequence ids
    render_ms: float = 0.0       # chat rendering + tokenizing, before the request reached the engine


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Stats:
    render_ms: float = 0.0       # chat template + tokenizer (before submit)
    queue_ms: float = 0.0        # submit -> admitted to a state slot
    lookup_ms: float = 0.0       # prompt-cache lookup
    prefill_ms: float = 0.0      # admitted -> prompt consumed
    ttft_ms: float = 0.0         # submit -> first token
    decode_ms: float = 0.0
    total_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    prefilled_tokens: int = 0
    restore_ms: float = 0.0
    checkpoints: int = 0
    reuse_from: str = "none"     # "none" | "prefix" | "truncated" | "exact"
    restored_origin: str = ""    # which stored entry: "checkpoint" | "prompt" | "generation"
    restored_entry_length: int = 0

    def line(self, usage: Usage) -> str:
        return (f"[prompt {usage.prompt_tokens} tok, cached {usage.cached_tokens}, prefilled {self.prefilled_tokens} | "
                f"TTFT {self.ttft_ms:.0f} ms | {usage.completion_tokens} tok at {self.decode_tokens_per_s:.1f} tok/s]")


@dataclass
class TokenEvent:
    token_id: int
    text: str          # newly printable text (may be "")


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    stats: Stats
    first_logits: torch.Tensor | None = None   # the logits the first token was sampled from


@dataclass
class Failure:
    """The event that ends a sequence whose step raised (the server maps it to a 500)."""

    error: BaseException


class Sequence:
    def __init__(self, req: GenerationRequest, ns: Namespace, tokenizer, eos: set[int], budget: int,
                 sink: Callable[[object], None]):
        self.req, self.ns, self.sink = req, ns, sink
        self.prompt = [int(t) for t in req.prompt_ids]
        self.params: SamplingParams = req.params
        self.sampler = Sampler(self.params)
        self.stop = StopMatcher(tokenizer, self.params.stop) if tokenizer is not None else None
        self.eos, self.budget = eos, budget
        self.status = WAITING
        self.state: SeqState | None = None
        self.pos = 0                          # prompt tokens the state holds (prefill progress)
        self.stops: list[int] = []            # checkpoint positions still ahead in the prompt
        # (leader, n): waiting for a running sequence to compute (and store) n shared prompt tokens
        self.follow: tuple[Sequence, int] | None = None
        self.next_token: int | None = None    # sampled, not yet fed
        self.generated: list[int] = []
        self.last_logits: torch.Tensor | None = None   # logits of the state's last token
        self.first_logits: torch.Tensor | None = None
        self.prompt_end_pending = False
        self.cancelled = threading.Event()
        self.usage = Usage(prompt_tokens=len(self.prompt))
        self.stats = Stats(render_ms=req.render_ms)
        self.finish_reason = "length"
        self.result: Result | None = None
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = None

    def cancel(self) -> None:
        """Thread-safe: takes effect at the engine's next step."""
        self.cancelled.set()

    @property
    def done(self) -> bool:
        return self.status == FINISHED

    def next_stop(self) -> int:
        """Where the current prefill chunk must end at the latest (a checkpoint or the prompt end)."""
        return self.stops[0] if self.stops else len(self.prompt)

    def emit(self, event) -> None:
        self.sink(event)

    # --- sampling ------------------------------------------------------------------------------
    def take(self, logits: torch.Tensor) -> bool:
        """Sample from ``logits`` (those of the state's last token), emit the token; True when the
        sequence is finished."""
        token = self.sampler(logits)
        self.last_logits = logits
        if self.first_logits is None:
            self.first_logits = logits
        self.generated.append(token)
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.stats.ttft_ms = (self.t_first - self.t_submit) * 1000
        if token in self.eos:
            self.finish_reason = "stop"
            return True
        text = self.stop.push(token) if self.stop is not None else ""
        if self.stop is not None and self.stop.stopped:
            if text:
                self.emit(TokenEvent(token, text))
            self.finish_reason = "stop"
            return True
        self.emit(TokenEvent(token, text))
        if len(self.generated) >= self.budget:
            return True
        self.next_token = token
        return False

    def build_result(self) -> Result:
        t_end = time.perf_counter()
        if self.stop is not None and self.finish_reason != "cancelled":
            tail = self.stop.flush()
            if tail:
                self.emit(TokenEvent(self.generated[-1], tail))
        s = self.stats
        self.usage.completion_tokens = len(self.generated)
        s.total_ms = (t_end - self.t_submit) * 1000
        s.decode_ms = (t_end - (self.t_first or t_end)) * 1000
        if len(self.generated) > 1 and s.decode_ms > 0:
            s.decode_tokens_per_s = (len(self.generated) - 1) / (s.decode_ms / 1000)
        text = self.stop.text if self.stop is not None else ""
        return Result(text, list(self.generated), self.finish_reason, self.usage, s, self.first_logits)
