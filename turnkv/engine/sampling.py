"""Token sampling: logit bias, penalties, greedy or temperature with min-p / top-k / top-p, seeded;
and the log-probabilities of what was sampled.

Order (vLLM's): logit_bias, then the repetition, frequency and presence penalties (these apply to
greedy decoding too), then temperature, min_p, top_k, top_p. Everything works on the one row of
logits a sequence gets per step, with vector ops only; the penalties keep per-sequence counts
(a float count per vocabulary entry, a "seen" mask for the repetition penalty), allocated once at
the first step and updated in place.

Random draws are keyed by position: the draw for a sequence's ``j``-th generated token comes from a
generator seeded with ``position_seed(base, j)`` (``base`` = the request's seed + the choice's
index, or a random 64-bit number for an unseeded request). A seeded request therefore draws the
same tokens whatever else is batched with it, and whether its tokens come one per step or several
per step (speculative decoding verifies a draft by sampling each of its positions in turn:
docs/speculative.md).

Logprobs are those of the distribution the model gave: ``log_softmax`` of the raw logits, before
bias, penalties, temperature and truncation (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

from .speculative import check_mode

# below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing by a denormal
# temperature would overflow the logits to inf and the softmax to NaN
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20            # top alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0
SEED_MOD = 2 ** 64           # torch.Generator seeds are 64-bit (negative seeds wrap the same way)
_MASK64 = SEED_MOD - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(base: int, position: int) -> int:
    """The generator seed of the draw for generated token ``position`` of a sequence whose base
    seed is ``base``: a 64-bit mix of both, so neighbouring positions and seeds share no stream."""
    return _splitmix64(base ^ _splitmix64(position))


class ParamError(ValueError):
    """A sampling parameter no request could satisfy; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0      # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0     # OpenAI: minus this times how often it was generated
    repetition_penalty: float = 1.0    # HF/vLLM: over prompt + generated tokens; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None        # None: off; k: the sampled token's logprob and the top k
    n: int = 1                         # choices sharing one prefill of the prompt
    speculative: str | None = None     # a mode of drafters.MODES; None: the engine's --speculative
    draft_max: int | None = None       # longest draft; None: the engine's --draft-max
    skip_special_tokens: bool = True   # False: the text shows special tokens (EOS never: it ends the text)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        def finite(name: str, value) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ParamError(f"{name} must be a finite number, got {value!r}", name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ParamError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            finite(name, getattr(self, name))
        if not 0.0 <= self.temperature <= 100.0:
            raise ParamError(f"temperature must be between 0 and 100, got {self.temperature!r}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < 0:
            raise ParamError(f"top_k must be >= 0, got {self.top_k!r}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParamError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", name)
        if not self.repetition_penalty > 0.0:
            raise ParamError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError(f"at most {MAX_LOGPROBS} top logprobs per token are supported, got {self.logprobs}",
                             "logprobs")
        if not isinstance(self.n, int) or self.n < 1:
            raise ParamError(f"n must be a positive integer, got {self.n!r}", "n")
        for name in ("speculative", "draft_max"):
            try:
                check_mode(self.speculative if name == "speculative" else None,
                           self.draft_max if name == "draft_max" else None)
            except ValueError as err:
                raise ParamError(str(err), name) from None
        for token, bias in self.logit_bias.items():
            finite("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ParamError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                                 "logit_bias")
        if vocab_size is not None:
            for name, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", self.stop_token_ids)):
                bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
                if bad is not None:
                    raise ParamError(f"{name}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", name)


class Sampler:
    """One sequence's sampler. ``prompt`` feeds the repetition penalty; ``index`` is the choice's
    index among a request's n (choice i of a seeded request uses seed + i, so choice 0 equals the
    same request with n = 1). Each call samples the next generated token: ``position`` counts
    them and keys the random draw (``position_seed``)."""

    def __init__(self, params: SamplingParams, prompt: list[int] | tuple[int, ...] = (), index: int = 0):
        self.params = params
        self.prompt = prompt
        self.generator = self.base = None
        if not params.greedy:
            self.base = ((int(params.seed) + index) % SEED_MOD if params.seed is not None
                         else secrets.randbits(64))
            self.generator = torch.Generator(device="cpu")
        self.index = index
        self.position = 0
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            self.bias_ids = torch.tensor([int(t) for t in params.logit_bias], dtype=torch.long)
            self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.counts: torch.Tensor | None = None     # generated-token counts (frequency/presence)
        self.seen: torch.Tensor | None = None       # prompt + generated tokens (repetition)

    @property
    def penalized(self) -> bool:
        p = self.params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)

    def _allocate(self, vocab: int, device) -> None:
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if len(self.prompt):
                ids = torch.tensor(list(self.prompt), dtype=torch.long, device=device)
                self.seen[ids[ids < vocab]] = True

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the choice is made from (bias and penalties applied); never modifies
        ``logits``."""
        p = self.params
        scores = logits.float()
        if self.bias_ids is not None:
            if self.bias_ids.device != scores.device:
                self.bias_ids, self.bias_values = self.bias_ids.to(scores.device), self.bias_values.to(scores.device)
            scores = scores.index_add(0, self.bias_ids, self.bias_values)
        if self.penalized:
            if self.counts is None and self.seen is None:
                self._allocate(scores.shape[-1], scores.device)
            if self.seen is not None:
                rp = p.repetition_penalty
                scores = torch.where(self.seen, torch.where(scores > 0, scores / rp, scores * rp), scores)
            if self.counts is not None:
                if p.frequency_penalty:
                    scores = scores - p.frequency_penalty * self.counts
                if p.presence_penalty:
                    scores = scores - p.presence_penalty * (self.counts > 0).float()
        return scores

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """Temperature, min_p, top_k and top_p: the scores to sample from, dropped tokens at -inf."""
        p = self.params
        scores = scores / p.temperature
        if p.min_p > 0.0:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            drop = cum - probs > p.top_p          # keep the smallest set whose mass reaches top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        return scores

    def observe(self, token: int) -> None:
        """Count a generated token for the penalties (in place)."""
        if self.counts is not None:
            self.counts[token] += 1.0
        if self.seen is not None:
            self.seen[token] = True

    def __call__(self, logits: torch.Tensor) -> int:
        scores = self.adjust(logits)
        if self.params.greedy:
            token = greedy_token(scores)
        else:
            probs = torch.softmax(self.warp(scores), dim=-1)
            if self.generator.device != probs.device:     # first step on an accelerator
                self.generator = torch.Generator(device=probs.device)
            self.generator.manual_seed(position_seed(self.base, self.position))
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.observe(token)
        self.position += 1
        return token


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the ``top`` most likely tokens at its position
    (``(token id, logprob)``, most likely first), all from ``log_softmax`` of the raw logits."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(int(token), float(logprobs[token]), top)


def greedy_token(scores: torch.Tensor) -> int:
    """``int(torch.argmax(scores))`` for a 1-D row: the first maximal value, a NaN counting as
    maximal. On the CPU (float32 / float64) NumPy's argmax, which answers the same: PyTorch's
    reduction took ~55 us on SmolLM2's 49k logits and ~330 us on Gemma 3's 262k on a 2-core
    machine, NumPy's 12 and 24 us (tests/test_sampling.py compares them)."""
    if scores.dim() == 1 and scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return int(np.argmax(scores.numpy()))
    return int(torch.argmax(scores))
