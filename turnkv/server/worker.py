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
from dataclasses import dataclass, field, replace

from ..engine.engine import GenerationRequest, Result, TokenEvent
from ..engine.sequence import Failure, Sequence

OK, CANCELLED, FAILED, TIMEOUT = "ok", "cancelled", "failed", "timeout"
MAX_RESTARTS, RESTART_WINDOW_S = 3, 60
log = logging.getLogger("turnkv.server")


class WorkerDown(RuntimeError):
    """The engine loop is not running (restarting, or dead): the server answers 503."""


@dataclass
class Finished:
    result: Result           # choice 0 (or the choice that timed out); usage summed over the n choices
    queue_ms: float          # time between submit and the engine admitting the request
    results: list[Result] = field(default_factory=list)   # every choice, by index (n > 1)

    def __post_init__(self):
        if not self.results:
            self.results = [self.result]


@dataclass
class ChoiceEnd:
    """A streaming request's choice ended (n > 1 ends each choice on its own)."""

    result: Result


def combined(results: list[Result]) -> Result:
    """One Result for the request: choice 0's, with usage counting the prompt once (as OpenAI does)
    and the completion tokens of every choice."""
    first = results[0]
    if len(results) == 1:
        return first
    usage = replace(first.usage, completion_tokens=sum(r.usage.completion_tokens for r in results))
    return replace(first, usage=usage)


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
    results: dict[int, Result] = field(default_factory=dict)   # ended choices
    over: bool = False                       # reported (and its end posted) once

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
    ``run`` (``turnkv serve`` uses the main thread: see server/serve.py ``serve``)."""

    def __init__(self, engine, on_done: Callable[[JobOutcome], None] | None = None, own_thread: bool = True):
        self.engine = engine
        self.on_done = on_done or (lambda outcome: None)
        self._stop = threading.Event()
        self._running = False
        self.restarts = 0
        self.dead = False
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
        """Raises QueueFull (-> 429), WorkerDown (-> 503) and ValueError (-> 400) at once. A request
        that arrives while the loop restarts waits in the engine's queue for it."""
        if self.dead:
            raise WorkerDown("the engine is down (it failed repeatedly; see the server log)")
        job = Job(request, endpoint, asyncio.get_running_loop(), stream_tokens)
        job.seq = self.engine.submit(request, lambda item: self._on_event(job, item))
        return job

    # --- the engine thread -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """The engine loop until ``stop`` (or ``stop()``) is set. If the loop itself raises (a bug
        outside any one request's step), every request in flight gets an error, the engine starts
        again from fresh state slots, and /health reports 503 until it runs; after
        ``MAX_RESTARTS`` deaths within ``RESTART_WINDOW_S`` the worker stays dead (503, and new
        requests are refused with 503) rather than spin."""
        self._running = True
        deaths: list[float] = []
        try:
            while not (stop.is_set() or self._stop.is_set()):
                try:
                    self.engine.run(stop, also=self._stop)
                except Exception as err:  # noqa: BLE001 - restart below, or give up
                    self._running = False
                    log.exception("the engine loop died; failing the requests in flight and restarting it")
                    now = time.monotonic()
                    deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
                    self.restarts += 1      # counted before the requests fail: their clients see it
                    failed = self.engine.abort_all(err)
                    log.error("engine restart %d: %d request(s) failed", self.restarts, failed)
                    if len(deaths) > MAX_RESTARTS:
                        log.error("the engine loop died %d times in %d s: giving up (health stays 503)",
                                  len(deaths), RESTART_WINDOW_S)
                        self.dead = True
                        stop.wait()     # keep serving 503s until the server is stopped
                        return
                    self._running = True
        finally:
            self._running = False

    def _on_event(self, job: Job, item) -> None:
        if isinstance(item, TokenEvent):
            if job.stream_tokens:
                job.post(item)
            return
        seq = job.seq
        queue_ms = seq.stats.queue_ms if seq is not None else 0.0
        if job.over:              # a choice ending after its request failed or was cancelled
            return
        if isinstance(item, Result):
            if item.finish_reason == "cancelled":
                job.over = True
                self._report(job, CANCELLED, None, queue_ms)
                return
            job.results[item.index] = item
            if job.stream_tokens:
                job.post(ChoiceEnd(item))
            if len(job.results) < job.request.params.n:
                return
            job.over = True
            results = [job.results[i] for i in range(len(job.results))]
            late = next((r for r in results if r.finish_reason == "timeout"), None)
            if late is not None:
                self._report(job, TIMEOUT, None, queue_ms)
                job.post(Finished(late, queue_ms, results))
                return
            total = combined(results)
            self._report(job, OK, total, queue_ms)
            job.post(Finished(total, queue_ms, results))
        elif isinstance(item, Failure):
            job.over = True
            job.cancel()          # the request's other choices end too
            self._report(job, FAILED, None, queue_ms)
            job.post(Failed(item.error))

    def _report(self, job: Job, outcome: str, result: Result | None, queue_ms: float) -> None:
        end = time.perf_counter()
        try:
            self.on_done(JobOutcome(job.endpoint, outcome, result, queue_ms / 1000, end - job.submitted))
        except Exception:   # noqa: BLE001 - metrics must never take the engine down
            log.exception("the job-outcome hook failed")
