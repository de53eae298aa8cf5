"""Speculative decoding whose output is plain decoding's (docs/speculative.md): a sequence's draft
state and counts (the tokens its grammar forces are drafted here; the drafters proper are
drafters.py's), and the step costs drafts are priced by. The verification itself is the engine's step (engine.py
``_advance``, ``verify_draft``): the sequence's own ``take`` on each logits row of the draft's
chunk. The probe that decides whether the loaded model's forward is chunk-invariant, which
exactness rests on, is spec_probe.py."""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .drafters import AUTO, AUTO_PENDING, MODES, OFF

DEFAULT_DRAFT_MAX = 7
FORCED = "forced"                # the kind of a draft of the tokens a grammar forces
MAX_DRAFT = 64
# A draft is proposed only when its expected tokens per unit of step time beat plain decoding's
# by this much: below it what a draft could win is within the error of the acceptance estimate
# (which never falls below 1/7) and of the measured costs, and a draft that does not win loses.
MIN_GAIN = 1.15
# The lm_head's time for a call of m rows over a one-row call's, for the block sizes verification
# uses (1 thread, Zen 4; the mean of Gemma 3 270M's 262k x 640 and SmolLM2's 49k x 576 Q8_0
# heads): up to 4 rows cost about one row's (the weights stream once for paired rows). Odd
# sizes past 1 are left out: an unpaired row costs an extra pass (SmolLM2: 3 rows 1.6-2.8x one).
# Only the prior of ``StepCosts.head_costs``, which measures the head calls of verification.
HEAD_COST = {1: 1.0, 2: 1.0, 4: 1.06, 8: 1.55, 16: 3.7}
RECENT = 0.8                     # weight of the acceptance counts kept at each verified draft
# Draft lengths are 2^j - 1, so a verified chunk (the next token and the draft) is 2, 4, 8 or 16
# rows: the gguf kernels' row tiles and pairs. One row past them costs a step out of line with
# what it brings (1 thread, Zen 4: Gemma 3 270M 8 rows 2.1x one row's time, 9 rows 2.8x).
# A step of that many rows over a one-row step's time, the mean of Gemma 3 270M and SmolLM2 135M
# (1 thread, Zen 4, 700 tokens of context: docs/measurements/2026-12-06-speculative.md): only the
# prior of ``StepCosts``, which measures them as the engine runs.
CHUNK_COST = {2: 1.09, 4: 1.30, 8: 2.06, 16: 4.17}
FIT = {rows: next(m for m in CHUNK_COST if m >= rows) for rows in range(1, 17)}   # rows -> the count they are priced as
COST_WINDOW = 15                 # a row count's latest step times ``StepCosts`` keeps
COST_MIN_SAMPLES = 3             # ... and how many it needs before they replace the prior
RECALIBRATE = 64                 # multi-row steps in a row before one draft is skipped to time one row
# What steps and head calls are timed by: the engine thread's CPU time, not the wall clock. On a
# loaded machine the wall time of a step is mostly the wait for a core (2-30x its CPU time at load
# 8-10), which landed on whichever row count it hit: one run measured a 2-row step at 9.2 one-row
# steps and stopped drafting. At more than one thread the other threads' time is not in it; the
# calling thread runs its share of each parallel region and waits at its end, so its time still
# follows the step's (docs/speculative.md, "Step costs").
CLOCK = time.thread_time


