"""The engine: many sequences at a time, one model forward per step.

``submit`` queues a request (thread-safe) and returns its Sequence; ``step`` admits waiting
sequences into state slots (restoring what the prompt cache holds for them), runs one batch of
every decoding sequence's next token plus prefill chunks (engine/scheduler.py), samples, and sends
each sequence its events. The server runs ``run`` on one thread; the CLI and tests use ``stream``
and ``generate``, which drive ``step`` themselves (one thread at a time: the engine is not
re-entrant).

Reuse has one owner, ``ReusePolicy`` (prompt_cache/policy.py): begin (lookup + restore) on
admission, checkpoints between prefill chunks, the prompt-end snapshot after the first token is
out (not in TTFT), and the end-of-generation snapshot when a sequence ends, cancelled or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from ..cache.storage import NATIVE
from ..cache.slots import StateIdentity, StatePool, common_prefix
from ..cache.sliding import DEFAULT_SLACK
from ..cache.specs import CacheSpec, default_modes
from ..images import (DEFAULT_IMAGE_CACHE_MB, DEFAULT_MAX_IMAGE_PIXELS, EncoderCache, decode_image, image_ids_in,
                      is_key, last_image_end, parse_data_url, split_key,
                      whole_images)
from ..models.batch import LAST, Batch
from ..prompt_cache.policy import ReusePolicy
from ..prompt_cache.store import Namespace, PromptCache
from .scheduler import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_SEQS, QueueFull, Scheduler, Work
from .sequence import (DECODE, FINISHED, PREFILL, Failure, GenerationRequest, Result, Sequence, Stats,
                       TokenEvent, Usage)

DEFAULT_PREFILL_CHUNK = 512
BOUNDARY_MESSAGES = 16       # message ends found per chat request (tokenizer.render_chat)
SHARE_MIN_TOKENS = 64        # a common prefix worth waiting for another sequence to compute
log = logging.getLogger("turnkv.engine")

__all__ = ["Engine", "GenerationRequest", "Result", "TokenEvent", "Usage", "Stats", "Failure", "QueueFull",
           "ContextLengthError", "DEFAULT_PREFILL_CHUNK"]


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context."""


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
                 image_cache_mb: float = DEFAULT_IMAGE_CACHE_MB, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.model, self.tokenizer = model, tokenizer
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
        self.reuse = ReusePolicy(prompt_cache, self.specs, self.dtype, slack, self.identity)
        self.scheduler = Scheduler(max_seqs, max_batch_tokens, max_queue, self.prefill_chunk,
                                   getattr(model, "bidirectional_images", False))
        self._inbox: deque[Sequence] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.steps = 0

    def _state_pool(self, max_seqs: int) -> StatePool:
        """The live state's slots, their block pools' address space sized for ``max_seqs``
        sequences of ``max_context`` tokens and the prompt cache's budget (cache/slots.py)."""
        budget = self.prompt_cache.budget_bytes if self.prompt_cache is not None else 0
        return StatePool(self.specs, self.identity, self.dtype, self.device, self.slack, max_seqs,
                         max_context=self.max_context, chunk=self.prefill_chunk, cache_bytes=budget)

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def load(cls, model: str, *, dtype: torch.dtype = torch.float32, weights: str | None = "native",
             progress: bool = True, **kw) -> "Engine":
        """``weights``: a weight format of models/weights.py (packed formats quantize from the
        float32 checkpoint tensors, whatever the compute dtype; ``gguf`` keeps the GGUF's own
        quantized blocks), or None for the default: ``gguf`` for a GGUF model (stored quantized) of a
        family with packable weights when the native kernels are built, else ``native``
        (``models.weights.default_format``)."""
        from ..kernels.attention import numerics_tag
        from ..loading import gguf_runs_quantized, gguf_type_summary, load_checkpoint, source_kind
        from ..models import family_class
        from ..models.weights import GGUF_FORMAT, check_format, default_format, load_model

        if weights is None:
            kind, arch = source_kind(model)
            weights = "native"
            if kind == "gguf" and gguf_runs_quantized(model):     # a float-stored GGUF runs native
                weights = default_format(kind, family_class(arch))
        check_format(weights)    # before the load; load_model checks the family can hold it
        ckpt = load_checkpoint(model, dtype=dtype if weights == "native" else torch.float32, progress=progress,
                               keep_quantized=weights == GGUF_FORMAT)
        net = load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, dtype, weights,
                         progress=progress, quantized=ckpt.quantized)
        net.eval()
        if weights == GGUF_FORMAT:      # the banner's per-type kernel line (launch.py)
            net.gguf_types = gguf_type_summary(model, ckpt.quantized)
        if hasattr(net, "load_processor"):     # vision families: the folder's image preprocessing
            net.load_processor(ckpt.source)
        if kw.get("max_context") is None:
            kw["max_context"] = int(ckpt.config.get("max_position_embeddings") or 8192)
        # packed weights compute different (close) logits: their snapshots are another namespace
        fingerprint = ckpt.fingerprint if weights == "native" else f"{ckpt.fingerprint}+w:{weights}"
        # ... and another build's or CPU kind's kernels compute other bits: their tier entries are other names
        fingerprint = f"{fingerprint}+k:{numerics_tag()}"
        if kw.get("kv_mode") == AUTO_KV:
            kw["kv_mode"] = auto_kv_mode(weights, dtype)
        return cls(net, ckpt.tokenizer, fingerprint=fingerprint, name=ckpt.name, weights=weights, **kw)

    def namespace(self, tenant: str = "", owner: str = "") -> Namespace:
        return self.reuse.namespace(tenant, owner)

    def describe_layers(self) -> str:
        counts: dict[str, int] = {}
        for spec in self.specs:
            counts[spec.describe()] = counts.get(spec.describe(), 0) + 1
        return ", ".join(f"{n} x {kind}" for kind, n in counts.items())

    # --- requests -----------------------------------------------------------------------------
    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer: send the prompt as token ids "
                             f"(/v1/completions with a list of integers)")

    def chat_request(self, messages: list[dict], params=None, tenant: str = "", *, tools: list | None = None,
                     template_kwargs: dict | None = None) -> GenerationRequest:
        from .sampling import SamplingParams
        self._need_tokenizer()
        if self.encoder_cache is not None:
            return self._vision_chat_request(messages, params, tenant, tools, template_kwargs)
        t0 = time.perf_counter()
        # boundaries only serve checkpoints, which only families that cannot truncate take
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True,
                                              boundary_messages=0 if self.reuse.trimmable else BOUNDARY_MESSAGES,
                                              tools=tools, template_kwargs=template_kwargs)
        return GenerationRequest(list(rendered.ids), params or SamplingParams(), list(rendered.boundaries), tenant,
                                 render_ms=(time.perf_counter() - t0) * 1000 - rendered.tokenize_ms,
                                 tokenize_ms=rendered.tokenize_ms)

    def _vision_chat_request(self, messages, params, tenant, tools, template_kwargs) -> GenerationRequest:
        """A chat for a vision family (docs/images.md): the template renders each image as the
        family's image marker, which expands as transformers' processor expands it; the expansion's
        placeholder tokens become the image's keys. ValueError (400) for a bad image."""
        from ..loading.tokenizer import normalize_vision_messages
        from .sampling import SamplingParams
        t0 = time.perf_counter()
        msgs, urls = normalize_vision_messages(messages)
        images = [self.model.prepare_image(decode_image(parse_data_url(u), self.max_image_pixels)) for u in urls]
        text = self.tokenizer.render_text(msgs, True, tools, template_kwargs)
        marker = self.model.image_marker
        prompts = [self.model.image_prompt(im) for im in images]

        def expand(rendered: str) -> str:   # the first markers are the first images (order of appearance)
            pieces = rendered.split(marker)
            if len(pieces) - 1 > len(prompts):
                raise ValueError(f"the chat renders {len(pieces) - 1} image markers {marker} for {len(images)} "
                                 f"images (message text must not contain {marker})")
            return pieces[0] + "".join(p + rest for p, rest in zip(prompts, pieces[1:]))

        if text.count(marker) != len(images):
            raise ValueError(f"the chat renders {text.count(marker)} image markers {marker} for {len(images)} images "
                             f"(message text must not contain {marker})")
        # message boundaries (checkpoints) only for families that cannot truncate, as for text chats
        rendered = self.tokenizer.tokenize_chat(msgs, expand(text), 0 if self.reuse.trimmable else BOUNDARY_MESSAGES,
                                                tools, template_kwargs, expand=expand)
        ids = list(rendered.ids)
        keys = [k for im in images for k in im.keys()]
        placeholder = self.model.image_token_id
        if sum(1 for t in ids if t == placeholder) != len(keys):
            raise ValueError("the prompt's image tokens do not match its images (message text must not contain "
                             "the model's image tokens)")
        it = iter(keys)
        ids = [next(it) if t == placeholder else t for t in ids]
        return GenerationRequest(ids, params or SamplingParams(), list(rendered.boundaries), tenant,
                                 images={im.image_id: im for im in images},
                                 render_ms=(time.perf_counter() - t0) * 1000 - rendered.tokenize_ms,
                                 tokenize_ms=rendered.tokenize_ms)

    def text_request(self, text: str, params=None, tenant: str = "") -> GenerationRequest:
        from .sampling import SamplingParams
        self._need_tokenizer()
        t0 = time.perf_counter()
        ids = self.tokenizer.encode(text)
        return GenerationRequest(ids, params or SamplingParams(), [], tenant, tokenize_ms=(time.perf_counter() - t0) * 1000)

    def check_request(self, req: GenerationRequest) -> None:
        req.params.validate(self.model.vocab_size)
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context is {self.max_context} tokens "
                f"(at least one token must be generated)")
        vocab = self.model.vocab_size
        bad = next((t for t in req.prompt_ids if not 0 <= int(t) < vocab and not is_key(int(t))), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        self._check_images(req)

    def _check_images(self, req: GenerationRequest) -> None:
        """Image keys (turnkv/images.py) only for images the request carries, rows they have."""
        keys = [int(t) for t in req.prompt_ids if is_key(int(t))]
        if not keys and not req.images:
            return
        if self.encoder_cache is None:
            raise ValueError(f"model {self.name} does not take images")
        for t in keys:
            image_id, k = split_key(t)
            image = req.images.get(image_id)
            if image is None or k >= image.n_rows:
                raise ValueError("the prompt has an image placeholder for an image the request does not carry")
        if getattr(self.model, "bidirectional_images", False) and not whole_images(req.prompt_ids, req.images):
            raise ValueError("each image's placeholders must appear whole and in order (the model's image tokens "
                             "attend to each other both ways)")

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
        # n > 1: choices 1..n-1 fork from the leader's state once it holds the prompt (_release_forks)
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

    # --- driving it -----------------------------------------------------------------------------
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
        """The server's engine loop: step while there is work, sleep until a submit otherwise;
        returns once ``stop`` (or ``also``) is set."""
        while not stop.is_set() and not (also is not None and also.is_set()):
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, run one batch, sample, emit. False when there was nothing to do."""
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
        acted = self._reap_cancelled()
        for seq in self.scheduler.admissible():
            acted = True
            self._admit(seq)
        for seq in self.scheduler.running:
            if seq.follow is not None and (seq.follow[0].pos >= seq.follow[1] or seq.follow[0].done):
                seq.follow = None          # the leader stored the shared prefix (or ended): look again
                self._begin(seq)
        work = self.scheduler.plan()
        if not work:
            return acted
        self.steps += 1
        try:
            with torch.inference_mode():
                images = self._step_images(work) if self.encoder_cache is not None else None
                batch = Batch.build([(w.tokens, w.seq.state.caches, w.logits) for w in work], self.device, images)
                logits = self.model.forward(batch)
        except Exception as err:  # noqa: BLE001 - fail this batch's sequences, keep serving
            log.exception("a model step failed")
            for w in work:
                self._fail(w.seq, err)
            return True
        row = 0
        for w in work:
            out = None
            if w.logits == LAST:
                out = logits[row]
                row += 1
            try:
                self._advance(w, out)
            except Exception as err:  # noqa: BLE001
                log.exception("a sequence failed after its step")
                self._fail(w.seq, err)
        return True

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
        seq.t_admit = time.perf_counter()
        seq.stats.queue_ms = (seq.t_admit - seq.t_submit) * 1000
        try:
            seq.state = self.pool.acquire(seq.prompt)
        except Exception as err:  # noqa: BLE001
            log.exception("admitting a sequence failed")
            self._fail(seq, err)
            return
        if seq.fork_from is not None:
            self._begin_fork(seq)
        else:
            self._begin(seq, share=True)

    def _begin(self, seq: Sequence, share: bool = False) -> None:
        """Restore what the prompt cache holds for the prompt; with ``share``, wait instead for a
        sequence running now that is about to compute a longer common prefix."""
        try:
            restored = self.reuse.begin(seq.state, seq.ns, seq.prompt)
        except Exception as err:  # noqa: BLE001
            log.exception("restoring a sequence's state failed")
            self._fail(seq, err)
            return
        s = seq.stats
        s.lookup_ms, s.restore_ms, s.reuse_from = restored.lookup_ms, restored.restore_ms, restored.reuse_from
        s.restored_origin, s.restored_entry_length = restored.origin, restored.entry_length
        seq.usage.cached_tokens = seq.pos = restored.cached
        # and right after the prompt's last image: an edit of the text after it restores from there
        seq.stops = self.reuse.checkpoints(seq.req.boundaries, seq.pos, len(seq.prompt),
                                           last_image_end(seq.prompt) if seq.req.images else 0)
        seq.status = PREFILL
        if restored.logits is not None:        # the whole prompt was stored with its logits
            self._prompt_done(seq)
            self._release_forks(seq, restored.logits)
            if seq.take(restored.logits):
                self._finish(seq)
        elif share:
            self._follow(seq)

    def _follow(self, seq: Sequence) -> None:
        """Two requests with one long common prefix (a shared system prompt) at the same time:
        the later waits while the earlier prefills that prefix, which then checkpoints exactly at
        its end (the prompt cache stores it), and the later restores it instead of computing it
        again."""
        if not self.reuse.active:
            return
        best, best_len = None, seq.pos + SHARE_MIN_TOKENS - 1
        for other in self.scheduler.running:
            if other is seq or other.follow is not None or other.ns != seq.ns or other.status != PREFILL:
                continue
            n = common_prefix(other.prompt, seq.prompt)
            if n > best_len and other.pos < n:
                best, best_len = other, n
        if best is None:
            return
        if best.pos < best_len and best_len not in best.stops:
            best.stops = sorted(best.stops + [best_len])
        seq.follow = (best, best_len)

    def _prompt_done(self, seq: Sequence) -> None:
        seq.status = DECODE
        seq.stats.prefilled_tokens = len(seq.prompt) - seq.usage.cached_tokens
        seq.stats.prefill_ms = (time.perf_counter() - seq.t_admit) * 1000
        self.reuse.record_prefill(seq.stats.prefilled_tokens, seq.ns.owner)

    def _release_forks(self, seq: Sequence, logits: torch.Tensor) -> None:
        """n > 1: the leader's state holds the whole prompt; its other choices start from a snapshot
        of it (full-attention blocks are shared, not copied) and the same next-token logits, so the
        prompt is prefilled once. They go to the front of the queue and decode with the leader."""
        if not seq.forks:
            return
        point = (seq.state.snapshot(), logits)
        for fork in seq.forks:
            fork.fork_from = point
        with self._lock:
            self.scheduler.waiting.extendleft(reversed(seq.forks))
        seq.forks = []

    def _begin_fork(self, seq: Sequence) -> None:
        snap, logits = seq.fork_from
        seq.fork_from = None
        try:
            seq.state.restore(snap, len(seq.prompt), seq.prompt)
        except Exception as err:  # noqa: BLE001
            log.exception("forking a choice from the prompt state failed")
            self._fail(seq, err)
            return
        seq.pos = len(seq.prompt)
        seq.usage.cached_tokens = len(seq.prompt)     # per choice; the request's usage counts the leader's
        seq.stats.reuse_from = "fork"
        seq.status = DECODE
        seq.stats.prefill_ms = (time.perf_counter() - seq.t_admit) * 1000
        if seq.take(logits):
            self._finish(seq)

    def _advance(self, w: Work, logits: torch.Tensor | None) -> None:
        seq = w.seq
        seq.state.tokens.extend(w.tokens)
        if w.prefill:
            seq.pos += len(w.tokens)
            if seq.stops and seq.pos == seq.stops[0]:
                seq.stops.pop(0)
                self.reuse.checkpoint(seq.state, seq.ns)
                seq.stats.checkpoints += 1
            if seq.pos < len(seq.prompt):
                return
            self._prompt_done(seq)
            self._release_forks(seq, logits)
            seq.prompt_end_pending = self.reuse.wants_prompt_end
        finished = seq.take(logits)
        if seq.prompt_end_pending:      # after the first token is out, so not in TTFT
            seq.prompt_end_pending = False
            self.reuse.prompt_end(seq.state, seq.ns, seq.first_logits)
            seq.stats.checkpoints += 1
        if finished:
            self._finish(seq)

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
        state = seq.state
        if state is not None:
            try:
                # the last sampled token is not in the state; its logits are those of the state's end
                # when the state holds the whole prompt and every token but the last
                complete = seq.generated and state.length == len(seq.prompt) + len(seq.generated) - 1
                self.reuse.finish(state, seq.ns, seq.last_logits if complete else None)
            finally:
                self.pool.release(state)
        self.scheduler.remove(seq)
        seq.status = FINISHED
        seq.result = seq.build_result()
        seq.emit(seq.result)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        for fork in seq.forks:
            self._fail(fork, err)
        seq.forks = []
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
