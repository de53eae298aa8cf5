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

from ..cache.slots import SeqState
from ..images import model_ids
from ..prompt_cache.plan import Restored, SeqPlan
from ..prompt_cache.store import Namespace
from .speculative import Speculation, kinds_dict
from .sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from .text import StopMatcher

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    boundaries: list[int] = field(default_factory=list)   # message ends (checkpoint candidates)
    tenant: str = ""
    stop_token_ids: list[int] = field(default_factory=list)   # extra end-of-sequence ids
    render_ms: float = 0.0       # chat template (images prepared included), before the request reached the engine
    tokenize_ms: float = 0.0     # the tokenizer on the rendered text, before the request reached the engine
    grammar: object | None = None   # engine/grammar.py Grammar: constrains the sampled tokens
    owner: str = ""              # the tenant whose cache budget, flush and stats the request counts in
    timeout_s: float | None = None   # the generation ends ("timeout") this long after submit
    images: dict = field(default_factory=dict)   # image_id -> images.ImageInput (keys in prompt_ids)


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
    render_ms: float = 0.0       # chat template (before submit)
    tokenize_ms: float = 0.0     # tokenizer (before submit)
    queue_ms: float = 0.0        # submit -> admitted to a state slot
    lookup_ms: float = 0.0       # prompt-cache lookup
    prefill_ms: float = 0.0      # admitted -> prompt consumed
    sample_ms: float = 0.0       # the first token's sampling (grammar mask included)
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
    speculative: str = "off"     # the mode that ran, or "off (reason)" (docs/speculative.md)
    drafted: int = 0             # draft tokens verified
    accepted: int = 0            # of them, those plain decoding produced too
    forced_drafted: int = 0      # of the drafted, those the grammar forced (their own kind) ...
    forced_accepted: int = 0     # ... and of those the accepted
    drafts: dict = field(default_factory=dict)   # by kind ("ngram", "cache", "forced"): drafted, accepted, rate

    def line(self, usage: Usage) -> str:
        drafts = f" | drafts: {self.accepted} of {self.drafted} tok accepted" if self.drafted else ""
        if len(self.drafts) > 1 or self.forced_drafted:
            drafts += " (" + ", ".join(f"{k} {c['accepted']} of {c['drafted']}" for k, c in self.drafts.items()) + ")"
        return (f"[prompt {usage.prompt_tokens} tok, cached {usage.cached_tokens}, prefilled {self.prefilled_tokens} | "
                f"TTFT {self.ttft_ms:.0f} ms | {usage.completion_tokens} tok at {self.decode_tokens_per_s:.1f} tok/s"
                f"{drafts}]")


@dataclass
class TokenEvent:
    token_id: int
    text: str          # newly printable text (may be "")
    index: int = 0     # the choice (0..n-1) of a request with n > 1
    logprob: TokenLogprob | None = None   # when the request asked for logprobs (a new token only)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "timeout"
    usage: Usage
    stats: Stats
    first_logits: torch.Tensor | None = None   # the logits the first token was sampled from
    index: int = 0                             # the choice (0..n-1)
    logprobs: list[TokenLogprob] | None = None  # one per token of the text (end tokens excluded)
    stop_string: str | None = None             # the stop string that ended it ("stop" without: an end token)


@dataclass
class Failure:
    """The event that ends a sequence whose step raised (the server maps it to a 500)."""

    error: BaseException


