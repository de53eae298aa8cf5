"""The engine worker: one thread runs the engine's step loop; every request is a sequence in it.

The HTTP layer (asyncio) and the engine thread meet only here: ``submit`` queues a request with
the engine (thread-safe; QueueFull when the queue is full), the engine sends each event to the
job's sink, which crosses to the event loop through ``loop.call_soon_threadsafe``, and a cancel
crosses back through the sequence's flag, which the engine checks at every step (also in the
middle of a prefill). The prompt cache is thread-safe (its own lock), so stats and flushes are
served from the HTTP side without waiting for the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.engine import GenerationRequest, Result, TokenEvent
from ..engine.sequence import Failure, Sequence

OK, CANCELLED, FAILED = "ok", "cancelled", "failed"
log = logging.getLogger("turnkv.server")


@dataclass
class Finished:
    result: Result
    queue_ms: float          # time between submit and the engine admitting the request


@dataclass
class Failed:
    error: BaseException


@dataclass
class Job:
    request: GenerationRequest
    endpoint: str
    loop: asyncio.AbstractEventLoop
    stream_tokens: bool                      # a non-streaming request needs only the end
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None

    def cancel(self) -> None:
        if self.seq is not None:
            self.seq.cancel()

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:      # the event loop is gone (server shutting down): nobody listens
            pass


@dataclass
class JobOutcome:
    """What the worker reports to the metrics hook once a job is over."""

    endpoint: str
    outcome: str                      # OK | CANCELLED | FAILED
    result: Result | None
    queue_s: float
    total_s: float                    # submit -> end, what the client waited


class EngineWorker:
    """Runs the engine loop on its own thread (``own_thread``) or on whichever thread calls
    ``run`` (``turnkv serve`` uses the main thread: see server/app.py ``serve``)."""

    def __init__(self, engine, on_done: Callable[[JobOutcome], None] | None = None, own_thread: bool = True):
        self.engine = engine
        self.on_done = on_done or (lambda outcome: None)
        self._stop = threading.Event()
        self._running = False
        self._thread = (threading.Thread(target=self.run, args=(self._stop,), name="turnkv-engine", daemon=True)
                        if own_thread else None)

    # --- called from the HTTP side -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._running

    def pending(self) -> int:
        """Requests waiting or running."""
        return self.engine.pending()

    def submit(self, request: GenerationRequest, endpoint: str, stream_tokens: bool = True) -> Job:
        """Raises QueueFull (-> 429) and ValueError (-> 400) at once."""
        job = Job(request, endpoint, asyncio.get_running_loop(), stream_tokens)
        job.seq = self.engine.submit(request, lambda item: self._on_event(job, item))
        return job

    # --- the engine thread -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """The engine loop until ``stop`` (or ``stop()``) is set."""
        self._running = True
        try:
            while not (stop.is_set() or self._stop.is_set()):
                self.engine.run(stop, also=self._stop)
        except BaseException:  # noqa: BLE001 - /health turns 503; log why
            log.exception("the engine loop died")
            raise
        finally:
            self._running = False

    def _on_event(self, job: Job, item) -> None:
        if isinstance(item, TokenEvent):
            if job.stream_tokens:
                job.post(item)
            return
        seq = job.seq
        queue_ms = seq.stats.queue_ms if seq is not None else 0.0
        if isinstance(item, Result):
            if item.finish_reason == "cancelled":
                self._report(job, CANCELLED, None, queue_ms)
                return
            self._report(job, OK, item, queue_ms)
            job.post(Finished(item, queue_ms))
        elif isinstance(item, Failure):
            self._report(job, FAILED, None, queue_ms)
            job.post(Failed(item.error))

    def _report(self, job: Job, outcome: str, result: Result | None, queue_ms: float) -> None:
        end = time.perf_counter()
        try:
            self.on_done(JobOutcome(job.endpoint, outcome, result, queue_ms / 1000, end - job.submitted))
        except Exception:   # noqa: BLE001 - metrics must never take the engine down
            log.exception("the job-outcome hook failed")
