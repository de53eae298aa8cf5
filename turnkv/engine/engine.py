"""The engine: many sequences at a time, one model forward per step.

``submit`` queues a request (thread-safe) and returns its Sequence; ``step`` admits waiting
sequences into state slots, runs one batch of every decoding sequence's next token plus prefill
chunks (engine/scheduler.py), samples, and sends each sequence its events. The server runs ``run``
on one thread; the CLI and tests drive ``step`` through ``stream`` and ``generate`` (not re-entrant).

Reuse has one owner, prompt_cache/plan.py: on admission ``Reuse.begin`` restores what the prompt
cache holds and gives the sequence its ``SeqPlan``, which the step asks where a prefill chunk must
end and which it tells when a chunk, the prompt, the first token and the sequence are done.
Building and checking requests is engine/requests.py; loading a model is loading/model.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from ..cache.storage import NATIVE
from ..cache.slots import StateIdentity, StatePool
from ..cache.sliding import DEFAULT_SLACK
from ..cache.specs import CacheSpec, default_modes
from ..images import DEFAULT_IMAGE_CACHE_MB, DEFAULT_MAX_IMAGE_PIXELS, EncoderCache, image_ids_in, last_image_end
from ..models.batch import Batch, split_logits
from ..prompt_cache.plan import Reuse
from ..prompt_cache.store import Namespace, PromptCache
from .drafters import DRAFTERS, OFF
from .requests import ContextLengthError, Requests, check_speculative
from .scheduler import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_SEQS, QueueFull, Scheduler, Work
from .mtp import feed_hidden, hidden_sink
from .spec_probe import blocked_reason, keep_trails
from .threads import engine_governor
from .speculative import CLOCK, DEFAULT_DRAFT_MAX, DraftLogits, SpecCounters, speculation_for, verify_draft
from .sequence import (DECODE, FINISHED, PREFILL, Failure, GenerationRequest, Result, Sequence, Stats,
                       TokenEvent, Usage)

DEFAULT_PREFILL_CHUNK = 512
log = logging.getLogger("turnkv.engine")

__all__ = ["Engine", "GenerationRequest", "Result", "TokenEvent", "Usage", "Stats", "Failure", "QueueFull",
           "ContextLengthError", "DEFAULT_PREFILL_CHUNK"]

AUTO_KV = "auto"


def auto_kv_mode(weights: str, dtype: torch.dtype) -> str:
    """``--kv-cache-mode auto``: float16 KV under the ``gguf`` weights at float32 compute (the
    half-precision KV llama.cpp keeps too: NLL +0.0000 nats/token on both bundled models, half the
    bytes per cached token, and the attention kernel reads it as stored, which decodes faster;
    the gguf path is batch- and chunk-invariant, so reuse stays bit-identical to cold); the
    compute dtype (``native``) otherwise, the exactness reference."""
    from ..models.weights import GGUF_FORMAT

    return "fp16" if weights == GGUF_FORMAT and dtype == torch.float32 else NATIVE


class Engine:
    def __init__(self, model, tokenizer=None, *, fingerprint: str = "", name: str = "",
                 device="cpu", prompt_cache: PromptCache | None = None, slack: int = DEFAULT_SLACK,
                 kv_mode: str = NATIVE, kv_boundary_layers: int = 0,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_context: int | None = None,
                 weights: str = "native", max_seqs: int = DEFAULT_MAX_SEQS,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE,
                 image_cache_mb: float = DEFAULT_IMAGE_CACHE_MB, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 speculative: str = OFF, draft_max: int = DEFAULT_DRAFT_MAX, adaptive_threads: bool = False):
        check_speculative(model, speculative, draft_max)     # and mtp on a model without the block
        self.speculative, self.draft_max = speculative, draft_max   # defaults; a request may override
        self.spec = SpecCounters()
        self.drafters = dict(DRAFTERS)
        self._spec_block: str | None = None     # why no draft can be verified here ("" once probed fine)
        self.idle_check = None      # auto (launch.py): when its check may run idle; plain decoding until it has
        self.model = model
        self.max_image_pixels = int(max_image_pixels)
        # vision families: image embeddings by content hash (docs/images.md); None for text-only models
        self.encoder_cache = (EncoderCache(int(image_cache_mb * 1024 * 1024))
                              if hasattr(model, "encode_image") else None)
        self.name = name or model.family
        self.family, self.fingerprint = model.family, fingerprint or model.family
        self.dtype, self.device = model.dtype, torch.device(device)
        self.specs: list[CacheSpec] = model.cache_specs()
        self.modes = tuple(default_modes(self.specs, kv_mode, kv_boundary_layers))
        self.kv_mode, self.slack = kv_mode, slack
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.max_context = max_context or int(getattr(model.args, "max_position_embeddings", 0) or 8192)
        self.prompt_cache = prompt_cache
        self.weights = weights    # the weight format the model was loaded in (models/weights.py)
        self.identity = StateIdentity(self.family, self.fingerprint, self.modes)
        self.pool = self._state_pool(max_seqs)
        self.reuse = Reuse(prompt_cache, self.specs, self.dtype, slack, self.identity)
        # message boundaries only serve checkpoints, which only families that cannot truncate take
        self.requests = Requests(model, tokenizer, self.name, self.max_context, not self.reuse.trimmable,
                                 self.max_image_pixels)
        self.scheduler = Scheduler(max_seqs, max_batch_tokens, max_queue, self.prefill_chunk,
                                   getattr(model, "bidirectional_images", False))
        self._inbox: deque[Sequence] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.steps = 0
        self.threads = engine_governor(self, adaptive_threads)   # the thread count following the load, or None

    def _state_pool(self, max_seqs: int) -> StatePool:
        """The live state's slots, their block pools' address space sized for ``max_seqs``
        sequences of ``max_context`` tokens and the prompt cache's budget (cache/slots.py)."""
        budget = self.prompt_cache.budget_bytes if self.prompt_cache is not None else 0
        return StatePool(self.specs, self.identity, self.dtype, self.device, self.slack, max_seqs,
                         max_context=self.max_context, chunk=self.prefill_chunk, cache_bytes=budget)

    @classmethod
    def load(cls, model: str, *, dtype: torch.dtype = torch.float32, weights: str | None = "native",
             progress: bool = True, mmproj=None, **kw) -> "Engine":
        """An engine on a bundled name, .gguf file or HF folder (loading/model.py: ``weights``
        None picks the format the file runs best in; ``mmproj`` the vision projector of a text
        GGUF, None finds a sibling ``mmproj*.gguf``, False none)."""
        from ..loading.model import load_model

        loaded = load_model(model, dtype, weights, progress, mmproj)
        if kw.get("max_context") is None:
            kw["max_context"] = loaded.max_context
        if kw.get("kv_mode") == AUTO_KV:
            kw["kv_mode"] = auto_kv_mode(loaded.weights, dtype)
        return cls(loaded.net, loaded.tokenizer, fingerprint=loaded.fingerprint, name=loaded.name,
                   weights=loaded.weights, **kw)

    @property
    def tokenizer(self):
        return self.requests.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:      # a --chat-template given at start-up (launch.py)
        self.requests.tokenizer = tokenizer

    def namespace(self, tenant: str = "", owner: str = "") -> Namespace:
        return self.reuse.namespace(tenant, owner)

    def describe_layers(self) -> str:
        counts: dict[str, int] = {}
        for spec in self.specs:
            counts[spec.describe()] = counts.get(spec.describe(), 0) + 1
        return ", ".join(f"{n} x {kind}" for kind, n in counts.items())

    # --- requests (engine/requests.py) --------------------------------------------------------
    def chat_request(self, messages: list[dict], params=None, tenant: str = "", *, tools: list | None = None,
                     template_kwargs: dict | None = None) -> GenerationRequest:
        return self.requests.chat(messages, params, tenant, tools=tools, template_kwargs=template_kwargs)

    def text_request(self, text: str, params=None, tenant: str = "") -> GenerationRequest:
        return self.requests.text(text, params, tenant)

    def check_request(self, req: GenerationRequest) -> None:
        self.requests.check(req)

    def submit(self, req: GenerationRequest, sink: Callable[[object], None]) -> Sequence:
        """Queue a request (any thread). ``sink`` receives a TokenEvent per token, then the Result
        (or a Failure); it is called on the engine's thread and must not block. Raises ValueError
        for a bad request and QueueFull when the queue is full."""
        self.check_request(req)
        eos = set(req.stop_token_ids) | set(req.params.stop_token_ids)
        if not req.params.ignore_eos and self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        budget = min(req.params.max_tokens, self.max_context - len(req.prompt_ids))
        ns = self.namespace(req.tenant, req.owner)
        seq = Sequence(req, ns, self.tokenizer, eos, budget, sink)
        # n > 1: choices 1..n-1 fork from the leader's state once it holds the prompt (_prompt_done)
        seq.forks = [Sequence(req, ns, self.tokenizer, eos, budget, sink, index=i) for i in range(1, req.params.n)]
        with self._lock:
            waiting = len(self._inbox) + len(self.scheduler.waiting) + len(seq.forks)
            free = self.scheduler.max_seqs - len(self.scheduler.running)
            if waiting >= self.scheduler.max_queue + max(0, free):
                raise QueueFull(f"the server is busy: {waiting} requests are waiting (--max-queue "
                                f"{self.scheduler.max_queue})")
            self._inbox.append(seq)
        self._wake.set()
        return seq

    def pending(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return len(self._inbox) + len(self.scheduler.waiting) + len(self.scheduler.running)

    def stream(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        """Yield a TokenEvent per generated token; the generator's return value is the Result.
        Closing the generator early cancels the request (its state is stored as usual). One choice
        only: ``generate_choices`` runs a request with n > 1."""
        if req.params.n != 1:
            raise ValueError("stream() runs one choice: use generate_choices() for n > 1")
        events: deque = deque()
        seq = self.submit(req, events.append)
        try:
            while True:
                while events:
                    item = events.popleft()
                    if isinstance(item, TokenEvent):
                        yield item
                    elif isinstance(item, Result):
                        return item
                    elif isinstance(item, Failure):
                        raise item.error
                if not self.step() and not events:
                    raise RuntimeError("the engine has no work but the request has not ended")
        finally:
            if not seq.done:
                seq.cancel()
                self.step()        # the cancel takes effect now: state stored, slot released

    def generate(self, req: GenerationRequest) -> Result:
        gen = self.stream(req)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    def generate_choices(self, req: GenerationRequest) -> list[Result]:
        """All n choices of a request (in index order), driving ``step`` until each has ended."""
        results: dict[int, Result] = {}
        failures: list[BaseException] = []

        def sink(item) -> None:
            if isinstance(item, Result):
                results[item.index] = item
            elif isinstance(item, Failure):
                failures.append(item.error)

        seq = self.submit(req, sink)
        try:
            while len(results) < req.params.n and not failures:
                if not self.step():
                    raise RuntimeError("the engine has no work but the request has not ended")
        finally:
            if len(results) < req.params.n:
                seq.cancel()
                self.step()
        if failures:
            raise failures[0]
        return [results[i] for i in range(req.params.n)]

    def run(self, stop: threading.Event, also: threading.Event | None = None) -> None:
        """The server's engine loop: step while there is work, else sleep until a submit; until ``stop`` / ``also``."""
        while not stop.is_set() and not (also is not None and also.is_set()):
            if not self.step():
                if self.idle_check and self.idle_check():     # auto's check, in an idle moment
                    self.speculation_blocked()
                if self.threads is not None:      # the next thread count's probe, in an idle moment
                    self.threads.idle()
                self._wake.wait(0.05)
                self._wake.clear()

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, plan, run one batch, advance every sequence in it. False when there was nothing to do."""
        acted = self._admit_waiting()
        work = self.scheduler.plan()
        if not work:
            return acted
        self.steps += 1
        w0 = self.threads.before_step() if self.threads is not None else 0.0
        t0 = CLOCK()       # the step costs drafts go by: CPU time, a busy core's waits left out
        try:
            logits = self._forward(work)
        except Exception as err:  # noqa: BLE001 - fail this batch's sequences, keep serving
            log.exception("a model step failed")
            for w in work:
                self._fail(w.seq, err)
            return True
        outs = self._logits_of(work, logits)
        model_s = CLOCK() - t0
        on_trial = self.threads is not None and self.threads.after_step(work, w0, self.spec.costs)
        for w, out in zip(work, outs):
            try:
                self._advance(w, out)
            except Exception as err:  # noqa: BLE001
                log.exception("a sequence failed after its step")
                self._fail(w.seq, err)
        if not on_trial:
            self.spec.costs.observe_step(work, outs, model_s)      # what drafts cost here (docs/speculative.md)
        return True

    def _admit_waiting(self) -> bool:
        """New requests queued, ended ones reaped, waiting ones admitted while slots are free,
        followers whose leader got there restarted."""
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
        acted = self._reap_cancelled()
        for seq in self.scheduler.admissible():
            acted = True
            self._admit(seq)
        for seq in list(self.scheduler.running):     # a restart may end a sequence (an exact hit)
            if seq.plan is not None and seq.plan.follow_ready():      # the leader stored the shared prefix
                self._start(seq, lambda s=seq: self.reuse.restart(s.plan, s.state))
        return acted

    def _forward(self, work: list[Work]) -> torch.Tensor | None:
        """One model forward over the step's tokens: the next-token logits of each LAST row."""
        with torch.inference_mode():
            images = self._step_images(work) if self.encoder_cache is not None else None
            for w in work:
                if w.draft:     # its recurrent layers keep every token's state: verification picks one back
                    keep_trails(w.seq.state.caches)
            # with a draft in the step the head waits: verification asks for the rows it needs
            batch = Batch.build([(w.tokens, w.seq.state.caches, w.logits) for w in work], self.device, images,
                                head=not any(w.draft for w in work), hidden=hidden_sink(self, work))
            out = self.model.forward(batch)
            feed_hidden(self, work, batch)       # the MTP drafters' input (engine/mtp.py)
            return out

    def _logits_of(self, work: list[Work], out: torch.Tensor | None) -> list:
        """Each work's logits from the forward's rows. When the step deferred the head (a draft
        in it), the rows without a draft get theirs in one head call, and each draft's rows come
        as ``DraftLogits``, computed as verification reaches them."""
        parts = split_logits(out, [(w.logits, len(w.tokens)) for w in work])
        if not any(w.draft for w in work):
            return parts
        with torch.inference_mode():
            plain = [i for i, w in enumerate(work) if not w.draft and parts[i] is not None]
            if plain:
                for i, row in zip(plain, self.model.head(torch.stack([parts[i] for i in plain]))):
                    parts[i] = row
        return [DraftLogits(self.model.head, parts[i], w.seq.spec) if w.draft else parts[i]
                for i, w in enumerate(work)]

    def _step_images(self, work: list[Work]) -> dict | None:
        """Embeddings of the images whose keys this step prefills: the sequence's own (already
        fetched), else the encoder cache's, else encoded now. An image inside a restored prefix
        is never looked at."""
        out: dict = {}
        for w in work:
            if not w.prefill or not w.seq.req.images:
                continue
            for image_id in image_ids_in(w.tokens):
                emb = w.seq.image_embeds.get(image_id)
                if emb is None:
                    emb = self.encoder_cache.get_or_encode(w.seq.req.images[image_id], self.model.encode_image,
                                                           w.seq.ns.tenant)
                    w.seq.image_embeds[image_id] = emb
                out[image_id] = emb
        return out or None

    def _admit(self, seq: Sequence) -> None:
        """A state slot, then the reuse plan: a fork restores its leader's prompt state, any other
        sequence what the prompt cache holds (or it follows a sequence computing its prefix)."""
        seq.t_admit = time.perf_counter()
        seq.stats.queue_ms = (seq.t_admit - seq.t_submit) * 1000
        try:
            seq.state = self.pool.acquire(seq.prompt)
        except Exception as err:  # noqa: BLE001
            log.exception("admitting a sequence failed")
            self._fail(seq, err)
            return
        if seq.fork_from is not None:
            point, seq.fork_from = seq.fork_from, None
            self._start(seq, lambda: self.reuse.fork(seq.state, seq.ns, seq.prompt, point))
            return
        media_end = last_image_end(seq.prompt) if seq.req.images else 0
        others = [s.plan for s in self.scheduler.running if s.plan is not None]
        self._start(seq, lambda: self.reuse.begin(seq.state, seq.ns, seq.prompt, seq.req.boundaries, media_end,
                                                  others))

    def _start(self, seq: Sequence, restore: Callable) -> None:
        """``restore()`` gives the sequence its reuse plan; then it prefills what is left, or
        samples at once from restored logits (an exact hit, or a fork's leader's)."""
        try:
            seq.plan = restore()
        except Exception as err:  # noqa: BLE001
            log.exception("restoring a sequence's state failed")
            self._fail(seq, err)
            return
        seq.note_restored(seq.plan.restored)
        seq.status = PREFILL
        if seq.plan.restored.logits is not None:
            self._prompt_done(seq, seq.plan.restored.logits, computed=False)
            if seq.take(seq.plan.restored.logits):
                self._finish(seq)

    def _prompt_done(self, seq: Sequence, logits: torch.Tensor, computed: bool) -> None:
        """The state holds the prompt. n > 1: the other choices start from its snapshot and these
        logits (the prompt is prefilled once); they go to the front of the queue."""
        seq.status = DECODE
        seq.spec = speculation_for(self, seq)
        seq.stats.prefilled_tokens = len(seq.prompt) - seq.usage.cached_tokens
        seq.stats.prefill_ms = (time.perf_counter() - seq.t_admit) * 1000
        seq.plan.prompt_done(computed)
        if seq.forks:
            point = seq.plan.fork_point(seq.state, logits)
            for fork in seq.forks:
                fork.fork_from = point
            with self._lock:
                self.scheduler.waiting.extendleft(reversed(seq.forks))
            seq.forks = []

    def _advance(self, w: Work, logits: torch.Tensor | None) -> None:
        seq = w.seq
        seq.state.tokens.extend(w.tokens)
        if w.prefill:
            seq.plan.after_chunk(seq.state, len(w.tokens))
            if seq.pos < len(seq.prompt):
                return
            self._prompt_done(seq, logits, computed=True)
        finished = verify_draft(seq, w.tokens, logits, self.spec) if w.draft else seq.take(logits)
        seq.plan.after_token(seq.state, seq.first_logits)   # after the first token is out, so not in TTFT
        if finished:
            self._finish(seq)

    def speculation_blocked(self) -> str:
        """Why no draft can be verified exactly here ("" when drafts can be): a state that cannot be cut back,
        or a forward the probe found not chunk-invariant (once, on the engine's thread; ``idle_check``: idle)."""
        if self._spec_block is None:
            self._spec_block = blocked_reason(self.model, self.specs, self.dtype, self.device, self.modes, self.slack)
            if self._spec_block:
                log.warning("speculative decoding is off for this model: %s (docs/speculative.md)", self._spec_block)
        return self._spec_block

    def _reap_cancelled(self) -> bool:
        """End sequences cancelled (client gone) or past their deadline; what they computed is stored."""
        now = time.perf_counter()
        gone = [(s, why) for s in list(self.scheduler.waiting) + self.scheduler.running
                if (why := s.ended_early(now)) is not None]
        for seq, why in gone:
            seq.finish_reason = why
            self._finish(seq)
        return bool(gone)

    def _finish(self, seq: Sequence) -> None:
        """Store the end-of-generation state, free the slot, send the Result."""
        for fork in seq.forks:          # choices never forked: the leader ended before its prompt did
            fork.finish_reason = seq.finish_reason
            self._finish(fork)
        seq.forks = []
        if seq.state is not None:
            try:
                if seq.plan is not None:
                    seq.plan.finish(seq.state, len(seq.generated), seq.last_logits)
            finally:
                self.pool.release(seq.state)
        self.scheduler.remove(seq)
        seq.status = FINISHED
        seq.result = seq.build_result()
        seq.emit(seq.result)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        for fork in seq.forks:
            self._fail(fork, err)
        seq.forks = []
        if seq.plan is not None:
            seq.plan.end()
        if seq.state is not None:
            seq.state.reset()          # a step that raised may have advanced some layers only
            self.pool.release(seq.state)
            seq.state = None
        self.scheduler.remove(seq)
        seq.status = FINISHED
        seq.emit(Failure(err))

    def abort_all(self, err: BaseException) -> int:
        """After the step loop itself raised: every request ends with a Failure and the engine
        starts again from fresh state slots (a half-run step may have left any slot or the
        scheduler inconsistent). The prompt cache is kept: its entries are immutable snapshots.
        Returns how many requests were failed."""
        with self._lock:
            seqs = list(self._inbox)
            self._inbox.clear()
        seqs += [s for s in list(self.scheduler.waiting) + list(self.scheduler.running) if s not in seqs]
        old = self.scheduler
        self.scheduler = Scheduler(old.max_seqs, old.max_batch_tokens, old.max_queue, self.prefill_chunk,
                                   old.whole_images)
        self.pool = self._state_pool(old.max_seqs)
        for seq in seqs:
            seq.state = None
            seq.status = FINISHED
            try:
                seq.emit(Failure(err))
            except Exception:  # noqa: BLE001 - a sink must not stop the others from hearing
                log.exception("a request's sink failed while the engine restarted")
        return len(seqs)

    # --- introspection ---------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self.pool.live_bytes

    def kv_usage(self) -> float:
        """The share of the live KV capacity (``--max-seqs`` full contexts) that running sequences
        hold; blocks only the prompt cache or an idle slot holds are reusable room, as a cached
        free block is in vLLM's ``kv_cache_usage_perc``. 0 for a model without attention layers."""
        states = [seq.state for seq in list(self.scheduler.running) if seq.state is not None]
        capacity = self.pool.kv_capacity_bytes(self.max_context, self.prefill_chunk)
        return min(1.0, self.pool.kv_bytes(states) / capacity) if capacity else 0.0