def median(got) -> float:
    """``statistics.median`` of a few floats, without its checks (a step looks costs up)."""
    s = sorted(got)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class StepCosts:
    """What a decode step of 2, 4, 8 or 16 rows costs over a one-row step, measured from the
    engine's own steps (``observe_step``: the model CPU time of each step without a prefill
    chunk, filed under the smallest of these row counts that holds its rows, as ``cost`` prices
    it) as the median of each row count's latest ``window`` step times; ``CHUNK_COST`` stands in
    for a row count with fewer than ``COST_MIN_SAMPLES``. A multi-row step's relative cost moves
    with the CPU (8 rows 2.3x one row's time on a quiet Zen 4 core): priced too low, drafts run
    too long to pay. The costs are worked out again only after a new time came in (a draft's
    length is chosen at every step). ``window=0``: the prior only."""

    def __init__(self, window: int = COST_WINDOW):
        self.times = {m: deque(maxlen=window) for m in (1, *CHUNK_COST)}
        self.head_times = {m: deque(maxlen=window) for m in HEAD_COST}    # verification's head calls
        self.window = window
        self.since_one = 0     # multi-row decode steps since the last one-row step
        self._chunks: dict[int, float] | None = None            # ``cost``'s table, None: out of date
        self._heads: tuple[tuple[int, float], ...] | None = None  # ``head_costs``, None: out of date

    def reset(self) -> None:
        """Forget every time measured (the engine's thread count changed: engine/threads.py)."""
        for got in (*self.times.values(), *self.head_times.values()):
            got.clear()
        self.since_one = 0
        self._chunks = self._heads = None

    def observe_head(self, rows: int, seconds: float) -> None:
        """A head call of ``rows`` rows that verification made (``DraftLogits``)."""
        if rows in self.head_times:
            self.head_times[rows].append(seconds)
            self._heads = None

    def head_costs(self) -> tuple[tuple[int, float], ...]:
        """What a head call of each block size costs over a one-row call, as ``head_blocks``
        takes it: measured (the median of a size's latest calls over the one-row calls') where
        both have ``COST_MIN_SAMPLES`` calls, else ``HEAD_COST``; rounded to 0.05, so that the
        blocks chosen are looked up, not worked out again, while the costs hold still. The head
        of Gemma 3 (262k rows) is half a one-row step and pairs rows; SmolLM2's is a fifth, and
        odd-sized or 8-row calls cost it more than the prior says."""
        if self._heads is None:
            got = self.head_times[1]
            one = median(got) if len(got) >= COST_MIN_SAMPLES else None
            out = []
            for m, prior in HEAD_COST.items():
                times = self.head_times[m]
                cost = prior if one is None or len(times) < COST_MIN_SAMPLES else median(times) / one
                out.append((m, round(max(cost, 0.05) * 20) / 20))
            self._heads = tuple(out)
        return self._heads

    def observe(self, rows: int, seconds: float) -> None:
        fit = 1 if rows == 1 else FIT.get(rows)
        if fit is not None and self.window:
            self.times[fit].append(seconds)
            self._chunks = None
        self.since_one = 0 if rows == 1 else self.since_one + 1

    def observe_step(self, work: list, outs: list, seconds: float) -> None:
        """A step's model time, ``seconds`` (its forward and head) plus the head blocks its
        drafts' verification computed (``DraftLogits``), under its row count; a step with a
        prefill chunk is not a decode step and is left out. Sampling, grammar masks, events and
        snapshots are per token or per request, not per row: left out too (the end of a request
        stores its state, which would price the last step's rows far above their forward)."""
        if not any(w.prefill for w in work):
            seconds += sum(o.seconds for o in outs if isinstance(o, DraftLogits))
            self.observe(sum(len(w.tokens) for w in work), seconds)

    def plain_step_due(self) -> bool:
        """True once ``RECALIBRATE`` multi-row steps ran since the last one-row step: a sequence
        that asks then skips one draft, so what one row costs now is measured again (a copy
        drafted whole at every step would never run one). The ask counts as the step."""
        if not self.window or self.since_one < RECALIBRATE:
            return False
        self.since_one = 0
        return True

    def split(self, rows: int, most: int) -> int:
        """The first step's rows in the cheapest run of ``rows`` rows whose tokens are all taken
        (a grammar's forced tokens after the next token) through steps of at most ``most`` rows,
        at the costs in use (rounded to 0.05, so that the split is looked up while they hold)."""
        return cheapest_split(min(rows, 4 * most), most, tuple(round(self.cost(m) * 20) / 20 for m in CHUNK_COST))

    def measured(self, rows: int) -> float | None:
        got = self.times[rows]
        return median(got) if len(got) >= COST_MIN_SAMPLES else None

    def cost(self, rows: int) -> float:
        """A step of ``rows`` rows over a one-row step's time, priced as the smallest row count
        of ``CHUNK_COST`` that holds them (past 16 rows in proportion): ``chunk_costs``."""
        if self._chunks is None:
            self._chunks = self.chunk_costs()
        fit = FIT.get(rows)
        return self._chunks[fit] if fit is not None else self._chunks[16] * rows / 16

    def chunk_costs(self) -> dict[int, float]:
        """Each row count's cost from the medians: measured over the measured one-row time (before
        one-row steps are measured, over the smallest measured row count's at its prior cost); a
        row count not yet measured at its prior, scaled as the largest smaller measured row count
        stands to its own prior (a 2-row step measured at 1.44 one-row steps puts 4 rows at 1.72,
        not below the 2 rows as the fixed 1.30 did: prose drafted 3 tokens on it)."""
        got = {m: self.measured(m) for m in self.times}
        one = got[1]
        if one is None:
            base = next((m for m in CHUNK_COST if got[m] is not None), None)
            one = got[base] / CHUNK_COST[base] if base is not None else None
        out, scale = {}, 1.0
        for m, prior in CHUNK_COST.items():
            if got[m] is None:
                out[m] = prior * scale
            else:
                out[m] = got[m] / one
                scale = out[m] / prior
        return out

    def as_dict(self) -> dict:
        return {**{str(m): round(self.cost(m), 3) for m in CHUNK_COST},
                "head": {str(m): c for m, c in self.head_costs()}}


