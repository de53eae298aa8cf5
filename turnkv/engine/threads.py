"""Adaptive compute threads (docs/threads.md): the engine's thread count follows what is fastest
on the cores it shares right now.

A decode step of a 2-thread engine waits at the end of every parallel region for its slowest
thread, and libgomp's waiting thread spins. On a machine where another process wants a core, one
of the two threads is descheduled for whole scheduler slices while its partner spins: Llama-3.2-1B
Q4_K_M decoded 14-18 tok/s at 2 threads beside one busy process on a 2-core Zen 4, against 34 at
1 thread and 41-43 at 2 on the quiet machine (docs/measurements/2026-12-08-session26.md). So the
best count depends on the load, which moves while a server runs.

``ThreadGovernor`` times the engine's decode steps (wall clock, steps without a prefill chunk,
compared only between steps of the same row count) and every so often runs a few steps at one
thread fewer or more (a *trial*); when the trial's median step beats the steps just before it by
``MARGIN`` it keeps that count. A failed trial doubles the wait before the next (``FIRST`` steps up
to ``LONGEST``; ``LONGEST_BELOW`` below ``most``, where a failed trial costs less than cores left
idle), so a quiet machine pays a few slower steps in a thousand; a jump of the step time
(``JUMP``: another process took a core) starts one at once, and below ``most`` so does a machine
whose other work has gone (``others_running``). The count changes nothing but the
speed: the engine's kernels give the same bits at any thread count (docs/kernels.md), and before
its first trial the governor checks that on the loaded model (``thread_probe``: the same tokens'
logits at both counts, bit for bit); where they differ it stays off."""

from __future__ import annotations

import random
import time
from collections import deque

import torch

from ..cache.specs import make_caches
from ..models.batch import ALL, LAST, Batch
from .speculative import median

CLOCK = time.perf_counter   # a step's wall time: under contention the waits for a core are the cost
FIRST = 64                  # decode steps before the first trial, and after a switch
LONGEST = 1024              # the most decode steps between trials (each failed one doubles the wait) ...
LONGEST_BELOW = 256         # ... and below ``most`` threads, so that freed cores are taken back soon
TRIAL = 4                   # steps of one row count a trial runs at the other thread count
WINDOW = 8                  # recent step times kept per row count at the current count
MARGIN = 1.15               # a trial's median step must be this much faster than the steps before it
JUMP = 1.5                  # steps this much slower than the best since the last trial: a trial now
FREED = 16                  # below ``most``: every this many steps, a trial now if a core looks idle
NOT_INVARIANT = "not_thread_invariant"


def others_running(path: str = "/proc/loadavg") -> int | None:
    """Tasks running or runnable on the machine right now besides the caller (``/proc/loadavg``'s
    fourth field counts the reader); None where it cannot be read. A hint only: in a container it
    may count the host's tasks, and then it never hints."""
    try:
        with open(path) as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return None


