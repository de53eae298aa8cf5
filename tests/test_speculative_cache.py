"""The ``cache`` drafter and ``auto`` (docs/speculative.md, "Drafts from earlier requests"): a
request that repeats an earlier one of its tenant (a regenerate, a retry, a replayed agent step)
drafts what followed its context there, out of the prompt cache's stored paths, and its tokens
stay plain decoding's: off, cache and auto give the same ids, greedy and seeded, alone, batched
and with reuse; another tenant's paths are never drafted from. Real engines on the tests' tiny
families (test_speculative.py's table), real prompt caches."""

from __future__ import annotations

import threading
import time

import pytest

from test_engine_batching import run_all
from test_speculative import FAMILIES, GREEDY, SAMPLED, loaded, make_engine, plain_runs, req, tokens  # noqa: F401
from turnkv.engine.drafters import AUTO, AUTO_PENDING, CACHE, MODES, NGRAM, CacheDrafter

ROWS = ["full", "sliding", "hybrid", "rwkv7"]      # full attention, a window, a hybrid, recurrent state alone


@pytest.mark.parametrize("family", ROWS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_retry_drafts_the_earlier_reply_whole_and_changes_nothing(loaded, family, params):
    want = plain_runs(loaded[family], [req(tokens(21, 30), 24, **params)])[0]
    for mode in (CACHE, AUTO):
        eng = make_engine(loaded[family], mode)
        first, again = (eng.generate(req(tokens(21, 30), 24, **params)) for _ in range(2))
        assert first.token_ids == again.token_ids == want.token_ids
        assert first.logprobs == again.logprobs == want.logprobs
        assert CACHE not in first.stats.drafts             # nothing stored before the first
        cache = again.stats.drafts[CACHE]
        # the stored path is the prompt and every token but the last (its state is not computed);
        # draft lengths climb 3, 7, 7 .. from the first decode step (the budget cuts the last)
        assert cache["accepted"] == cache["drafted"] >= len(want.token_ids) - 6
        assert eng.steps < 2 * len(want.token_ids) - 10            # the retry took 6 steps, not 23
        assert again.stats.speculative == mode and eng.spec.as_dict()["kinds"][CACHE]["acceptance_rate"] == 1.0


def test_off_cache_and_auto_agree_batched_and_with_reuse(loaded):
    """A retry beside a new request and a second turn (restored from the first's stored state):
    every mode gives the cold plain runs' ids; the retry drafts from the cache, the others as
    far as their own text goes."""
    model = loaded["hybrid"]
    first = req(tokens(22, 25), 20)
    want1 = plain_runs(model, [first])[0]
    turn2 = req(first.prompt_ids + want1.token_ids[:-1] + tokens(23, 5), 18, **SAMPLED)
    other = req(tokens(24, 12), 16, **GREEDY)
    want = plain_runs(model, [first, turn2, other])
    for mode in ("off", CACHE, AUTO):
        eng = make_engine(model, mode, max_seqs=3, max_batch_tokens=24)
        assert eng.generate(first).token_ids == want1.token_ids
        sinks, _ = run_all(eng, [req(first.prompt_ids, 20), turn2, other])
        assert [s.result.token_ids for s in sinks] == [w.token_ids for w in want]
        assert sinks[1].result.usage.cached_tokens == len(first.prompt_ids) + len(want1.token_ids) - 1
        if mode != "off":
            assert sinks[0].result.stats.drafts[CACHE]["accepted"] > 0


def test_another_tenants_reply_is_never_drafted(loaded):
    """Tenant a's reply is in the cache; tenant b's identical request drafts nothing from it (its
    namespace holds no path), and gets the same tokens; a's retry drafts it."""
    model = loaded["full"]
    r = req(tokens(25, 20), 20)
    want = plain_runs(model, [r])[0]
    eng = make_engine(model, CACHE)
    r.tenant = "a"
    assert eng.generate(r).token_ids == want.token_ids
    b = req(r.prompt_ids, 20)
    b.tenant = "b"
    got = eng.generate(b)
    assert got.token_ids == want.token_ids and got.stats.drafted == 0 and got.stats.drafts == {}
    a = req(r.prompt_ids, 20)
    a.tenant = "a"
    assert eng.generate(a).stats.drafts[CACHE]["accepted"] > 0
    history = r.prompt_ids + want.token_ids[:3]
    assert eng.prompt_cache.continuation(eng.namespace("a"), history) is not None
    assert CacheDrafter(eng.prompt_cache, eng.namespace("c")).draft(history, 4) == []


def test_a_shorter_stored_reply_drafts_up_to_its_end(loaded):
    """The stored path ends before the new request does: the cache drafts to its end (a last
    draft shorter than asked), then has nothing; auto's ngram takes over. Tokens unchanged."""
    model = loaded["full"]
    short, longer = req(tokens(26, 20), 8), req(tokens(26, 20), 30)
    want = plain_runs(model, [longer])[0]
    eng = make_engine(model, AUTO)
    eng.generate(short)
    path = tuple(short.prompt_ids + want.token_ids[:7])                 # its stored path
    drafter = CacheDrafter(eng.prompt_cache, eng.namespace())
    assert drafter.draft(list(path[:-2]), 5) == list(path[-2:])     # what is left of it
    assert drafter.draft(list(path), 5) == [] and drafter.missed == eng.prompt_cache.version(eng.namespace())
    got = eng.generate(longer)
    assert got.token_ids == want.token_ids
    assert 0 < got.stats.drafts[CACHE]["drafted"] <= 8 - 2


def test_server_reports_drafts_by_kind(loaded):
    """Over HTTP with ``auto``: the retry's timings, /v1/cache/stats and /metrics count the cache's
    drafts under their kind, the ngram's under theirs."""
    import httpx
    from test_server_faults import Running

    text = tokens(27, 16)
    srv = Running(make_engine(loaded["full"], tokenizer=loaded["full"].tokenizer))
    try:
        def complete():
            body = {"prompt": text + text + text[:5], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "speculative": AUTO}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()

        first, again = complete(), complete()
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        t = again["timings"]
        assert t["speculative"] == AUTO and t["drafts"][CACHE]["accepted"] > 0
        assert first["timings"]["drafts"][NGRAM]["drafted"] > 0 and CACHE not in first["timings"]["drafts"]
        kinds = httpx.get(srv.url + "/v1/cache/stats", timeout=30).json()["speculative"]["kinds"]
        assert kinds[CACHE]["drafted"] == t["drafts"][CACHE]["drafted"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert f'turnkv_spec_accepted_tokens_total{{kind="cache"}} {float(t["drafts"][CACHE]["accepted"])}' in metrics
        assert 'turnkv_spec_draft_tokens_total{kind="ngram"}' in metrics
    finally:
        srv.close()


def test_auto_as_served_checks_when_idle_and_no_request_waits(loaded):
    """`turnkv serve`'s default (launch.py sets ``idle_check``): auto runs no exactness check on a
    request's behalf: a request before the engine was ever idle decodes plainly (its stats say
    why), the engine's loop runs the check in its first idle moment, and the same request then
    drafts (from the cache: a retry) with the same ids."""
    eng = make_engine(loaded["full"], AUTO)
    eng.idle_check = lambda: True
    r = req(tokens(28, 30), 24, **GREEDY)
    first = eng.generate(r)
    assert first.stats.speculative == f"off ({AUTO_PENDING})" and not first.stats.drafts
    assert eng._spec_block is None and eng.spec.off == {AUTO_PENDING: 1}      # not checked on its behalf
    stop = threading.Event()
    loop = threading.Thread(target=eng.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 120
        while eng._spec_block is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join()
    assert eng._spec_block == ""                    # checked, idle, and it passed
    again = eng.generate(r)
    assert again.token_ids == first.token_ids and again.stats.speculative == AUTO
    assert again.stats.drafts[CACHE]["accepted"] > 0


def test_the_modes_are_listed_alike():
    from typing import get_args

    from turnkv.server.schemas import CompletionRequest
    field = CompletionRequest.model_fields["speculative"].annotation
    assert {v for arg in get_args(field) for v in get_args(arg)} == set(MODES)
    assert set(FAMILIES) >= set(ROWS)
