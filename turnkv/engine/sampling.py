"""Token sampling: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(int(params.seed))
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
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
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