class Sequence:
    def __init__(self, req: GenerationRequest, ns: Namespace, tokenizer, eos: set[int], budget: int,
                 sink: Callable[[object], None], index: int = 0):
        self.req, self.ns, self.sink = req, ns, sink
        self.prompt = [int(t) for t in req.prompt_ids]
        self.params: SamplingParams = req.params
        self.index = index                    # the choice among the request's n
        # the sampler sees an image's placeholder id where the prompt holds its keys (transformers' ids)
        self.sampler = Sampler(self.params, model_ids(self.prompt, {i: m.placeholder for i, m in req.images.items()})
                               if req.images else self.prompt, index)
        self.image_embeds: dict = {}          # image_id -> embeddings, held while the sequence runs
        # per-sequence grammar state (None: no mask work at all for this sequence)
        self.matcher = req.grammar.matcher() if req.grammar is not None else None
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        # n > 1: the leader (choice 0) prefills the prompt; ``forks`` are choices 1..n-1, which start
        # from a snapshot of its state at the prompt end (``fork_from``: snapshot and logits)
        self.forks: list[Sequence] = []
        self.fork_from: tuple | None = None
        self.stop = (StopMatcher(tokenizer, self.params.stop, self.params.skip_special_tokens)
                     if tokenizer is not None else None)
        self.eos, self.budget = eos, budget
        self.status = WAITING
        self.state: SeqState | None = None
        self.plan: SeqPlan | None = None      # its reuse (prompt_cache/plan.py), from admission on
        self.next_token: int | None = None    # sampled, not yet fed
        self.spec: Speculation | None = None   # drafts after next_token (engine.py _speculation)
        self.drafter = None      # an mtp drafter, fed the sequence's hidden states from its prefill on (engine/mtp.py)
        self.generated: list[int] = []
        self.last_logits: torch.Tensor | None = None   # logits of the state's last token
        self.first_logits: torch.Tensor | None = None
        self.cancelled = threading.Event()
        self.usage = Usage(prompt_tokens=len(self.prompt))
        self.stats = Stats(render_ms=req.render_ms, tokenize_ms=req.tokenize_ms)
        self.finish_reason = "length"
        self.result: Result | None = None
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = None
        self.deadline = None if req.timeout_s is None else self.t_submit + req.timeout_s

    def cancel(self) -> None:
        """Thread-safe: takes effect at the engine's next step (for every choice of the request)."""
        self.cancelled.set()
        for fork in self.forks:
            fork.cancelled.set()

    @property
    def done(self) -> bool:
        return self.status == FINISHED

    def ended_early(self, now: float) -> str | None:
        """"cancelled" or "timeout" when the sequence must end at this step, else None."""
        if self.cancelled.is_set():
            return "cancelled"
        if self.deadline is not None and now >= self.deadline:
            return "timeout"
        return None

    @property
    def pos(self) -> int:
        """Prompt tokens the state holds (prefill progress)."""
        return self.plan.pos if self.plan is not None else 0

    def note_restored(self, restored: Restored) -> None:
        s = self.stats
        s.lookup_ms, s.restore_ms, s.reuse_from = restored.lookup_ms, restored.restore_ms, restored.reuse_from
        s.restored_origin, s.restored_entry_length = restored.origin, restored.entry_length
        self.usage.cached_tokens = restored.cached    # for a fork: per choice (the request counts the leader's)

    def emit(self, event) -> None:
        self.sink(event)

    def draft(self, room: int) -> list[int]:
        """Tokens guessed to follow ``next_token`` (at most ``room``, never past the budget)."""
        room = min(room, self.budget - len(self.generated) - 1)
        if self.spec is None or room <= 0:
            return []
        # the drafters read the state's own tokens (prompt + generated, all but ``next_token``,
        # which this step feeds), ``next_token`` put on for the call: no copy of the context
        seen = self.state.tokens
        seen.append(self.next_token)
        try:
            return self.spec.propose(seen, room, self.matcher)
        finally:
            seen.pop()

    # --- sampling ------------------------------------------------------------------------------
    def take(self, logits: torch.Tensor) -> bool:
        """Sample from ``logits`` (those of the state's last token), emit the token; True when the
        sequence is finished."""
        t0 = time.perf_counter() if self.t_first is None else 0.0
        if self.matcher is None:
            token = self.sampler(logits)
        else:       # mask a copy: the unmasked logits are what the prompt cache stores
            token = self.sampler(self.matcher.mask(logits))
            self.matcher.advance(token)
        self.last_logits = logits
        if self.first_logits is None:
            self.first_logits = logits
        self.generated.append(token)
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.stats.sample_ms = (self.t_first - t0) * 1000
            self.stats.ttft_ms = (self.t_first - self.t_submit) * 1000
        if token in self.eos:
            self.finish_reason = "stop"
            return True
        entry = None
        if self.logprobs is not None:
            entry = token_logprob(logits, token, self.params.logprobs)
            self.logprobs.append(entry)
        text = self.stop.push(token) if self.stop is not None else ""
        if self.stop is not None and self.stop.stopped:
            if text or entry is not None:
                self.emit(TokenEvent(token, text, self.index, entry))
            self.finish_reason = "stop"
            return True
        self.emit(TokenEvent(token, text, self.index, entry))
        if len(self.generated) >= self.budget:
            return True
        self.next_token = token
        return False

    def build_result(self) -> Result:
        t_end = time.perf_counter()
        if self.stop is not None and self.finish_reason not in ("cancelled", "timeout"):
            tail = self.stop.flush()
            if tail:
                self.emit(TokenEvent(self.generated[-1], tail, self.index))
        s = self.stats
        s.checkpoints = self.plan.checkpoints if self.plan is not None else 0
        if self.spec is not None:
            s.drafted, s.accepted = self.spec.drafted, self.spec.accepted
            s.forced_drafted, s.forced_accepted = self.spec.forced_drafted, self.spec.forced_accepted
            s.drafts = kinds_dict(self.spec.kinds)
        self.usage.completion_tokens = len(self.generated)
        s.total_ms = (t_end - self.t_submit) * 1000
        s.decode_ms = (t_end - (self.t_first or t_end)) * 1000
        if len(self.generated) > 1 and s.decode_ms > 0:
            s.decode_tokens_per_s = (len(self.generated) - 1) / (s.decode_ms / 1000)
        text = self.stop.text if self.stop is not None else ""
        return Result(text, list(self.generated), self.finish_reason, self.usage, s, self.first_logits,
                      index=self.index, logprobs=self.logprobs,
                      stop_string=self.stop.matched if self.stop is not None else None)