class ThreadGovernor:
    """The thread count of one engine's steps, between 1 and ``most`` (module doc). ``before_step``
    gives each step its count (``set_threads``, torch's by default, called only on a change);
    ``observe`` takes a decode step's wall time. ``probe(n)`` says whether the model's forward at
    ``n`` threads gives the bits it gives at ``most`` (asked once per count, before its first
    trial); None: not asked. torch's thread count is the process's: one governor a process (the
    engine of ``turnkv serve``, ``chat`` or ``generate``)."""

    def __init__(self, most: int, probe=None, set_threads=torch.set_num_threads, others=others_running):
        self.most = self.current = self.applied = max(1, int(most))
        self.probe, self.set_threads, self.others = probe, set_threads, others
        self.probed: dict[int, bool] = {self.most: True}
        self.blocked = ""                     # why it stays at ``most`` ("" while it adapts)
        self.times: dict[int, deque] = {}     # row count -> recent step times at ``current``
        self.best: dict[int, float] = {}      # row count -> the lowest median of TRIAL steps since the last switch or failed trial
        self.trial: tuple[int, int, list[float]] | None = None   # (threads, row count, its step times)
        self.wait, self.since, self.down = FIRST, 0, True
        self.trials = self.switches = 0

    def before_step(self) -> float:
        """Sets the next step's thread count (when it changed); returns the step's start time."""
        want = self.trial[0] if self.trial else self.current
        if want != self.applied:
            self.set_threads(want)
            self.applied = want
        return CLOCK()

    def after_step(self, work: list, start: float, costs) -> bool:
        """The engine's step ``work`` (begun at ``start``, ``before_step``'s time) ended: a decode step
        is observed, and a change of count makes speculation's step ``costs`` start afresh (they are
        times at one count). Returns whether the step was a trial's (not filed in ``costs``)."""
        on_trial = self.trial is not None
        if not any(w.prefill for w in work):
            switches = self.switches
            self.observe(sum(len(w.tokens) for w in work), CLOCK() - start)
            if self.switches != switches:
                costs.reset()
        return on_trial

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` (wall) at the count ``before_step`` gave."""
        if self.blocked or self.most == 1:
            return
        if self.trial is not None:
            n, r, got = self.trial
            self.since += 1
            if rows == r:
                got.append(seconds)
            if len(got) >= TRIAL or self.since > 4 * TRIAL:   # (its row count gone: given up as failed)
                self._end_trial()
            return
        q = self.times.setdefault(rows, deque(maxlen=WINDOW))
        q.append(seconds)
        self.since += 1
        if len(q) < TRIAL:
            return
        now = median(list(q)[-TRIAL:])
        best = self.best.get(rows)
        if best is None or now < best:
            self.best[rows] = now
        elif now > JUMP * best:       # another process took a core (or left one): look now
            self.since = max(self.since, self.wait)
        if self.current < self.most and self.since % FREED == 0 and self.since < self.wait:
            busy = self.others()      # the other work gone (fewer tasks than idle cores): look now
            if busy is not None and busy + self.current < self.most:
                self.since = self.wait
        if self.since >= self.wait:
            self._start_trial(rows)

    def next_count(self) -> int:
        """The thread count the next trial runs at."""
        return self.current - 1 if self.current > 1 and (self.down or self.current == self.most) else self.current + 1

    def check(self, n: int) -> bool:
        """Whether ``n`` threads give ``most``'s bits (``probe``, asked once a count; False blocks
        every change)."""
        if n not in self.probed:
            self.probed[n] = self.probe is None or bool(self.probe(n))
            if not self.probed[n]:
                self.blocked = NOT_INVARIANT
        return self.probed[n]

    def idle(self) -> None:
        """An idle moment (the server's engine loop without work): the next trial's count checked
        now, so that no step waits for its probe."""
        if not self.blocked and self.most > 1:
            self.check(self.next_count())

    def _start_trial(self, rows: int) -> None:
        n = self.next_count()
        if not self.check(n):
            return
        self.trial = (n, rows, [])
        self.trials += 1
        self.since = 0

    def _end_trial(self) -> None:
        n, rows, got = self.trial
        self.trial = None
        self.since = 0
        if len(got) >= TRIAL and median(got) * MARGIN < median(list(self.times[rows])[-TRIAL:]):
            self.current = n
            self.times.clear()
            self.best.clear()
            self.wait = FIRST
            self.switches += 1
        else:       # the steps' time now is the one to jump from (a slower machine that no count helps)
            self.best.pop(rows, None)
            self.wait = min(2 * self.wait, LONGEST if self.current == self.most else LONGEST_BELOW)
            if 1 < self.current < self.most:
                self.down = not self.down

    def as_dict(self) -> dict:
        return {"adaptive": f"off ({self.blocked})" if self.blocked else "on", "most": self.most,
                "current": self.current, "trials": self.trials, "switches": self.switches}


@torch.inference_mode()
def thread_probe(model, specs, dtype, device, modes, slack: int, most: int, n: int) -> bool:
    """Whether the model's logits at ``n`` threads are those at ``most``, bit for bit: a 65-token
    prefill (2 attention blocks: decode attention splits its key blocks between the threads), a
    17-row chunk (past the kernels' 16-row tiles) and 2 one-token steps, on scratch caches with
    the engine's KV modes."""
    rng = random.Random(4321)
    vocab = int(model.vocab_size)
    prefix = torch.tensor([rng.randrange(vocab) for _ in range(65)])
    chunk = torch.tensor([rng.randrange(vocab) for _ in range(17)])
    steps = torch.tensor([rng.randrange(vocab) for _ in range(2)])

    def run(tokens, caches, logits):
        return model.forward(Batch.build([(tokens, caches, logits)], device))

    def logits_at(threads: int) -> list[torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            caches = make_caches(specs, dtype, device, list(modes), slack)
            out = [run(prefix, caches, LAST), run(chunk, caches, ALL)]
            out += [run(steps[i:i + 1], caches, LAST) for i in range(len(steps))]
            return out
        finally:
            torch.set_num_threads(before)

    return all(torch.equal(a, b) for a, b in zip(logits_at(most), logits_at(n)))


def engine_governor(engine, adaptive: bool) -> ThreadGovernor | None:
    """``engine``'s governor: with ``adaptive`` (``--adaptive-threads on``), gguf weights (whose
    kernels give the same bits at any thread count, checked on the model by ``thread_probe``
    before a first change) and more than one thread; else None (a fixed count)."""
    from ..models.weights import GGUF_FORMAT

    most = torch.get_num_threads()
    if not adaptive or engine.weights != GGUF_FORMAT or most < 2:
        return None
    return ThreadGovernor(most, lambda n: thread_probe(engine.model, engine.specs, engine.dtype, engine.device,
                                                       engine.modes, engine.slack, most, n))


def threads_dict(governor: ThreadGovernor | None) -> dict:
    """The compute threads (``/v1/cache/stats``): a fixed count, or the governor's state."""
    if governor is None:
        return {"adaptive": "off", "most": torch.get_num_threads(), "current": torch.get_num_threads()}
    return governor.as_dict()