@functools.lru_cache(maxsize=4096)
def cheapest_split(rows: int, most: int, costs: tuple[float, ...]) -> int:
    """``StepCosts.split``: ``costs`` are a step of 2, 4, 8 and 16 rows over a one-row step's
    time, a step priced as the smallest of them that holds its rows (past 16 in proportion)."""
    table = dict(zip(CHUNK_COST, costs))

    def price(r: int) -> float:
        return 1.0 if r == 1 else table[FIT[r]] if r <= 16 else table[16] * r / 16
    best, first = [0.0] * (rows + 1), [0] * (rows + 1)
    for m in range(1, rows + 1):      # ties (to 1e-9): the longer first step (fewer steps)
        best[m], r = min((round(price(r) + best[m - r], 9), -r) for r in range(1, min(m, most) + 1))
        first[m] = -r
    return first[rows]


def rung(draft_max: int, length: int) -> int:
    """The longest draft length 2^j - 1 at most ``length``, capped at ``draft_max``."""
    n = 1
    while 2 * n + 1 <= length:
        n = 2 * n + 1
    return min(n, draft_max)


def check_mode(mode: str | None, draft_max: int | None) -> None:
    """ValueError naming the field for a speculative mode or draft length no request can use."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
    if draft_max is not None and (isinstance(draft_max, bool) or not isinstance(draft_max, int)
                                  or not 1 <= draft_max <= MAX_DRAFT):
        raise ValueError(f"draft_max must be an integer in 1..{MAX_DRAFT}, got {draft_max!r}")


@dataclass
class Speculation:
    """One sequence's speculation: the drafter, the adaptive draft length (0: backed off) and its
    counts. ``costs`` is the engine's ``StepCosts`` (a sequence alone: the prior's)."""

    mode: str
    draft_max: int
    drafter: object
    costs: StepCosts = field(default_factory=StepCosts)
    length: int = 0
    drafted: int = 0               # draft tokens verified, of every kind ...
    accepted: int = 0              # ... and of them those plain decoding took too
    forced_drafted: int = 0        # of them, the tokens the grammar forced (``propose``) ...
    forced_accepted: int = 0       # ... and of those the ones taken
    forced: int = 0                # the draft in flight: its forced tokens (0: the drafter's)
    kind: str = ""                 # the draft in flight's kind (the drafter's ``kind``, else the mode)
    kinds: dict[str, list[int]] = field(default_factory=dict)   # kind -> [drafted, accepted]
    # draft tokens accepted and drafts that ended in a rejected token, recent ones weighing more;
    # they start at one of each (a guess to be proven), which weighs less at every draft too
    recent_accepted: float = 1.0
    recent_rejected: float = 1.0
    shadow: int | None = None      # backed off: the drafter's guess for the token at ``shadow_at``
    shadow_at: int = 0

    def __post_init__(self):
        self.length = self.best_length()
        self.kind = self.kind or self.mode

    def propose(self, history: list[int], room: int, grammar=None) -> list[int]:
        """A draft of at most ``room`` tokens to follow ``history``. Where ``grammar`` (the
        sequence's ``Matcher``; None: it has none) forces tokens next, those: the first step of
        the cheapest split of their run into steps (``StepCosts.split``: they are taken as
        certain, and their counts leave the drafter's acceptance alone). Else the drafter's, at
        most ``length`` of them (none while backed off: ``watch``), cut at the first token the
        grammar refuses (plain decoding cannot take it)."""
        if grammar is not None:
            forced = grammar.forced()
            if forced:
                self.forced = self.costs.split(len(forced) + 1, min(room, self.draft_max) + 1) - 1
                return forced[:self.forced]
        if not self.length and not self.watch(history):
            return []
        if self.costs.plain_step_due():
            return []
        k = min(self.length, room)
        draft = self.drafter.draft(history, k) if k > 0 else []
        self.kind = getattr(self.drafter, "kind", None) or self.mode
        return draft[:grammar.valid(draft)] if grammar is not None and draft else draft

    def watch(self, history: list[int]) -> int:
        """Backed off, the drafter still guesses the next token at every step (a lookup, no
        forward) and the guess is checked against the token plain decoding takes there, which
        is what verifying it would have found: the acceptance stays current for free, and
        drafting resumes once it pays again. Returns the length then chosen. Only a guess that
        came true can make a draft pay again (a miss lowers the acceptance, and a draft that did
        not pay at a higher one does not at a lower), so a miss costs no ``best_length``: prose,
        backed off, pays a lookup and a comparison a step."""
        if self.shadow is not None and len(history) > self.shadow_at:
            hit = int(history[self.shadow_at] == self.shadow)
            self.recent_accepted = RECENT * self.recent_accepted + hit
            self.recent_rejected = RECENT * self.recent_rejected + 1 - hit
            self.shadow = None
            if hit:
                self.length = self.best_length()
        if not self.length:
            guess = self.drafter.draft(history, 1)
            self.shadow, self.shadow_at = (guess[0], len(history)) if guess else (None, 0)
        return self.length

    def token_acceptance(self) -> float:
        """The chance that a draft token is accepted given the one before it was, from recent
        drafts (a draft's accepted run is geometric: accepted tokens over accepted tokens plus
        rejections). The one of each assumed before any draft fades like any count, so a run of
        failed guesses takes the estimate towards 0 (a floor kept the old estimate above 1/7, and
        a single lucky guess in prose then paid for a draft by the prior's costs)."""
        return self.recent_accepted / (self.recent_accepted + self.recent_rejected)

    def record(self, drafted: int, accepted: int) -> str:
        """Counts (in all and by the draft's kind), and the next draft's length: ``best_length``
        for the recent acceptance, and after a draft taken whole at least ``climb``'s (copying
        runs long); 0 backs off. A forced draft counts as its own kind and changes neither.
        Returns the draft's kind."""
        self.drafted += drafted
        self.accepted += accepted
        kind = FORCED if self.forced else self.kind
        count_kind(self.kinds, kind, drafted, accepted)
        if self.forced:
            self.forced = 0
            self.forced_drafted += drafted
            self.forced_accepted += accepted
            return kind
        self.recent_accepted = RECENT * self.recent_accepted + accepted
        self.recent_rejected = RECENT * self.recent_rejected + (accepted < drafted)
        self.length = self.best_length()
        if accepted == drafted:
            self.length = max(self.length, self.climb(drafted))
        return kind

    def climb(self, drafted: int) -> int:
        """After a draft of ``drafted`` taken whole: the next rung up (copies run long) if, taken
        whole too, it gives more tokens per unit of step time than this draft did; else this
        length again; either only while it beats a plain step by ``MIN_GAIN`` (else 0)."""
        def whole(n: int) -> float:
            return (n + 1) / self.costs.cost(n + 1)
        up = rung(self.draft_max, 2 * drafted + 1)
        best = max((up, drafted), key=whole)
        return best if whole(best) >= MIN_GAIN else 0

    def best_length(self) -> int:
        """The rung (1, 3, 7 .. at most ``draft_max``) whose expected tokens per pass, at the
        recent per-token acceptance p (1 + p + .. + p^k for a draft of k), over its step's cost
        (``costs``, as measured) is highest; 0 (back off) when even that one does not beat a
        plain step's one token by ``MIN_GAIN``."""
        p = min(self.token_acceptance(), 0.999)
        best, length, k = 0.0, 1, 1
        while True:
            n = min(k, self.draft_max)
            rate = (1 - p ** (n + 1)) / (1 - p) / self.costs.cost(n + 1)
            if rate > best:
                best, length = rate, n
            if n == self.draft_max:
                return length if best >= MIN_GAIN else 0
            k = 2 * k + 1


@dataclass
class SpecCounters:
    """The engine's totals (``/v1/cache/stats``, ``/metrics``)."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    forced_drafted: int = 0      # of them, the tokens a grammar forced ...
    forced_accepted: int = 0     # ... and of those the ones taken
    off: dict[str, int] = field(default_factory=dict)     # requests that asked, by why it was off
    kinds: dict[str, list[int]] = field(default_factory=dict)   # kind -> [drafted, accepted]
    costs: StepCosts = field(default_factory=StepCosts)   # the step costs every sequence's drafts go by

    def count(self, kind: str, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        count_kind(self.kinds, kind, drafted, accepted)
        if kind == FORCED:
            self.forced_drafted += drafted
            self.forced_accepted += accepted

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": round(rate, 4),
                "verify_steps": self.verify_steps,
                "forced": {"drafted": self.forced_drafted, "accepted": self.forced_accepted},
                "kinds": kinds_dict(self.kinds), "off": dict(self.off), "step_costs": self.costs.as_dict()}


def count_kind(kinds: dict[str, list[int]], kind: str, drafted: int, accepted: int) -> None:
    got = kinds.setdefault(kind, [0, 0])
    got[0] += drafted
    got[1] += accepted


def kinds_dict(kinds: dict[str, list[int]]) -> dict[str, dict]:
    """Draft counts by kind (the drafter's, or ``forced``), as stats and /metrics report them."""
    return {k: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 4) if d else 0.0}
            for k, (d, a) in sorted(kinds.items())}


@functools.lru_cache(maxsize=4096)
def head_blocks(rows: int, p: float, costs: tuple[tuple[int, float], ...] = tuple(HEAD_COST.items())) -> dict[int, int]:
    """How to cut a verified chunk of ``rows`` logit rows into head calls, {first row: rows}, for
    the least expected head time when each draft token is accepted with chance ``p`` (row i + 1
    is needed only if row i's token was accepted) and a call of b rows costs ``costs``' figure
    for b (``StepCosts.head_costs``): the first block's rows are always needed."""
    best, size = [0.0] * (rows + 1), [0] * (rows + 1)
    for i in range(rows - 1, -1, -1):
        best[i], size[i] = min((cost + p ** b * best[i + b], b) for b, cost in costs if b <= rows - i)
    out, i = {}, 0
    while i < rows:
        out[i] = size[i]
        i += size[i]
    return out


class DraftLogits:
    """A verified draft's logits rows, computed by the lm_head (``head``: ``Model.head``) as
    verification reaches them, a block of rows at a time. Verification takes rows in order and
    stops at the first rejected draft token, so the rows after it are never computed: on Gemma 3
    the head (262k x 640) is most of a step. A row's logits are the same bits whatever block
    computes it (the kernels are row-invariant: the chunk probe checks it), so this changes no
    token. Blocks follow ``head_blocks`` for the sequence's recent acceptance."""

    def __init__(self, head, hidden: torch.Tensor, spec: "Speculation"):
        self.head, self.hidden, self.costs = head, hidden, spec.costs
        p = 1.0 if spec.forced else round(spec.token_acceptance(), 2)    # forced tokens: taken as certain
        self.blocks = head_blocks(len(hidden), p, spec.costs.head_costs())
        self.rows: list[torch.Tensor] = []
        self.seconds = 0.0     # spent in the head (the step's costs: ``StepCosts.observe_step``)

    def __len__(self) -> int:
        return len(self.hidden)

    def __getitem__(self, i: int) -> torch.Tensor:
        while i >= len(self.rows):
            start = len(self.rows)
            n = self.blocks.get(start, len(self.hidden) - start)
            t0 = CLOCK()
            with torch.inference_mode():
                self.rows.extend(self.head(self.hidden[start:start + n]))
            took = CLOCK() - t0
            self.seconds += took
            self.costs.observe_head(n, took)
        return self.rows[i]


def verify_draft(seq, tokens: list[int], rows, counters: SpecCounters) -> bool:
    """``tokens`` (a sequence's next token and its draft) ran as one chunk; ``rows`` are their
    logits. Take tokens from the rows in order as plain decoding would (``seq.take``: sampler,
    penalties, grammar, logprobs, stops, events), while each equals the draft token fed after it;
    then cut the state back to what the taken tokens leave, and count the draft (the sequence's
    and the engine's ``counters``). Returns True when the sequence finished."""
    draft = tokens[1:]
    base = seq.state.length - len(tokens)
    taken = matched = 0
    finished = False
    for i in range(len(tokens)):
        finished = seq.take(rows[i])
        taken += 1
        if i == len(draft) or seq.generated[-1] != draft[i]:
            break
        matched += 1
        if finished:
            break
    seq.state.truncate(base + taken)      # also ends the recurrent layers' trails
    counters.count(seq.spec.record(len(draft), matched), len(draft), matched)
    return finished


def speculation_for(engine, seq) -> Speculation | None:
    """The sequence's drafts on ``engine``, or None (its stats say why) when it decodes plainly."""
    mode = seq.params.speculative or engine.speculative
    if mode == OFF:
        return None
    blocked = (AUTO_PENDING if mode == AUTO and engine.idle_check and engine._spec_block is None   # no wait for it
               else engine.speculation_blocked())
    if blocked:
        seq.stats.speculative = f"off ({blocked})"
        engine.spec.off[blocked] = engine.spec.off.get(blocked, 0) + 1
        return None
    seq.stats.speculative = mode
    return Speculation(mode, seq.params.draft_max or engine.draft_max, engine.drafters[mode](engine, seq),
                       engine.spec.costs)
