"""The disk and Redis tiers of the prompt cache, in process, on tiny random models.

Every test compares against a cold engine (prompt cache off) on the same token history: a
conversation continued from disk after a "restart" (a new engine and cache on the same folder), or
on another replica through Redis, must give the same greedy tokens and first-token logits within
float tolerance, and must report the restored history as cached. Faults (a flipped byte, a
truncated file, another format version or model, a full budget, Redis down, slow or restarted)
must give the cold answer and a counted reason.
"""

from __future__ import annotations

import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from redis_server import RedisServer, require_redis
from ssm_family_checks import save_and_load
from tiny import VOCAB, engine, request, tiny_gemma3, tiny_llama
from turnkv.cache.serialize import BLOCK_MAGIC, FORMAT_VERSION, MANIFEST_MAGIC, Manifest, seal, unseal
from turnkv.engine.engine import Engine
from turnkv.prompt_cache.disk_tier import DiskTier
from turnkv.prompt_cache.store import PromptCache
from turnkv.prompt_cache.tiered import TieredPromptCache

ATOL = 1e-4
SYSTEM, USER, REPLY = 100, 12, 6


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(0)
    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2,
        conv_kernel=4, num_hidden_layers=3, chunk_size=32, use_bias=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def _lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM
    torch.manual_seed(0)
    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3], conv_L_cache=3, conv_bias=True,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    torch.manual_seed(0)
    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=16, no_rope_layer_interval=2, floor_scale=8,
        max_position_embeddings=4096))


