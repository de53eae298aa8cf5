"""The engine: lookup -> restore -> chunked prefill with checkpoints -> decode -> insert.

One ``Engine`` owns one model and its live caches; it is not thread-safe (the server runs it on
a single worker thread). Every reuse goes through the prompt cache: a restore of a snapshot whose
blocks the live cache already holds copies nothing, so the common case (the next turn of the
conversation just served) costs no memcpy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..cache.base import SnapshotMismatch
from ..cache.modes import NATIVE
from ..cache.rotating import DEFAULT_SLACK
from ..cache.specs import CacheSpec, default_modes, make_caches
from ..prompt_cache.policy import checkpoint_positions, wants_prompt_end_snapshot
from ..prompt_cache.snapshot import ModelSnapshot, restore_snapshot, take_snapshot
from ..prompt_cache.store import Namespace, PromptCache
from .sampling import Sampler, SamplingParams
from .text import StopMatcher

DEFAULT_PREFILL_CHUNK = 512


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    boundaries: list[int] = field(default_factory=list)   # message ends (checkpoint candidates)
    tenant: str = ""
    stop_token_ids: list[int] = field(default_factory=list)   # extra end-of-sequence ids


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
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
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
    finish_reason: str  # "stop" | "length"
    usage: Usage
    stats: Stats
    first_logits: torch.Tensor | None = None   # the logits the first token was sampled from


class Engine:
    def __init__(self, model, tokenizer=None, *, fingerprint: str = "", name: str = "",
                 device="cpu", prompt_cache: PromptCache | None = None, slack: int = DEFAULT_SLACK,
                 kv_mode: str = NATIVE, kv_boundary_layers: int = 0,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_context: int | None = None,
                 weights: str = "native"):
        self.model, self.tokenizer = model, tokenizer
        self.name = name or model.family
        self.family, self.fingerprint = model.family, fingerprint or model.family
        self.dtype, self.device = model.dtype, torch.device(device)
        self.specs: list[CacheSpec] = model.cache_specs()
        self.modes = tuple(default_modes(self.specs, kv_mode, kv_boundary_layers))
        self.kv_mode, self.slack = kv_mode, slack
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.max_context = max_context or int(getattr(model.args, "max_position_embeddings", 0) or 8192)
        self.prompt_cache = prompt_cache
        self.caches = make_caches(self.specs, self.dtype, self.device, list(self.modes), slack)
        self.live_tokens: list[int] = []
        self.weights = weights    # the weight format the model was loaded in (models/weights.py)

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, *, dtype: torch.dtype = torch.float32, weights: str | None = "native",
             progress: bool = True, **kw) -> "Engine":
        """``weights``: a weight format of models/weights.py (packed formats quantize from the
        float32 checkpoint tensors, whatever the compute dtype; ``gguf`` keeps the GGUF's own
        quantized blocks), or None for the default: ``gguf`` for a GGUF model of a family with
        packable weights when the native kernels are built, else ``native``
        (``models.weights.default_format``)."""
        from ..loading import load_checkpoint, source_kind
        from ..models import family_class
        from ..models.weights import GGUF_FORMAT, check_format, default_format, load_model

        if weights is None:
            kind, arch = source_kind(model)
            weights = default_format(kind, family_class(arch)) if kind == "gguf" else "native"
        check_format(weights)    # before the load; load_model checks the family can hold it
        ckpt = load_checkpoint(model, dtype=dtype if weights == "native" else torch.float32, progress=progress,
                               keep_quantized=weights == GGUF_FORMAT)
        net = load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, dtype, weights,
                         progress=progress, quantized=ckpt.quantized)
        net.eval()
        if kw.get("max_context") is None:
            kw["max_context"] = int(ckpt.config.get("max_position_embeddings") or 8192)
        # packed weights compute different (close) logits: their snapshots are another namespace
        fingerprint = ckpt.fingerprint if weights == "native" else f"{ckpt.fingerprint}+w:{weights}"
        return cls(net, ckpt.tokenizer, fingerprint=fingerprint, name=ckpt.name, weights=weights, **kw)

    def namespace(self, tenant: str = "") -> Namespace:
        return Namespace(fingerprint=self.fingerprint, dtype=str(self.dtype), modes=self.modes,
                         slack=self.slack, tenant=tenant)

    def describe_layers(self) -> str:
        counts: dict[str, int] = {}
        for spec in self.specs:
            counts[spec.describe()] = counts.get(spec.describe(), 0) + 1
        return ", ".join(f"{n} x {kind}" for kind, n in counts.items())

    # --- chat helpers ------------------------------------------------------------------------
    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer: send the prompt as token ids "
                             f"(/v1/completions with a list of integers)")

    def chat_request(self, messages: list[dict], params: SamplingParams | None = None,
                     tenant: str = "") -> GenerationRequest:
        self._need_tokenizer()
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return GenerationRequest(list(rendered.ids), params or SamplingParams(), list(rendered.boundaries), tenant)

    def text_request(self, text: str, params: SamplingParams | None = None, tenant: str = "") -> GenerationRequest:
        self._need_tokenizer()
        return GenerationRequest(self.tokenizer.encode(text), params or SamplingParams(), [], tenant)

    # --- generation --------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> Result:
        result = None
        gen = self.stream(req)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                result = stop.value
                break
        return result

    def check_request(self, req: GenerationRequest) -> None:
        req.params.validate()
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context is {self.max_context} tokens "
                f"(at least one token must be generated)")
        vocab = self.model.vocab_size
        bad = next((t for t in req.prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def stream(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        """Yield a TokenEvent per generated token; the generator's return value is the Result.
        Closing the generator early cancels the request and leaves the caches consistent."""
        self.check_request(req)
        t_start = time.perf_counter()
        prompt = [int(t) for t in req.prompt_ids]
        params = req.params
        stats, usage = Stats(), Usage(prompt_tokens=len(prompt))
        ns = self.namespace(req.tenant)
        cache = self.prompt_cache if (self.prompt_cache is not None and self.prompt_cache.enabled) else None

        # 1. lookup + restore
        start, logits = self._restore(cache, ns, prompt, stats)
        usage.cached_tokens = start

        # 2. prefill the rest, snapshotting at checkpoints; the prompt-end snapshot (families that
        # cannot truncate) waits until the first token has been handed out, so it is not in TTFT
        prompt_end_pending = False
        if logits is None:
            logits = self._prefill(cache, ns, prompt, start, req.boundaries, stats)
            prompt_end_pending = cache is not None and wants_prompt_end_snapshot(self.specs)
        prompt_logits = logits

        def prompt_end_snapshot() -> None:
            nonlocal prompt_end_pending
            if prompt_end_pending and len(self.live_tokens) == len(prompt):
                cache.insert(ns, list(prompt), self._snapshot(prompt_logits), origin="prompt")
                stats.checkpoints += 1
            prompt_end_pending = False
        stats.prefilled_tokens = len(prompt) - start
        if cache is not None:
            cache.record_prefill(stats.prefilled_tokens)
        stats.prefill_ms = (time.perf_counter() - t_start) * 1000

        # 3. decode
        sampler = Sampler(params)
        stop = StopMatcher(self.tokenizer, params.stop) if self.tokenizer is not None else None
        eos = set(req.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        budget = min(params.max_tokens, self.max_context - len(prompt))
        generated: list[int] = []
        finish = "length"
        t_first = None
        last_logits = first_logits = logits
        completed = False
        try:
            while True:
                token = sampler(logits)
                last_logits = logits
                generated.append(token)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_ms = (t_first - t_start) * 1000
                if token in eos:
                    finish = "stop"
                    break
                text = stop.push(token) if stop is not None else ""
                if stop is not None and stop.stopped:
                    if text:
                        yield TokenEvent(token, text)
                    finish = "stop"
                    break
                yield TokenEvent(token, text)
                prompt_end_snapshot()
                if len(generated) >= budget:
                    break
                logits = self._forward([token], "last")
            completed = True
        except GeneratorExit:
            completed = True      # cancelled: the caches hold prompt + generated[:-1], consistent
            raise
        except BaseException:
            self._reset_live()
            raise
        finally:
            if completed:
                prompt_end_snapshot()
            if completed and cache is not None and len(self.live_tokens) > 0:
                snap = self._snapshot(last_logits if len(self.live_tokens) == len(prompt) + len(generated) - 1 else None)
                cache.insert(ns, list(self.live_tokens), snap, origin="generation")

        t_end = time.perf_counter()
        if stop is not None:
            tail = stop.flush()
            if tail:
                yield TokenEvent(generated[-1], tail)
        usage.completion_tokens = len(generated)
        stats.total_ms = (t_end - t_start) * 1000
        stats.decode_ms = (t_end - (t_first or t_end)) * 1000
        if len(generated) > 1 and stats.decode_ms > 0:
            stats.decode_tokens_per_s = (len(generated) - 1) / (stats.decode_ms / 1000)
        text = stop.text if stop is not None else ""
        return Result(text, generated, finish, usage, stats, first_logits)

    # --- pieces --------------------------------------------------------------------------------
    # Every touch of the live caches runs in inference mode, entered per call: a generator must
    # not leave the mode switched on in its caller's thread between yields.
    @torch.inference_mode()
    def _forward(self, ids: list[int], logits: str):
        out = self.model.step(torch.tensor(ids, device=self.device), self.caches, logits)
        self.live_tokens.extend(ids)
        return out

    @torch.inference_mode()
    def _reset_live(self) -> None:
        for c in self.caches:
            c.reset()
        self.live_tokens = []

    @torch.inference_mode()
    def _snapshot(self, logits: torch.Tensor | None) -> ModelSnapshot:
        return take_snapshot(self.caches, self.family, self.fingerprint, self.modes,
                             logits=None if logits is None else logits.detach().clone())

    def _restore(self, cache: PromptCache | None, ns: Namespace, prompt: list[int], stats: Stats):
        t0 = time.perf_counter()
        hit = cache.lookup(ns, prompt) if cache is not None else None
        if hit is None:
            self._reset_live()
            return 0, None
        try:
            with torch.inference_mode():
                restore_snapshot(self.caches, hit.snapshot, hit.usable, self.family, self.fingerprint, self.modes)
        except SnapshotMismatch as err:     # the store checks first; this is a last line of defence
            cache.record_refusal(err.reason)
            self._reset_live()
            return 0, None
        self.live_tokens = prompt[:hit.usable]
        stats.restore_ms = (time.perf_counter() - t0) * 1000
        stats.restored_origin, stats.restored_entry_length = hit.origin, hit.entry_length
        stats.reuse_from = "exact" if hit.use_logits else (
            "prefix" if hit.usable == hit.entry_length else "truncated")
        logits = hit.snapshot.logits.clone() if hit.use_logits else None
        return hit.usable, logits

    def _prefill(self, cache, ns, prompt: list[int], start: int, boundaries: list[int], stats: Stats):
        stops = checkpoint_positions(self.specs, boundaries, start, len(prompt)) if cache is not None else []
        stops = sorted(set(p for p in stops if start < p < len(prompt)))
        pos, logits = start, None
        segment_ends = stops + [len(prompt)]
        for end in segment_ends:
            while pos < end:
                n = min(self.prefill_chunk, end - pos)
                last = pos + n == len(prompt)
                logits = self._forward(prompt[pos:pos + n], "last" if last else "none")
                pos += n
            if cache is not None and end < len(prompt):
                cache.insert(ns, prompt[:end], self._snapshot(None), origin="checkpoint")
                stats.checkpoints += 1
        return logits
