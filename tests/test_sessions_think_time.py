"""Sessions survive think time: under memory pressure the earlier checkpoints of every session go
before any session's newest entry, an evicted newest entry is on disk (written behind, or spilled
at eviction when its write was dropped), and the cache counts where each resume got its state.

The engine tests run 4 sessions round robin on a tiny Llama with a memory budget that holds about
2 of them and a disk tier; each turn is compared with a cold engine (prompt cache off)."""

from __future__ import annotations

import threading
import time

import pytest

from test_prompt_cache import FP, Live, ns
from test_tiers import REPLY, Chat, disk, settle, tiered
from tiny import engine, tiny_llama
from turnkv.prompt_cache.disk_tier import DiskTier
from turnkv.prompt_cache.store import PromptCache
from turnkv.prompt_cache.tiered import TieredPromptCache

THINK_S = 0.05         # the think time between a reply and the session's next turn, short for tests
SESSIONS, TURNS = 4, 3


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()[0]


def play_round_robin(eng, cold, turns=TURNS):
    """Every session's turns in round robin with a think gap (the lower tiers' writes land in it).
    Returns, per session, the (prompt length before the turn, result) of each turn."""
    chats = [Chat(10 + i, cold) for i in range(SESSIONS)]
    played = [[] for _ in chats]
    for _ in range(turns):
        for i, chat in enumerate(chats):
            before = chat.length
            played[i].append((before, chat.turn(eng)))       # equal to the cold engine's (Chat.turn)
            time.sleep(THINK_S)
            if isinstance(eng.prompt_cache, TieredPromptCache) and eng.prompt_cache.tiers:
                settle(eng)
    return chats, played


def two_sessions_budget(llama, cold) -> int:
    """Bytes that hold about 2 sessions' final state (measured on a session played alone)."""
    probe = tiered(llama, lambda fp: [])
    chat = Chat(99, cold)
    for _ in range(TURNS):
        chat.turn(probe)
    return int(2.3 * probe.prompt_cache.stats()["bytes"])


def test_four_sessions_over_a_two_session_budget_resume_from_disk(llama, tmp_path):
    cold = engine(llama, budget=0)
    budget = two_sessions_budget(llama, cold)
    eng = tiered(llama, disk(tmp_path), budget=budget)
    chats, played = play_round_robin(eng, cold)
    stats = eng.prompt_cache.stats()
    assert stats["head_evictions"] > 0 and stats["bytes"] <= budget
    for turns in played:
        for (before, res), (prev_before, prev) in zip(turns[1:], turns):
            # the whole history the previous turn ended with is restored (the reply's last token
            # was sampled, never fed)
            assert res.usage.cached_tokens >= before - 1, (res.usage, before)
    resumes = stats["resumes"]
    assert sum(resumes.values()) == SESSIONS * (TURNS - 1)
    assert resumes["prefill"] == 0 and resumes["redis"] == 0
    assert resumes["disk"] >= SESSIONS          # round robin over 4 with room for 2: each came back from disk
    assert stats["tiers"]["disk"]["hits"] == resumes["disk"]
    # one more turn right away: the session's state was promoted into memory, a memory resume
    memory_before = resumes["memory"]
    res = chats[-1].turn(eng)
    after = eng.prompt_cache.stats()["resumes"]
    assert after["memory"] == memory_before + 1 and res.usage.cached_tokens >= chats[-1].length - REPLY - 12 - 1


def test_without_a_disk_tier_the_evicted_sessions_prefill_again(llama):
    """The control: the same sessions and budget with memory only lose their state to eviction,
    and the resumes say so."""
    cold = engine(llama, budget=0)
    budget = two_sessions_budget(llama, cold)
    eng = tiered(llama, lambda fp: [], budget=budget)
    _, played = play_round_robin(eng, cold)
    resumes = eng.prompt_cache.stats()["resumes"]
    assert resumes["prefill"] >= SESSIONS and resumes["disk"] == 0
    assert sum(resumes.values()) == SESSIONS * (TURNS - 1)
    assert any(res.usage.cached_tokens < before - 1 for turns in played for before, res in turns[1:])


