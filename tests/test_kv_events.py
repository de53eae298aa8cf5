"""KV events (``--kv-events``): a plain pyzmq SUB socket decodes the stream as any subscriber of
vLLM's would, rebuilds the prefixes the announced blocks spell (each block's tokens after its
parent's), and that set must equal what the prompt cache's entries can restore, after inserts,
evictions, an owner's flush and a full flush; for a full-attention model, a sliding-window one and
a hybrid (LFM2: short convolutions and attention).

The rule under test (turnkv/prompt_cache/kv_events.py): an entry of L tokens restorable down to lo
announces its first L // 64 blocks when it can be restored to that block boundary, none otherwise.
"""

from __future__ import annotations

import time

import pytest

msgpack = pytest.importorskip("msgpack", reason="the test extra msgpack is not installed")
zmq = pytest.importorskip("zmq", reason="the test extra pyzmq is not installed")

from tiny import engine, prompt, request, tiny_gemma3, tiny_llama  # noqa: E402
from turnkv.cache.blocks import BLOCK  # noqa: E402
from turnkv.prompt_cache.kv_events import ZmqPublisher  # noqa: E402


class Subscriber:
    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}   # hash -> (parent, tokens)
        self.seq = -1
        self.kinds: list[str] = []

    def sync(self, pub: ZmqPublisher, timeout: float = 10) -> None:
        pub.flush()
        deadline = time.monotonic() + timeout
        while self.seq < pub.seq - 1:
            assert time.monotonic() < deadline, (self.seq, pub.seq)
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                seq = int.from_bytes(seq, "big")
                assert topic == b"" and seq == self.seq + 1, (seq, self.seq)     # no gap
                self.seq = seq
                ts, events = msgpack.unpackb(payload)
                assert abs(ts - time.time()) < 60
                for event in events:
                    self.apply(event)

    def apply(self, event: list) -> None:
        kind = event[0]
        self.kinds.append(kind)
        if kind == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = event
            assert block_size == BLOCK and lora_id is None and medium == "CPU"
            assert len(tokens) == len(hashes) * block_size
            for i, h in enumerate(hashes):
                assert h not in self.blocks          # stored once until removed
                self.blocks[h] = (parent if i == 0 else hashes[i - 1], tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
        elif kind == "BlockRemoved":
            _, hashes, medium = event
            for h in hashes:
                del self.blocks[h]
        else:
            assert event == ["AllBlocksCleared"]
            self.blocks.clear()

    def prefixes(self) -> set[tuple[int, ...]]:
        out = set()
        for h in self.blocks:
            tokens: tuple[int, ...] = ()
            while h is not None:
                parent, part = self.blocks[h]         # a parent is always announced with its child
                tokens, h = part + tokens, parent
            out.add(tokens)
        return out


def restorable(cache) -> set[tuple[int, ...]]:
    """The block-aligned prefixes the cache's entries announce, from the entries themselves."""
    out = set()
    for e in list(cache._lru.values()):
        full = e.length // BLOCK
        if full and full * BLOCK >= e.snap.min_restore():
            out.update(e.tokens[:k * BLOCK] for k in range(1, full + 1))
    return out


@pytest.fixture
def stream():
    pub = ZmqPublisher("tcp://127.0.0.1:*")
    sub = Subscriber(pub.endpoint)
    time.sleep(0.3)           # a SUB socket sees only what is sent after it has joined
    yield pub, sub
    sub.sock.close()
    pub.close()


def conversation(eng, seed: int, turns: int, tenant: str = "", first: int = 90) -> None:
    msgs = [prompt(first, seed=seed).tolist()]
    for t in range(turns):
        req = request(msgs, 6, tenant=tenant)
        req.owner = tenant
        msgs += [eng.generate(req).token_ids, prompt(40, seed=seed * 10 + t).tolist()]


def tiny_model(family: str, tiny_pair):
    if family == "llama":
        return tiny_llama()[0]
    if family == "gemma3":
        return tiny_gemma3(window=16)[0]
    import test_family_lfm2
    return tiny_pair(test_family_lfm2.tiny)[0]


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2"])
def test_events_match_the_cache(stream, family, tiny_pair):
    """Full attention announces every entry's blocks; sliding windows (gemma3) and the hybrid's
    recurrent layers (lfm2) only entries restorable to a block boundary: for lfm2 the checkpoints
    at the end of a first message of exactly 128 tokens."""
    pub, sub = stream
    eng = engine(tiny_model(family, tiny_pair), budget=1 << 30)
    cache = eng.prompt_cache
    cache.publish_events(pub.publish)
    first = 128 if family == "lfm2" else 90
    for seed in (1, 2):
        conversation(eng, seed, turns=3, first=first)
    sub.sync(pub)
    assert sub.prefixes() == restorable(cache) != set()
    if family == "llama":   # a later turn replaces its conversation's earlier entry: shared blocks stay
        assert "BlockRemoved" not in sub.kinds
    else:                   # what cannot truncate: some entries are announced, some not
        unaligned = [e for e in cache._lru.values() if e.snap.min_restore() > BLOCK * (e.length // BLOCK)]
        assert unaligned

    conversation(eng, 3, turns=2, tenant="b", first=first)   # another tenant: its own blocks and flush
    sub.sync(pub)
    assert sub.prefixes() == restorable(cache)
    cache.clear("b")
    sub.sync(pub)
    assert sub.prefixes() == restorable(cache) and "BlockRemoved" in sub.kinds

    cache.clear()
    sub.sync(pub)
    assert sub.kinds[-1] == "AllBlocksCleared" and sub.prefixes() == set() == restorable(cache)
    conversation(eng, 4, turns=2, first=first)
    sub.sync(pub)
    assert sub.prefixes() == restorable(cache) != set()


def test_evictions_remove_blocks(stream):
    pub, sub = stream
    eng = engine(tiny_llama()[0], budget=1 << 30)
    cache = eng.prompt_cache
    cache.publish_events(pub.publish)
    conversation(eng, 1, turns=2)
    cache.budget_bytes = cache.stats()["bytes"] + 1       # room for about what is there now
    for seed in (5, 6, 7):
        conversation(eng, seed, turns=2)
    sub.sync(pub)
    assert cache.stats()["evictions"] > 0
    assert sub.prefixes() == restorable(cache) != set()
