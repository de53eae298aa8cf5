"""The engine worker: one thread owns the Engine; requests queue to it and run in order.

The HTTP layer (asyncio) and the worker (a plain thread) meet only here: a job's events cross to
the event loop through ``loop.call_soon_threadsafe`` and a cancel crosses back through a
``threading.Event`` the worker checks between tokens. A cancelled generation is stopped by closing
the engine's generator, which is the engine's documented way to cancel and keeps the prompt cache
consistent. The prompt cache itself is thread-safe (it has its own lock), so stats and flushes are
served from the HTTP side without waiting for the queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.generate import GenerationRequest, Result, TokenEvent

OK, CANCELLED, FAILED = "ok", "cancelled", "failed"
log = logging.getLogger("turnkv.server")


@dataclass
class Finished:
    result: Result
    queue_ms: float          # time between submit and the engine picking the job up


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
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

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
    def __init__(self, engine, on_done: Callable[[JobOutcome], None] | None = None):
        self.engine = engine
        self.on_done = on_done or (lambda outcome: None)
        self._queue: queue.Queue = queue.Queue()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="turnkv-engine", daemon=True)

    # --- called from the HTTP side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def pending(self) -> int:
        """Requests waiting or running."""
        return self._queue.qsize() + (1 if self._busy else 0)

    def submit(self, request: GenerationRequest, endpoint: str, stream_tokens: bool = True) -> Job:
        job = Job(request, endpoint, asyncio.get_running_loop(), stream_tokens)
        self._queue.put(job)
        return job

    # --- the worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._busy = True
            try:
                self._run_job(item)
            finally:
                self._busy = False

    def _run_job(self, job: Job) -> None:
        job.started = time.perf_counter()
        queue_s = job.started - job.submitted
        if job.cancelled.is_set():      # the client left while the job was queued
            self._report(job, CANCELLED, None)
            return
        try:
            result = self._generate(job)
        except Exception as err:   # noqa: BLE001 - one bad request must not stop the server
            if not isinstance(err, ValueError):
                log.exception("generation failed")
            self._report(job, FAILED, None)
            job.post(Failed(err))
            return
        if result is None:
            self._report(job, CANCELLED, None)
            return
        self._report(job, OK, result)
        job.post(Finished(result, queue_s * 1000))

    def _generate(self, job: Job) -> Result | None:
        """Drive the engine's generator; None when the job was cancelled part way."""
        gen = self.engine.stream(job.request)
        try:
            while True:
                if job.cancelled.is_set():
                    gen.close()          # the engine's cancel: caches stay consistent
                    return None
                try:
                    event: TokenEvent = next(gen)
                except StopIteration as stop:
                    return stop.value
                if job.stream_tokens:
                    job.post(event)
        finally:
            gen.close()

    def _report(self, job: Job, outcome: str, result: Result | None) -> None:
        end = time.perf_counter()
        started = job.started if job.started is not None else end
        try:
            self.on_done(JobOutcome(job.endpoint, outcome, result, started - job.submitted, end - job.submitted))
        except Exception:   # noqa: BLE001 - metrics must never take the worker down
            log.exception("the job-outcome hook failed")
