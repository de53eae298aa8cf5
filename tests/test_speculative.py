"""Speculative decoding changes nothing but the number of forward passes (docs/speculative.md):
token ids with drafts equal those without, greedy and seeded sampling, alone and batched, with
reuse; the engine's verification is what is under test, so the drafts come from drafters the
tests inject (an oracle that knows the plain run and corrupts it, random and always-wrong ones)
besides the real ngram drafter."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_engine_batching import run_all
from turnkv.cache import specs as cache_specs
from turnkv.engine.engine import Engine
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.sequence import GenerationRequest
from turnkv.engine.drafters import NGRAM, NgramDrafter
from turnkv.engine.speculative import CHUNK_COST, CLOCK, FORCED, DraftLogits, Speculation, StepCosts, head_blocks
from turnkv.loading.model import load_model
from turnkv.models.batch import ALL, Batch
from turnkv.prompt_cache.store import PromptCache

FIXTURES = Path(__file__).parent / "gguf_fixtures"
VOCAB = 320
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.3, repetition_penalty=1.1, logprobs=2)


def chunked_attention(net):
    """The Llama fixture with its layers attending in chunks of 16 (Llama 4's local layers: the
    chunked cache and the kernels' chunk mask); no chunked family has a GGUF fixture."""
    specs = [cache_specs.chunked(s.heads, s.head_dim, 16) for s in net.cache_specs()]
    net.cache_specs = lambda: specs


def delta_net_only(net):
    """The Qwen 3.5 fixture's three gated delta-net layers without its attention layer: a model
    whose whole state is recurrent (conv windows and delta-rule states, no K/V)."""
    net.layers = torch.nn.ModuleList(layer for layer in net.layers if layer.kind != "full_attention")


# chunk-invariant under the gguf kernels, one row per kind of state: full attention (Llama),
# sliding windows of 16 (Exaone 4), chunks of 16, hybrids (Qwen 3.5: gated delta-net + gated
# attention; LFM2: short conv + attention) and recurrent state alone (Qwen 3.5's delta-nets; RWKV-7)
FAMILIES = {"full": ("llama", None), "sliding": ("exaone4", None), "chunked": ("llama", chunked_attention),
            "hybrid": ("qwen3_5", None), "conv_hybrid": ("lfm2", None), "recurrent": ("qwen3_5", delta_net_only),
            "rwkv7": ("rwkv7", None)}


@pytest.fixture(scope="module")
def loaded():
    out = {}
    for kind, (name, adapt) in FAMILIES.items():
        out[kind] = load_model(str(FIXTURES / name / f"{name}-q8_0.gguf"), torch.float32, "gguf", False)
        if adapt is not None:
            adapt(out[kind].net)
    return out


def make_engine(model, speculative="off", drafter=None, budget=1 << 30, tokenizer=None, measured=False,
                **kw) -> Engine:
    eng = Engine(model.net, tokenizer, fingerprint=f"spec-{model.net.family}", weights=model.weights,
                 prompt_cache=PromptCache(budget), slack=4, prefill_chunk=16, max_context=4096,
                 speculative=speculative, draft_max=6, **kw)
    if drafter is not None:
        eng.drafters[NGRAM] = lambda engine, seq: drafter()     # a factory without arguments
    if not measured:     # drafts as the prior costs choose them, whatever this machine's timing
        eng.spec.costs = StepCosts(window=0)
    return eng


def req(prompt, max_tokens=40, **params) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Oracle:
    """Drafts the plain run's continuation (``runs``: prompt + reply of each request), with each
    token replaced by a wrong one with probability ``wrong``; after a history no run starts
    with, nothing."""

    def __init__(self, runs: list[list[int]], wrong: float, seed: int = 0):
        self.runs, self.wrong, self.rng = runs, wrong, random.Random(seed)

    def __call__(self):
        return self

    def draft(self, history: list[int], k: int) -> list[int]:
        for run in self.runs:
            if run[:len(history)] == history:
                out = run[len(history):len(history) + k]
                return [(t + 1) % VOCAB if self.rng.random() < self.wrong else t for t in out]
        return []


def burn(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its CPU time (what the engine times steps by)."""
    end = CLOCK() + seconds
    while CLOCK() < end:
        pass


def plain_runs(model, reqs) -> list:
    return [make_engine(model, budget=0).generate(r) for r in reqs]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafts_change_no_token_alone_and_batched(loaded, family, params):
    reqs = [req(tokens(1, 30), **params), req(tokens(2, 9), 25, **params), req(tokens(3, 50), 1, **params)]
    want = plain_runs(loaded[family], reqs)
    oracle = Oracle([r.prompt_ids + w.token_ids for r, w in zip(reqs, want)], wrong=0.25)
    eng = make_engine(loaded[family], "ngram", oracle)
    alone = eng.generate(reqs[0])
    assert alone.token_ids == want[0].token_ids
    assert alone.logprobs == want[0].logprobs if params is SAMPLED else alone.logprobs is None
    assert alone.stats.speculative == NGRAM and 0 < alone.stats.accepted < alone.stats.drafted
    assert eng.steps < len(want[0].token_ids) + 2          # drafts saved forward passes
    # batched: sequences with drafts beside one that asked for none and one that prefills
    reqs[1].params.speculative = "off"
    eng = make_engine(loaded[family], "ngram", oracle, max_seqs=3, max_batch_tokens=24)
    sinks, _ = run_all(eng, reqs)
    for sink, w in zip(sinks, want):
        assert sink.result.token_ids == w.token_ids == sink.tokens
    assert sinks[1].result.stats.drafted == 0 and sinks[0].result.stats.accepted > 0
    assert eng.spec.accepted == sinks[0].result.stats.accepted


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reuse_and_the_stored_state_hold_accepted_tokens_only(loaded, family):
    """A second turn restores the first turn's end-of-generation snapshot, taken after drafts
    were rejected (past the sliding window too), and equals the plain cold run."""
    first = req(tokens(4, 20), 30)
    want1 = plain_runs(loaded[family], [first])[0]
    turn2 = req(first.prompt_ids + want1.token_ids[:-1] + tokens(5, 6), 20)
    want2 = plain_runs(loaded[family], [turn2])[0]
    oracle = Oracle([first.prompt_ids + want1.token_ids, turn2.prompt_ids + want2.token_ids], wrong=0.3, seed=3)
    eng = make_engine(loaded[family], "ngram", oracle)
    got1 = eng.generate(first)
    got2 = eng.generate(turn2)
    assert got1.token_ids == want1.token_ids and got2.token_ids == want2.token_ids
    assert got2.usage.cached_tokens == len(first.prompt_ids) + len(want1.token_ids) - 1
    assert got1.stats.accepted < got1.stats.drafted and got2.stats.accepted > 0


def test_ngram_drafts_a_repeated_text_and_changes_nothing(loaded):
    text = tokens(6, 24)
    r = req(text + text + text[:8], 48)
    want = plain_runs(loaded["full"], [r])[0]
    eng = make_engine(loaded["full"], "ngram")
    got = eng.generate(r)
    assert got.token_ids == want.token_ids
    assert got.stats.drafted > 0 and eng.spec.as_dict()["drafted"] == got.stats.drafted


def test_n_choices_and_request_fields(loaded):
    """n > 1 choices each draft on their own; a request turns speculation on over an engine
    default of off, and off over an engine default of ngram."""
    r = req(tokens(7, 25), 20, temperature=1.0, seed=3, n=3)
    want = make_engine(loaded["full"], budget=0).generate_choices(r)
    runs = [r.prompt_ids + w.token_ids for w in want]
    on = req(r.prompt_ids, 20, temperature=1.0, seed=3, n=3, speculative=NGRAM, draft_max=3)
    got = make_engine(loaded["full"], "off", Oracle(runs, 0.2)).generate_choices(on)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.stats.speculative == NGRAM and g.stats.drafted for g in got)
    off = req(r.prompt_ids, 5, speculative="off")
    assert make_engine(loaded["full"], NGRAM).generate(off).stats.speculative == "off"


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_and_always_wrong_drafts(loaded, data):
    family = data.draw(st.sampled_from(list(FAMILIES)))
    params = data.draw(st.sampled_from([GREEDY, SAMPLED]))
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    max_tokens = data.draw(st.integers(1, 24))
    r = req(prompt, max_tokens, **params)
    want = plain_runs(loaded[family], [r])[0].token_ids
    wrong = data.draw(st.booleans())
    rng = random.Random(data.draw(st.integers(0, 2 ** 16)))
    run = r.prompt_ids + want

    class Drafter:
        def draft(self, history, k):
            if wrong:       # never what plain decoding picks next (and all else random)
                return [(run[len(history)] + 1) % VOCAB] + [rng.randrange(VOCAB) for _ in range(k - 1)]
            return [rng.randrange(VOCAB) for _ in range(rng.randrange(k + 1))]

    eng = make_engine(loaded[family], "ngram", Drafter)
    got = eng.generate(r)
    assert got.token_ids == want
    if wrong:
        # a draft follows a decoded token only while the budget leaves room past it: the first
        # decode step (after token 1) drafts when max_tokens > 2
        assert got.stats.accepted == 0 and (got.stats.drafted > 0) == (len(want) > 1 and max_tokens > 2)


def test_draft_logits_run_the_head_on_the_rows_verification_reaches(loaded):
    """A verified chunk's rows get the lm_head a block at a time as verification asks for them
    (``DraftLogits``): after a rejection the rows past it are never computed, and every row
    computed is forward's logits row, bit for bit. Blocks are short where drafts fail, the whole
    chunk where they are taken whole."""
    net = loaded["full"].net
    chunk = torch.tensor(tokens(12, 8))

    def forward(head):
        caches = cache_specs.make_caches(net.cache_specs())
        with torch.inference_mode():
            return net.forward(Batch.build([(chunk, caches, ALL)], head=head))
    want, hidden = forward(True), forward(False)
    calls = []

    def head(x):
        calls.append(len(x))
        return net.head(x)
    failing, taking = Speculation(NGRAM, 8, NgramDrafter()), Speculation(NGRAM, 8, NgramDrafter())
    for _ in range(6):
        failing.record(8, 0)
        taking.record(8, 8)
    rows = DraftLogits(head, hidden, failing)
    assert torch.equal(rows[0], want[0]) and len(calls) == 1 and calls[0] < 4   # rejected at its first token: done
    assert all(torch.equal(rows[i], want[i]) for i in range(8)) and sum(calls) == 8
    calls.clear()
    rows = DraftLogits(head, hidden, taking)
    assert torch.equal(rows[0], want[0]) and calls == [8]
    assert head_blocks(8, 0.0) == {i: 1 for i in range(8)} and head_blocks(8, 1.0) == {0: 8}


def test_ngram_drafter_takes_the_longest_latest_match():
    d = NgramDrafter()
    h = [4, 2, 3, 9, 5, 5, 2, 3, 7, 1, 4, 2, 3]
    assert d.draft(h, 3) == [9, 5, 5]              # "4 2 3" beats the later but shorter "2 3"
    assert d.draft(h + [6], 3) == []               # "3 6" never seen (the index grows with the history)
    assert d.draft(h + [6, 9, 5], 2) == [5, 2]     # "9 5" once, then "6 9 5" unknown
    assert NgramDrafter().draft(h[:9] + [8, 2, 3], 3) == [7, 8, 2]   # "2 3" at its latest occurrence
    assert NgramDrafter().draft([5, 6, 5, 6], 4) == [5, 6]   # up to the end of the history


def test_ngram_drafter_follows_the_copy_it_drafted_from():
    """A copy of a text whose phrase comes again later in it: the latest occurrence of the last 4
    tokens is that later phrase, but the copy the last draft came from matches 6 tokens back, so
    the draft goes on from there; once the history leaves the copy, the lookup takes over."""
    src = [7, 10, 11, 12, 13, 14, 20, 21, 11, 12, 13, 14, 30, 7]
    d = NgramDrafter()
    assert d.draft(src + [10], 3) == [11, 12, 13]
    assert d.draft(src + [10, 11, 12, 13, 14], 3) == [20, 21, 11]
    assert NgramDrafter().draft(src + [10, 11, 12, 13, 14], 3) == [30, 7, 10]   # the lookup alone
    assert d.draft(src + [10, 11, 12, 13, 14, 20, 5], 2) == []    # left the copy: "20 5" never seen
    assert d.draft(src + [10, 11, 12, 13, 14, 20, 5, 11, 12, 13, 14], 2) == [20, 5]   # the lookup: the latest


@pytest.mark.parametrize("family", ["lfm2", "mamba2", "native"])
def test_speculation_is_off_where_it_cannot_be_exact(tiny_pair, family):
    """Families that load only with native float32 weights (LFM2's conv hybrid and Mamba 2 as
    built from transformers here, the tiny Llama under native GEMMs) are not chunk-invariant:
    PyTorch's GEMMs block a k-row chunk differently from one row, and the probe sees it. Each
    decodes plainly, says why in its stats, and gives the plain tokens."""
    import test_family_lfm2
    import test_family_mamba2
    from tiny import engine as tiny_engine
    from tiny import tiny_llama

    model = {"lfm2": lambda: tiny_pair(test_family_lfm2.tiny)[0],
             "mamba2": lambda: tiny_pair(test_family_mamba2.tiny)[0], "native": lambda: tiny_llama()[0]}[family]()
    why = "not_chunk_invariant"
    r = req([t % 256 for t in tokens(8, 20)], 12, **SAMPLED)
    want = tiny_engine(model, budget=0).generate(r)
    eng = tiny_engine(model, speculative=NGRAM)
    got = eng.generate(r)
    assert got.token_ids == want.token_ids and got.stats.speculative == f"off ({why})"
    assert eng.spec.off == {why: 1} and eng.spec.drafted == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_always_wrong_drafts_change_nothing(loaded, family):
    """Every draft wrong from its first token: each verify step keeps one token and cuts all the
    rest back (recurrent layers: the state after the step's first token, picked from the trail);
    alone and beside a sequence without drafts, greedy and seeded, with reuse on."""
    reqs = [req(tokens(10, 21), 16, **GREEDY), req(tokens(11, 12), 14, **SAMPLED)]
    want = plain_runs(loaded[family], reqs)
    runs = [r.prompt_ids + w.token_ids for r, w in zip(reqs, want)]

    class Wrong:
        def draft(self, history, k):
            run = next(r for r in runs if r[:len(history)] == history)
            return [(t + 1) % VOCAB for t in run[len(history):len(history) + k]]

    eng = make_engine(loaded[family], "ngram", Wrong, max_seqs=2)
    reqs[1].params.speculative = "off"
    sinks, _ = run_all(eng, reqs)
    assert [s.result.token_ids for s in sinks] == [w.token_ids for w in want]
    stats = sinks[0].result.stats
    assert stats.speculative == NGRAM and stats.drafted > 0 and stats.accepted == 0
    again = eng.generate(req(reqs[0].prompt_ids, 16, **GREEDY))       # restored from the first run
    assert again.token_ids == want[0].token_ids and again.usage.cached_tokens > 0


def test_a_recurrent_state_is_picked_back_at_any_verified_token():
    from turnkv.cache.recurrent import StateCache

    c = StateCache({"h": (2,), "conv": (1, 2)})
    c.set("h", torch.ones(2))
    c.advance(1)
    c.keep_trail()
    for j in range(3):                              # a 3-token chunk, run a token at a time
        c.set("h", torch.full((2,), 10.0 + j))
        c.set("conv", torch.full((1, 2), 20.0 + j))
        c.advance(1)
    assert [c.can_truncate_to(n) for n in range(6)] == [False, False, True, True, True, False]
    c.truncate(3)                                   # two of the three tokens kept
    assert c.offset == 3 and c.state["h"].tolist() == [11.0, 11.0] and c.state["conv"].tolist() == [[21.0, 21.0]]
    assert c.trail is None and not c.can_truncate_to(2)
    c.keep_trail()
    c.set("h", torch.zeros(2))                      # one write for two tokens: no state per token
    c.set("conv", torch.zeros(1, 2))
    c.advance(2)
    assert not c.can_truncate_to(4) and c.can_truncate_to(5)
    c.truncate(5)                                   # the current length: only ends the trail
    assert c.trail is None and c.offset == 5


def test_server_request_field_stats_and_metrics(loaded):
    """Over HTTP: the body field turns drafts on, the reply is the plain one, and the timings,
    /v1/cache/stats and /metrics count the drafts."""
    import httpx
    from test_server_faults import Running

    text = tokens(9, 20)
    prompt = text + text + text[:6]
    srv = Running(make_engine(loaded["full"], budget=0, tokenizer=loaded["full"].tokenizer))
    try:
        def complete(**extra):
            body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True, **extra}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()

        plain, drafted = complete(), complete(speculative="ngram", draft_max=4)
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"] != ""
        t = drafted["timings"]
        assert t["speculative"] == "ngram" and 0 < t["accepted_tokens"] <= t["drafted_tokens"]
        assert plain["timings"]["speculative"] == "off" and plain["timings"]["drafted_tokens"] == 0
        stats = httpx.get(srv.url + "/v1/cache/stats", timeout=30).json()["speculative"]
        assert stats["drafted"] == t["drafted_tokens"] and stats["accepted"] == t["accepted_tokens"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert f'turnkv_spec_draft_tokens_total{{kind="ngram"}} {float(t["drafted_tokens"])}' in metrics
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "speculative": "mtp"}, timeout=30)
        assert bad.status_code == 400
    finally:
        srv.close()


def test_drafting_backs_off_when_drafts_fail_and_recovers():
    """Drafts that fail back drafting off to none at all; backed off, the drafter's guess is
    checked against the token plain decoding takes (nothing verified), and drafting resumes once
    the guesses come right. Then a draft taken whole climbs a rung, and a rejection comes down."""
    class Always:
        def draft(self, history, k):
            return [0] * k

    spec = Speculation(NGRAM, 8, Always())
    history, drafted_steps = [5], 0
    for _ in range(200):
        draft = spec.propose(history, 8)
        drafted_steps += bool(draft)
        if draft:
            spec.record(len(draft), 0)
        history.append(1)                  # what plain decoding takes: never the guess
    assert drafted_steps <= 4 and spec.length == 0 and spec.shadow == 0
    waited = 0
    while not (draft := spec.propose(history, 8)):
        history.append(0)                  # now the guess is right
        waited += 1
    assert waited <= 3 and draft == [0] and spec.drafted < 12
    spec.record(1, 1)                      # taken whole: a rung up (1 -> 3)
    assert spec.length == 3 and spec.propose(history, 8) == [0, 0, 0]
    spec.record(3, 3)
    assert spec.length == 7
    spec.record(7, 7)          # at draft_max 8 no climb: 9 rows cost a 16-row step (CHUNK_COST), 8 an 8-row one
    assert spec.length == 7 and len(spec.propose(history, 8)) == 7
    spec.record(7, 0)                      # rejected whole: down to the rung below half
    assert spec.length == 3


@pytest.mark.parametrize("delay", ["work", "wait"])
def test_drafts_shorten_when_multi_row_steps_cost_more(loaded, monkeypatch, delay):
    """Draft lengths follow the step costs the engine measures on its own steps, by its
    thread's CPU time: with the forward made slower by 20 ms of CPU time a row past the first
    (real work inside the steps), a multi-row step measures many one-row steps' time, so drafts
    get shorter than the prior costs make them and drafting backs off to probes. The same 20 ms
    spent waiting (a sleep: what a busy core's wait for the CPU looks like to the wall clock) is
    not a cost: every multi-row step's time leaves out the 20-60 ms it slept, where the wall clock
    has all of it (a ratio of costs would not tell them apart on every machine: the tiny model's
    one-row step is ~0.2 ms of CPU, and waking the kernel threads after a sleep costs a 2-row step
    a few of those). The tokens stay the plain ones."""
    model = loaded["full"]
    r = req(tokens(13, 20), 80)
    want = plain_runs(model, [r])[0]
    oracle = Oracle([r.prompt_ids + want.token_ids], wrong=0.2, seed=5)

    class Gappy:        # no draft at every third position: one-row steps, as lookups that miss give
        def draft(self, history, k):
            return [] if len(history) % 3 == 0 else oracle.draft(history, k)

    prior = make_engine(model, "ngram", Gappy)
    got = prior.generate(r)
    assert got.token_ids == want.token_ids and prior.spec.accepted > 0
    forward, slow = model.net.forward, burn if delay == "work" else time.sleep

    def slow_forward(batch):
        slow(0.02 * (batch.tokens.shape[0] - 1))
        return forward(batch)

    monkeypatch.setattr(model.net, "forward", slow_forward)
    slowed = make_engine(model, "ngram", Gappy, measured=True)
    got = slowed.generate(r)
    assert got.token_ids == want.token_ids
    costs = slowed.spec.costs
    assert costs.measured(1) is not None
    if delay == "wait":
        slept = [t for rows, got in costs.times.items() if rows > 1 for t in got]
        assert slept and max(slept) < 0.01, costs.times
        return
    assert costs.cost(2) > 2 * CHUNK_COST[2] and costs.cost(4) > 2 * CHUNK_COST[4]
    mean = {e: e.spec.drafted / e.spec.verify_steps for e in (prior, slowed)}
    assert mean[slowed] < mean[prior] and slowed.spec.drafted < prior.spec.drafted / 2, (prior.spec, slowed.spec)


def test_a_lucky_guess_in_prose_does_not_pay_for_a_draft():
    """Prose (docs/speculative.md, "Back-off"): the drafter's guesses almost never come true.
    Backed off, the acceptance estimate follows the checked guesses down past the 1/7 floor the
    old estimate kept, so one lucky guess among misses leaves drafting off (a two-row step at
    the engine's measured costs would not pay at the estimate it gives), while guesses that
    keep coming true (a copy starting) bring drafts back within two steps. A row count not yet
    measured is priced by its prior scaled as the measured smaller one stands to its own."""
    costs = StepCosts()
    for rows, ms in ((1, 6.0), (2, 6.6), (4, 8.4), (8, 13.8)):     # SmolLM2 at 1 thread, quiet
        for _ in range(5):
            costs.observe(rows, ms / 1000)

    class Echo:     # guesses the token before the last again: right only where the text repeats
        def draft(self, history, k):
            return history[-2:-1] * k

    spec = Speculation(NGRAM, 7, Echo(), costs)
    history = [1, 2]
    drafts = 0
    for t in range(3, 200):
        drafts += bool(spec.propose(history, 7))
        history.append(t if t % 50 else history[-2])      # a guess comes true every 50 tokens
        if spec.length:
            spec.record(1, 0)
    assert spec.token_acceptance() < 1 / 7 and drafts <= 3, (spec.token_acceptance(), drafts)
    busy = StepCosts()          # only one-row and two-row steps measured yet, on a busy core
    for rows, ms in ((1, 6.0), (2, 8.6)) * 3:
        busy.observe(rows, ms / 1000)
    assert busy.cost(4) == pytest.approx(CHUNK_COST[4] * busy.cost(2) / CHUNK_COST[2]) and busy.cost(4) > busy.cost(2)
    for _ in range(3):                                      # a copy: every guess right
        if spec.propose(history, 7):
            break
        history.append(history[-2])
    assert spec.length >= 1


def test_head_blocks_follow_the_measured_head_calls(loaded):
    """Verification's head calls are timed (``DraftLogits``) and the blocks it cuts follow what
    they cost (``StepCosts.head_costs``) once each size has a few calls, not the prior table:
    where a block of 4 rows measures 4 one-row calls' time, a draft that is likely taken whole
    runs its head in blocks of 2 or 1 instead of one 4-row call; the rows are the same bits."""
    net = loaded["full"].net
    chunk = torch.tensor(tokens(14, 4))
    caches = cache_specs.make_caches(net.cache_specs())
    with torch.inference_mode():
        hidden = net.forward(Batch.build([(chunk, caches, ALL)], head=False))
        want = net.head(hidden)
    costs = StepCosts()
    spec = Speculation(NGRAM, 3, NgramDrafter(), costs)
    for _ in range(6):
        spec.record(3, 3)
    assert DraftLogits(net.head, hidden, spec).blocks == {0: 4}       # the prior: 4 rows ~ one row
    def slow_four(x):     # rows at 1 ms each (a tiny head's own time is noise), a 4-row call at 20 ms
        burn(0.02 if len(x) == 4 else 0.001 * len(x))
        return net.head(x)
    for _ in range(5):      # real head calls, timed; a 4-row call made slow (20 ms of CPU time, 5x 4 rows')
        for n in (1, 2, 4):
            rows = DraftLogits(slow_four, hidden[:n], spec)
            assert torch.equal(torch.stack([rows[i] for i in range(n)]), want[:n])
    measured = dict(costs.head_costs())
    assert measured[4] > 3 and costs.as_dict()["head"]["4"] == measured[4], costs.head_times
    rows = DraftLogits(net.head, hidden, spec)
    assert 4 not in rows.blocks.values() and all(torch.equal(rows[i], want[i]) for i in range(4))


class Forcing:
    """A grammar's two answers to the drafts (``grammar.Matcher``): the tokens it forces next,
    and how many of a draft it allows. The real matcher's drafts: test_speculative_real.py."""

    def __init__(self, forced: list[int], valid: int = 99):
        self.tokens, self.allowed = forced, valid

    def forced(self) -> list[int]:
        return list(self.tokens)

    def valid(self, tokens: list[int]) -> int:
        return min(len(tokens), self.allowed)


def test_forced_tokens_draft_the_cheapest_split_and_count_as_their_own_kind():
    """Where a grammar forces tokens they are the draft, whatever the drafter's back-off: the
    first step of the cheapest way through their run at the costs in use (taken as certain);
    their counts leave the drafter's acceptance and length alone. Where it forces none, the
    drafter's draft is cut at the first token it refuses."""
    prior = StepCosts(window=0)        # 2 / 4 / 8 rows: 1.09 / 1.30 / 2.06 one-row steps
    assert [prior.split(n, 8) for n in (2, 3, 5, 6, 20)] == [2, 3, 5, 6, 8]    # 5 rows: 2.06 < 4 + 1 rows' 2.30
    assert prior.split(6, 4) == 4
    long = StepCosts()                 # measured at 3k tokens of context (SmolLM2's agent steps)
    for rows, cost in ((1, 1.0), (2, 1.37), (4, 2.31), (8, 4.12)) * 3:
        long.observe(rows, cost / 1000)
    assert [long.split(n, 8) for n in (5, 6, 8)] == [4, 4, 8]     # 6 rows: 4 + 2 rows (3.68) < one 8-row step (4.12)
    spec = Speculation(NGRAM, 7, Oracle([[1, 2, 3, 4, 5, 6]], wrong=1.0), prior)
    p, length = spec.token_acceptance(), spec.length
    assert spec.propose([1, 2], 7, Forcing([9, 8, 7, 6, 5, 4, 3, 2, 1])) == [9, 8, 7, 6, 5, 4, 3]
    assert spec.record(7, 5) == FORCED and (spec.forced_drafted, spec.forced_accepted, spec.drafted) == (7, 5, 7)
    assert (spec.token_acceptance(), spec.length, spec.forced) == (p, length, 0)
    assert spec.propose([1, 2], 3, Forcing([9, 8, 7, 6, 5])) == [9, 8, 7]    # the room left in the step
    spec.record(3, 3)
    assert spec.propose([1, 2], 7, Forcing([], valid=1)) == [4]          # the drafter's (wrong) draft, cut
    assert spec.record(1, 0) == NGRAM and spec.token_acceptance() < p and spec.forced_drafted == 10
    assert spec.kinds == {FORCED: [10, 8], NGRAM: [1, 0]}          # by kind: the grammar's, the drafter's