def test_earlier_checkpoints_go_before_any_sessions_newest_entry():
    """Sessions a and b each hold an earlier checkpoint and a newest entry (with logits, so the
    newest does not subsume the earlier). Over budget, both earlier checkpoints go first, even
    the one used more recently than a's newest entry."""
    heads, olds = {}, {}
    for name, tok in (("a", 5), ("b", 6)):
        live = Live("full", heads=4, block=4)
        old = live.extend([tok] * 10).snap(logits=True)
        olds[name] = (list(live.tokens), old)
        heads[name] = (list(live.tokens + [tok] * 6), live.extend([tok] * 6).snap(logits=True))
    other_tokens = [9] * 14
    other = Live("full", heads=4, block=4).extend(other_tokens).snap(logits=True)
    size = sum(s.nbytes for _, s in heads.values()) + other.nbytes
    pc = PromptCache(size + 8)
    for name in ("a", "b"):
        assert pc.insert(ns(), *olds[name]) and pc.insert(ns(), *heads[name])
    assert pc.lookup(ns(), olds["b"][0]) is not None      # b's earlier checkpoint is used last
    assert pc.insert(ns(), other_tokens, other)
    st = pc.stats()
    assert st["evictions"] == 2 and st["head_evictions"] == 0
    for name in ("a", "b"):
        assert pc.lookup(ns(), heads[name][0]).entry_length == len(heads[name][0])
        assert pc.lookup(ns(), olds[name][0]).entry_length == len(heads[name][0])   # served by the head


def test_a_newest_entry_whose_write_was_dropped_spills_at_eviction(tmp_path):
    """The writer is stuck and the write-behind queue (one job) drops b's newest entry; when
    memory must let it go, it is queued again (spilled) instead of vanishing, and then loads from
    disk. a's entries were written behind and leave memory without a second write."""
    release = threading.Event()

    class StuckDisk(DiskTier):
        def put(self, enc):
            release.wait(60)
            return super().put(enc)

    def live(tok, n):
        lv = Live("full", heads=4, block=64).extend([tok] * n)     # the engine's block: the tiers index by it
        return list(lv.tokens), lv.snap(logits=True)

    # past one 64-token boundary: a lower tier indexes entries by their boundaries
    a_old, a_head, b_head, other = live(5, 70), live(5, 80), live(6, 80), live(9, 160)
    cache = TieredPromptCache(other[1].nbytes + 8, [StuckDisk(tmp_path, FP, 1 << 30)], slack=1, queue_size=1)
    assert cache.insert(ns(), *a_old)
    deadline = time.monotonic() + 10
    while cache.stats()["tiers"]["write_behind"]["depth"] and time.monotonic() < deadline:
        time.sleep(0.01)       # the writer took a_old and hangs in put: the queue is empty again
    assert cache.insert(ns(), *a_head) and cache.insert(ns(), *b_head)
    wb = cache.stats()["tiers"]["write_behind"]
    assert (wb["queued"], wb["dropped"]) == (2, 1)          # b's newest entry was not written
    release.set()
    assert cache.flush(timeout=60)
    assert cache.insert(ns(), *other)                      # a's two entries and b's go
    st = cache.stats()
    assert st["evictions"] == 3 and st["head_evictions"] == 2
    assert st["tiers"]["write_behind"]["spilled"] == 1     # only b's: a's newest was written already
    assert cache.flush(timeout=60)
    fresh = TieredPromptCache(1 << 30, [DiskTier(tmp_path, FP, 1 << 30)], slack=1)
    for tokens, _ in (a_head, b_head):
        hit = fresh.lookup(ns(), tokens + [1])
        assert hit is not None and hit.usable == len(tokens) and hit.origin.startswith("disk:"), (len(tokens), tokens[0], fresh.stats()["tiers"])