# family -> (how to build it, engine options)
FAMILIES = {
    "llama": (lambda tmp: tiny_llama()[0], {}),
    "llama-int8": (lambda tmp: tiny_llama()[0], {"kv_mode": "int8"}),
    "gemma3-ring": (lambda tmp: tiny_gemma3(window=16)[0], {}),          # the ring wraps after 16 tokens
    "llama4-chunked": (lambda tmp: save_and_load(_llama4(), tmp), {}),
    "mamba2-recurrent": (lambda tmp: save_and_load(_mamba2(), tmp), {}),
    "lfm2-hybrid": (lambda tmp: save_and_load(_lfm2(), tmp), {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built: dict = {}

    def get(name):
        if name not in built:
            make, kw = FAMILIES[name]
            built[name] = (make(tmp_path_factory.mktemp(name.split("-")[0])), kw)
        return built[name]
    return get


def tiered(model, tiers, queue_size: int = 64, budget: int = 1 << 30, **kw) -> Engine:
    """An engine whose prompt cache has lower tiers; ``tiers(fingerprint)`` builds them."""
    cache = TieredPromptCache(budget, [], slack=8, queue_size=queue_size)
    eng = Engine(model, None, fingerprint=f"tiny-{model.family}", prompt_cache=cache, slack=8,
                 prefill_chunk=32, max_context=4096, **kw)
    cache.attach(tiers(eng.fingerprint), eng.family, eng.device)
    return eng


def disk(path, budget: int = 1 << 30):
    return lambda fp: [DiskTier(path, fp, budget)]


def redis_tier(url, budget: int = 1 << 30, timeout_s: float = 0.5):
    from turnkv.prompt_cache.redis_tier import RedisTier
    return lambda fp: [RedisTier(url, fp, budget, timeout_s=timeout_s)]


def same(a, b):
    assert a.token_ids == b.token_ids
    assert torch.allclose(a.first_logits, b.first_logits, atol=ATOL), (a.first_logits - b.first_logits).abs().max()


class Chat:
    """One conversation's token history; ``turn`` plays the next user message on ``eng`` and on the
    cold engine and checks they agree."""

    def __init__(self, seed: int, cold: Engine, system: list[int] | None = None, tenant: str = ""):
        self.rng = random.Random(seed)
        self.cold, self.tenant = cold, tenant
        self.history = [system or self.msg(SYSTEM)]

    def msg(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def turn(self, eng: Engine):
        self.history.append(self.msg(USER))
        res = eng.generate(request(self.history, REPLY, tenant=self.tenant))
        same(res, self.cold.generate(request(self.history, REPLY, tenant=self.tenant)))
        self.history.append(res.token_ids[:-1])
        return res

    @property
    def length(self) -> int:
        return sum(len(m) for m in self.history)


def settle(eng: Engine) -> dict:
    assert eng.prompt_cache.flush(timeout=60)
    return eng.prompt_cache.stats()["tiers"]


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("family", list(FAMILIES))
def test_restart_then_continue_equals_cold(models, family, tmp_path):
    model, kw = models(family)
    chat = Chat(1, engine(model, budget=0, **kw))
    a = tiered(model, disk(tmp_path), **kw)
    for _ in range(3):
        chat.turn(a)
    assert settle(a)["disk"]["writes"] >= 1
    a.prompt_cache.close()
    before = chat.length
    b = tiered(model, disk(tmp_path), **kw)                 # the restarted server: empty memory
    res = chat.turn(b)
    assert res.usage.cached_tokens >= before - REPLY, (res.usage, before)
    stats = settle(b)["disk"]
    assert stats["hits"] == 1 and stats["tokens_reused"] == res.usage.cached_tokens and not stats["refusals"]
    for _ in range(2):
        res = chat.turn(b)
        assert res.usage.cached_tokens >= 0.8 * res.usage.prompt_tokens


def test_blocks_shared_between_conversations_are_stored_once(models, tmp_path):
    model, _ = models("llama")
    cold = engine(model, budget=0)
    system = random.Random(9).choices(range(3, VOCAB), k=192)    # three whole 64-token blocks
    a = tiered(model, disk(tmp_path))
    one, two = Chat(1, cold, system), Chat(2, cold, system)
    one.turn(a)
    settle(a)
    blocks_one = a.prompt_cache.tiers[0].usage()["blocks"]
    two.turn(a)
    blocks_two = settle(a)["disk"]["blocks"]
    n_layers = len(a.specs)
    # the second conversation adds only its own full blocks past the shared 192 tokens
    assert blocks_two - blocks_one == n_layers * ((two.length - REPLY + 1) // 64 - 3)
    assert blocks_one == n_layers * ((one.length - REPLY + 1) // 64)


def test_namespaces_hold_on_disk(models, tmp_path):
    model, _ = models("llama")
    cold = engine(model, budget=0)
    a = tiered(model, disk(tmp_path))
    chat = Chat(3, cold, tenant="alice")
    chat.turn(a)
    settle(a)
    b = tiered(model, disk(tmp_path))
    bob = Chat(3, cold, tenant="bob")     # the same tokens, another tenant
    bob.history = [list(m) for m in chat.history]
    assert bob.turn(b).usage.cached_tokens == 0
    assert chat.turn(b).usage.cached_tokens > 0
    # another KV mode is another namespace too
    c = tiered(model, disk(tmp_path), kv_mode="int8")
    other = Chat(4, engine(model, budget=0, kv_mode="int8"), tenant="alice")
    other.history = [list(m) for m in chat.history]
    assert other.turn(c).usage.cached_tokens == 0


def test_lower_tiers_keep_the_newest_turns_of_a_ring_conversation(models, tmp_path):
    """Gemma's rings cannot be truncated, so every turn's entry would stay and their windows
    together cover the conversation. A lower tier keeps the newest turn and the end of the one
    before (keep_turns=1, the default): fewer bytes than keeping all (keep_turns=0, written side
    by side from the same engine), and after a restart the next turn and a regenerated reply still
    come from disk, equal to cold; an edit of an old turn prefills and equals cold."""
    model, _ = models("gemma3-ring")
    cold = engine(model, budget=0)
    chat = Chat(11, cold)
    newest, every = tmp_path / "newest", tmp_path / "every"
    a = tiered(model, lambda fp: [DiskTier(newest, fp, 1 << 30), DiskTier(every, fp, 1 << 30, keep_turns=0)])
    ends = []
    for _ in range(6):
        chat.turn(a)
        ends.append(chat.length)        # the reply's tokens end here (the last sampled one is not in the KV)
    settle(a)
    kept, all_ = (t.usage() for t in a.prompt_cache.tiers)
    old_turns = a.prompt_cache.tiers[0].stats()["old_turns"]
    assert old_turns > 0 and a.prompt_cache.tiers[1].stats()["old_turns"] == 0
    assert kept["entries"] < all_["entries"] and kept["bytes"] < 0.6 * all_["bytes"], (kept, all_)
    lengths = sorted(len(e.manifest.tokens) for e in a.prompt_cache.tiers[0]._entries.values())
    assert lengths[0] >= ends[-2] - 1, (lengths, ends)     # nothing older than the previous turn's end
    a.prompt_cache.close()

    b = tiered(model, disk(newest))                 # restarted on the folder that kept the newest turns
    regen = Chat(11, cold)
    regen.history = [list(m) for m in chat.history[:-1]]     # the last reply dropped: regenerate it
    res = b.generate(request(regen.history, REPLY))
    same(res, cold.generate(request(regen.history, REPLY)))
    assert res.usage.cached_tokens >= ends[-2] - 1
    assert chat.turn(b).usage.cached_tokens >= ends[-1] - 1           # the next turn
    c = tiered(model, disk(newest))
    edit = Chat(12, cold)
    edit.history = [list(m) for m in chat.history[:3]] + [edit.msg(USER)]   # turn 2's message edited
    res = c.generate(request(edit.history, REPLY))
    same(res, cold.generate(request(edit.history, REPLY)))
    assert res.usage.cached_tokens < sum(len(m) for m in edit.history[:3])


# ------------------------------------------------------------------------------------- integrity


def _turn_then_restart(model, tmp_path, damage) -> tuple[Chat, Engine]:
    chat = Chat(5, engine(model, budget=0))
    a = tiered(model, disk(tmp_path))
    chat.turn(a)
    settle(a)
    a.prompt_cache.close()
    damage(DiskTier(tmp_path, a.fingerprint, 1 << 30).dir)
    return chat, tiered(model, disk(tmp_path))


def _one(folder: Path, sub: str) -> Path:
    files = [p for p in (folder / sub).rglob("*") if p.is_file()]
    assert files, sub
    return files[0]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _reseal_manifest(path: Path, change, version: int = FORMAT_VERSION) -> None:
    m = Manifest.from_bytes(path.read_bytes())
    change(m.data)
    data = bytearray(seal(MANIFEST_MAGIC, Manifest(m.data).to_bytes()[38:]))
    struct.pack_into("<H", data, 4, version)
    path.write_bytes(bytes(data))


DAMAGE = {
    "corrupt_block": (lambda d: _flip_byte(_one(d, "b")), "corrupt"),
    "truncated_block": (lambda d: _one(d, "b").write_bytes(_one(d, "b").read_bytes()[:100]), "corrupt"),
    "truncated_payload": (lambda d: _one(d, "p").write_bytes(_one(d, "p").read_bytes()[:-7]), "corrupt"),
    "corrupt_manifest": (lambda d: _flip_byte(_one(d, "m")), "corrupt"),
    "foreign_version": (lambda d: _reseal_manifest(_one(d, "m"), lambda m: None, version=FORMAT_VERSION + 1),
                        "version_mismatch"),
    "foreign_model": (lambda d: _reseal_manifest(_one(d, "m"), lambda m: m.update(fingerprint="another-model")),
                      "model_mismatch"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_entry_is_refused_deleted_and_prefilled_cold(models, tmp_path, case):
    model, _ = models("llama")
    damage, reason = DAMAGE[case]
    chat, b = _turn_then_restart(model, tmp_path, damage)
    res = chat.turn(b)                       # checks it equals the cold run
    assert res.usage.cached_tokens == 0
    tiers = settle(b)
    assert tiers["disk"]["refusals"] == {reason: 1}, tiers["disk"]
    # the refused entry is gone: only this turn's new entry is left
    assert tiers["disk"]["entries"] == 1


def test_kill_during_write_leaves_nothing_that_loads_wrongly(models, tmp_path):
    """A write cut short at any step (blocks, payload or a temporary file written, no manifest yet)."""
    model, _ = models("llama")
    chat = Chat(6, engine(model, budget=0))
    a = tiered(model, disk(tmp_path))
    chat.turn(a)
    settle(a)
    folder = a.prompt_cache.tiers[0].dir
    manifest = _one(folder, "m")
    # killed before the manifest's rename: its temporary names a process that no longer exists
    manifest.rename(manifest.with_name(f".{manifest.name}.999999999.4.tmp"))
    files = [p for p in folder.rglob("*") if p.is_file()]
    b = tiered(model, disk(tmp_path))
    # a fresh orphan block or payload may be another live server's write in progress: kept, never loaded
    assert b.prompt_cache.tiers[0].usage() == {"entries": 0, "bytes": 0, "blocks": 0}
    assert len([p for p in folder.rglob("*") if p.is_file()]) == len(files) - 1
    for path in folder.rglob("*"):                                      # ... and once old, removed
        if path.is_file():
            os.utime(path, (1, 1))
    c = tiered(model, disk(tmp_path))
    assert c.prompt_cache.tiers[0].usage() == {"entries": 0, "bytes": 0, "blocks": 0}
    assert not [p for p in folder.rglob("*") if p.is_file()]
    assert chat.turn(c).usage.cached_tokens == 0


def test_full_disk_budget_evicts_and_stays_exact(models, tmp_path):
    model, _ = models("gemma3-ring")
    chat = Chat(7, engine(model, budget=0))
    budget = 60_000
    a = tiered(model, disk(tmp_path, budget))
    for _ in range(4):
        chat.turn(a)
    stats = settle(a)["disk"]
    assert stats["evictions"] > 0 and stats["bytes"] <= budget
    b = tiered(model, disk(tmp_path, budget))
    chat.turn(b)
    assert settle(b)["disk"]["bytes"] <= budget


def test_write_behind_never_blocks_and_drops_when_full(models, tmp_path):
    """A tier whose writes hang: requests still finish, and writes beyond the queue are dropped."""
    model, _ = models("gemma3-ring")
    release = threading.Event()

    class StuckDisk(DiskTier):
        def put(self, enc):
            release.wait(60)
            return super().put(enc)

    eng = tiered(model, lambda fp: [StuckDisk(tmp_path, fp, 1 << 30)], queue_size=1)
    chat = Chat(8, engine(model, budget=0))
    t0 = time.perf_counter()
    for _ in range(3):
        chat.turn(eng)        # gemma3 snapshots at every boundary: far more writes than the queue holds
    assert time.perf_counter() - t0 < 50
    wb = eng.prompt_cache.stats()["tiers"]["write_behind"]
    assert wb["dropped"] > 0 and wb["queued"] >= 1
    release.set()
    assert settle(eng)["disk"]["writes"] == wb["queued"]


# ------------------------------------------------------------------------------------------ Redis


@pytest.fixture()
def redis_server():
    server = RedisServer(require_redis()).start()
    yield server
    server.cleanup()


@pytest.mark.parametrize("family", ["llama", "gemma3-ring", "lfm2-hybrid"])
def test_two_replicas_share_through_redis(models, family, redis_server):
    model, kw = models(family)
    chat = Chat(11, engine(model, budget=0, **kw))
    a = tiered(model, redis_tier(redis_server.url), **kw)
    b = tiered(model, redis_tier(redis_server.url), **kw)
    for _ in range(3):
        chat.turn(a)
    assert settle(a)["redis"]["writes"] >= 1
    before = chat.length
    res = chat.turn(b)                                 # replica B has never seen this conversation
    assert res.usage.cached_tokens >= before - REPLY
    assert settle(b)["redis"]["hits"] == 1
    for _ in range(2):
        assert chat.turn(b).usage.cached_tokens >= 0.8 * chat.length - REPLY - USER
    # and back: A continues from what B wrote
    PromptCache.clear(a.prompt_cache)           # A's memory only
    assert chat.turn(a).usage.cached_tokens > 0


def test_redis_shared_blocks_stored_once(models, redis_server):
    model, _ = models("llama")
    cold = engine(model, budget=0)
    system = random.Random(9).choices(range(3, VOCAB), k=192)
    a = tiered(model, redis_tier(redis_server.url))
    one, two = Chat(1, cold, system), Chat(2, cold, system)
    one.turn(a)
    two.turn(a)
    settle(a)
    blocks = len(list(redis_server.client().scan_iter(match="turnkv:*:b:*")))
    n = len(a.specs)
    assert blocks == n * (3 + ((one.length - REPLY + 1) // 64 - 3) + ((two.length - REPLY + 1) // 64 - 3))


def test_redis_down_slow_or_restarted_degrades_to_cold(models, redis_server):
    model, _ = models("llama")
    cold = engine(model, budget=0)
    a = tiered(model, redis_tier(redis_server.url, timeout_s=0.3))
    chat = Chat(12, cold)
    chat.turn(a)
    settle(a)
    # restarted (empty): replica B misses and prefills cold
    redis_server.stop()
    redis_server.start()
    b = tiered(model, redis_tier(redis_server.url, timeout_s=0.3))
    assert chat.turn(b).usage.cached_tokens == 0
    # slow: a Redis busy for 2 s makes the lookup time out; the request goes on without it
    c = tiered(model, redis_tier(redis_server.url, timeout_s=0.3))
    busy = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "2"))
    busy.start()
    time.sleep(0.2)
    other = Chat(13, cold)
    other.history.append(other.msg(USER))
    t0 = time.perf_counter()
    res = c.generate(request(other.history, REPLY))
    assert time.perf_counter() - t0 < 1.7          # waited for the 0.3 s timeout, not for Redis
    same(res, cold.generate(request(other.history, REPLY)))
    assert res.usage.cached_tokens == 0
    busy.join()
    assert settle(c)["redis"]["timeouts"] >= 1
    # down: nothing listens any more; requests still succeed and equal the cold run
    redis_server.stop()
    d = tiered(model, redis_tier(redis_server.url, timeout_s=0.3))
    chat.turn(d)
    stats = settle(d)["redis"]
    assert stats["errors"] + stats["timeouts"] >= 1 and stats["hits"] == 0


def test_redis_refuses_corrupt_entries(models, redis_server):
    model, _ = models("llama")
    chat = Chat(14, engine(model, budget=0))
    a = tiered(model, redis_tier(redis_server.url))
    chat.turn(a)
    settle(a)
    r = redis_server.client()
    key = next(iter(r.scan_iter(match="turnkv:*:b:*")))
    data = bytearray(r.get(key))
    data[-5] ^= 1
    r.set(key, bytes(data))
    b = tiered(model, redis_tier(redis_server.url))
    assert chat.turn(b).usage.cached_tokens == 0
    stats = settle(b)["redis"]
    assert stats["refusals"] == {"corrupt": 1}
    # the bad block was deleted, and this turn's write stored a good one again
    assert r.get(key) != bytes(data) and unseal(BLOCK_MAGIC, r.get(key))


def test_full_flush_empties_lower_tiers_and_tenant_flush_does_not(models, tmp_path, redis_server):
    model, _ = models("llama")
    chat = Chat(15, engine(model, budget=0))
    a = tiered(model, lambda fp: disk(tmp_path)(fp) + redis_tier(redis_server.url)(fp))
    chat.turn(a)
    tiers = settle(a)
    assert tiers["disk"]["entries"] == 1 and tiers["redis"]["entries"] == 1
    a.prompt_cache.clear(owner="someone")          # a tenant's flush: memory only
    tiers = settle(a)
    assert tiers["disk"]["entries"] == 1 and tiers["redis"]["entries"] == 1
    a.prompt_cache.clear()                         # everything
    tiers = a.prompt_cache.stats()["tiers"]
    assert tiers["disk"]["entries"] == 0 and tiers["disk"]["bytes"] == 0 and tiers["redis"]["entries"] == 0
    assert not list(redis_server.client().scan_iter(match="turnkv:*"))
    assert chat.turn(tiered(model, disk(tmp_path))).usage.cached_tokens == 0
