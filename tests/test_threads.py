"""Adaptive compute threads (engine/threads.py, docs/threads.md): the governor's choices from the
step times it is given, and, on the bundled models as served (gguf weights, fp16 KV), that a
thread count changing between steps changes no token and no logit bit."""

from __future__ import annotations

import time

import pytest
import torch

from test_speculative_real import loaded  # noqa: F401 - the bundled models as served
from turnkv.engine import threads as T
from turnkv.engine.sampling import SamplingParams


class Recorder:
    """The thread counts the governor sets, in order (what torch.set_num_threads would get)."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def drive(gov: T.ThreadGovernor, step_time, steps: int, rows: int = 1) -> list[int]:
    """``steps`` decode steps; ``step_time(threads)`` is a step's time at that count. Returns the
    count each step ran at."""
    used = []
    for _ in range(steps):
        gov.before_step()
        n = gov.applied
        used.append(n)
        gov.observe(rows, step_time(n))
    return used


def test_a_quiet_machine_keeps_every_thread_and_tries_fewer_ever_more_rarely():
    gov = T.ThreadGovernor(2, set_threads=Recorder(), others=lambda: None)
    used = drive(gov, lambda n: 1.0 if n == 2 else 1.3, 4000)
    assert gov.current == 2 and gov.switches == 0
    assert used[:T.FIRST] == [2] * T.FIRST and used[T.FIRST] == 1      # the first trial after FIRST steps
    trial_steps = used.count(1)
    assert trial_steps == gov.trials * T.TRIAL and 3 <= gov.trials <= 6  # 64, 128, 256, 512, 1024, 1024 ...
    assert gov.wait == T.LONGEST


def test_a_busy_core_moves_to_fewer_threads_and_back_when_it_frees():
    rec = Recorder()
    gov = T.ThreadGovernor(2, set_threads=rec, others=lambda: None)
    busy = {2: 2.2, 1: 1.0}
    quiet = {2: 1.0, 1: 1.3}
    drive(gov, quiet.get, 300)
    assert gov.current == 2
    used = drive(gov, busy.get, 40)          # the step time jumps 2.2x: a trial at once, and it wins
    assert gov.current == 1 and gov.switches == 1 and used[-1] == 1
    assert used.index(1) < 10
    drive(gov, busy.get, 600)                 # trials of 2 threads fail; the wait grows to LONGEST_BELOW
    assert gov.current == 1 and gov.wait == T.LONGEST_BELOW
    used = drive(gov, quiet.get, T.LONGEST_BELOW + 2 * T.TRIAL + 1)
    assert gov.current == 2 and gov.switches == 2 and used[-1] == 2
    assert rec.calls[0] == 1 and all(a != b for a, b in zip(rec.calls, rec.calls[1:]))   # set only on a change


def test_a_machine_slower_for_every_count_brings_one_trial_not_one_a_step():
    """Memory slower by 2x for a while (no thread count helps): one trial at the jump, then the
    slower steps are the level to jump from."""
    gov = T.ThreadGovernor(2, set_threads=Recorder(), others=lambda: None)
    drive(gov, {2: 1.0, 1: 1.3}.get, 300)
    before = gov.trials
    drive(gov, {2: 2.0, 1: 2.6}.get, 300)
    assert gov.trials - before <= 2 and gov.current == 2


def test_a_trial_compares_steps_of_its_own_row_count_only():
    gov = T.ThreadGovernor(2, set_threads=Recorder(), others=lambda: None)
    for _ in range(T.FIRST):                     # 1-row steps at 1.0, then a trial on 1-row steps ...
        gov.before_step()
        gov.observe(1, 1.0 if gov.applied == 2 else 0.5)
    assert gov.trial is not None and gov.trial[1] == 1
    for _ in range(3 * T.TRIAL):                 # ... sees only 8-row steps (fast at 1 thread: not counted)
        gov.observe(8, 0.1)
    assert gov.trial is not None
    for _ in range(2 * T.TRIAL):                 # its row count gone: given up, as a failed trial
        gov.observe(8, 0.1)
    assert gov.trial is None and gov.current == 2 and gov.wait == 2 * T.FIRST


def test_a_model_whose_bits_move_with_the_thread_count_keeps_its_threads():
    asked = []
    rec = Recorder()
    gov = T.ThreadGovernor(4, probe=lambda n: asked.append(n) or False, set_threads=rec, others=lambda: None)
    drive(gov, lambda n: 1.0 / n if n > 2 else 5.0, 500)
    assert asked == [3] and gov.blocked == T.NOT_INVARIANT and rec.calls == [] and gov.current == 4
    assert gov.as_dict()["adaptive"] == f"off ({T.NOT_INVARIANT})"


def test_below_most_the_end_of_the_other_work_brings_a_trial_within_freed_steps():
    others = [1]                               # one busy process beside the engine, then none
    gov = T.ThreadGovernor(2, set_threads=Recorder(), others=lambda: others[0])
    busy, quiet = {2: 2.2, 1: 1.0}, {2: 1.0, 1: 1.3}
    drive(gov, busy.get, 700)
    assert gov.current == 1 and gov.wait == T.LONGEST_BELOW
    others[0] = 0
    used = drive(gov, quiet.get, T.FREED + 2 * T.TRIAL + 1)
    assert gov.current == 2 and used[-1] == 2


def test_others_running_reads_the_machines_runnable_tasks(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("1.27 1.37 1.55 3/110 2028\n")
    assert T.others_running(str(f)) == 2
    assert T.others_running(str(tmp_path / "none")) is None
    assert T.others_running() is None or T.others_running() >= 0


def test_an_idle_moment_probes_the_next_count_and_never_most():
    asked = []
    gov = T.ThreadGovernor(2, probe=lambda n: asked.append(n) or True, set_threads=Recorder(), others=lambda: None)
    gov.idle()
    gov.idle()
    assert asked == [1]                       # once a count; 2 (most) is never asked
    drive(gov, {2: 2.0, 1: 1.0}.get, 200)
    assert gov.current == 1 and asked == [1]  # up again to 2: no probe either


def test_more_than_two_threads_climb_one_at_a_time():
    gov = T.ThreadGovernor(4, set_threads=Recorder(), others=lambda: None)
    best = {4: 3.0, 3: 1.0, 2: 1.5, 1: 2.0}     # one busy core of four: 3 threads fastest
    drive(gov, best.get, 3000)
    assert gov.current == 3


def test_step_costs_start_afresh_at_a_new_thread_count():
    from turnkv.engine.speculative import CHUNK_COST, StepCosts

    costs = StepCosts()
    for _ in range(5):
        costs.observe(1, 1.0)
        costs.observe(2, 3.0)
    assert costs.cost(2) == 3.0
    costs.reset()
    assert costs.cost(2) == CHUNK_COST[2] and all(not t for t in costs.times.values())


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.real
def test_the_served_models_give_the_same_bits_at_any_thread_count(loaded, two_threads):
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache

    eng = Engine(loaded.net, loaded.tokenizer, fingerprint=loaded.fingerprint, weights=loaded.weights,
                 kv_mode="fp16", prompt_cache=PromptCache(0), adaptive_threads=True)
    assert eng.threads is not None and eng.threads.most == 2
    assert eng.threads.probe(1) and eng.threads.probe(3)


@pytest.mark.real
def test_threads_changing_between_steps_change_no_token(loaded, two_threads):
    """Each step at another count (1, 2, 3, 1, ...), decode and a reused second turn: the tokens and
    the logprobs of a thread-fixed engine."""
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache

    def run(adaptive):
        eng = Engine(loaded.net, loaded.tokenizer, fingerprint=loaded.fingerprint, weights=loaded.weights,
                     kv_mode="fp16", prompt_cache=PromptCache(1 << 30), adaptive_threads=adaptive)
        if adaptive:
            counts = iter([1, 2, 3] * 1000)
            eng.threads.before_step = lambda: torch.set_num_threads(next(counts)) or time.perf_counter()
        msgs = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
        params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
        first = eng.generate(eng.chat_request(msgs, params))
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Asia?"}]
        second = eng.generate(eng.chat_request(msgs, params))
        torch.set_num_threads(2)
        return first, second

    fixed, moving = run(False), run(True)
    for a, b in zip(fixed, moving):
        assert a.token_ids == b.token_ids
        assert [(x.logprob, x.top) for x in a.logprobs] == [(x.logprob, x.top) for x in b.logprobs]
    assert moving[1].usage.cached_tokens > 0          # the second turn reused the first's state


def test_native_weights_keep_a_fixed_thread_count(two_threads):
    from tiny import tiny_llama
    from turnkv.engine.engine import Engine

    eng = Engine(tiny_llama()[0], weights="native", adaptive_threads=True)
    assert eng.threads is None and T.threads_dict(eng.threads)["adaptive"] == "off"
