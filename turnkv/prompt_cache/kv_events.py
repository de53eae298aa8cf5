"""KV events: the prefixes the prompt cache can restore, published as vLLM's KV event stream
(``--kv-events ENDPOINT``; docs/scale-out.md, "KV events").

A router that subscribes (llm-d's precise prefix scorer, NVIDIA Dynamo's ZMQ relay, vllm-router's
KV-aware policies) keeps, per worker, the set of block hashes the worker announced and scores a
request by how many of its leading blocks that set holds. turnkv's prompt cache holds snapshots,
not blocks; a snapshot of ``L`` tokens restores every length in ``[lo, L]`` (``lo`` is 0 where
every layer truncates, near ``L`` for sliding windows, ``L`` for recurrent state). An entry is
announced as the chain of its full ``BLOCK``-token blocks up to the last boundary it can restore
to: all of them when ``lo`` is at or below that boundary, none otherwise. Entries sharing a prefix
share its blocks: a block is stored when the first entry announcing it arrives and removed when
the last one goes. A full flush is one ``AllBlocksCleared``.

Hashes chain from a root that names the namespace (model fingerprint, KV modes, tenant), so two
tenants' equal prefixes are different blocks, as they are for reuse. The wire format is vLLM's:
multipart ``[topic, sequence number (8 bytes, big-endian), msgpack payload]`` on a ZMQ PUB
socket; the payload an ``EventBatch`` array ``[ts, [event, ...]]``, each event a tagged array:
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``."""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time

from ..cache.blocks import BLOCK

log = logging.getLogger("turnkv.kv_events")

MEDIUM = "CPU"                 # where turnkv keeps its K/V (vLLM says "GPU" for its own)
DEFAULT_QUEUE = 100_000        # events waiting to be sent at most; beyond it they are dropped and counted


def root_hash(ns) -> bytes:
    key = "\x1f".join((ns.fingerprint, ns.dtype, ",".join(ns.modes), str(ns.slack), ns.tenant))
    return hashlib.sha256(key.encode()).digest()


def chain(ns, tokens: tuple[int, ...], blocks: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent hash, tokens) of the first ``blocks`` blocks of ``tokens``; hashes are 63-bit
    integers (what every decoder of vLLM's stream takes), the first block's parent is None."""
    out, parent, prev = [], root_hash(ns), None
    for k in range(blocks):
        part = tuple(tokens[k * BLOCK:(k + 1) * BLOCK])
        parent = hashlib.sha256(parent + struct.pack(f"<{len(part)}q", *part)).digest()
        h = int.from_bytes(parent[:8], "big") >> 1
        out.append((h, prev, part))
        prev = h
    return out


def announced_blocks(length: int, lo: int) -> int:
    """How many leading blocks an entry of ``length`` tokens restorable down to ``lo`` announces."""
    full = length // BLOCK
    return full if full and full * BLOCK >= lo else 0


class BlockIndex:
    """The blocks the cache's entries announce, each counted once per entry; turns entries coming
    and going into events for ``publish``. Called under the store's lock."""

    def __init__(self, publish):
        self.publish = publish
        self.refs: dict[int, int] = {}

    def stored(self, ns, tokens: tuple[int, ...], lo: int) -> None:
        new = []
        for h, parent, part in chain(ns, tokens, announced_blocks(len(tokens), lo)):
            n = self.refs.get(h, 0)
            self.refs[h] = n + 1
            if n == 0:
                new.append((h, parent, part))
        # consecutive new blocks go out as one event, as vLLM sends a request's blocks
        events, run = [], []
        for h, parent, part in new:
            if run and parent != run[-1][0]:
                events.append(stored_event(run))
                run = []
            run.append((h, parent, part))
        if run:
            events.append(stored_event(run))
        if events:
            self.publish(events)

    def removed(self, ns, tokens: tuple[int, ...], lo: int) -> None:
        gone = []
        for h, _, _ in chain(ns, tokens, announced_blocks(len(tokens), lo)):
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
            else:
                del self.refs[h]
                gone.append(h)
        if gone:
            self.publish([["BlockRemoved", gone, MEDIUM]])

    def cleared(self) -> None:
        self.refs.clear()
        self.publish([["AllBlocksCleared"]])


def stored_event(run: list[tuple[int, int | None, tuple[int, ...]]]) -> list:
    tokens = [t for _, _, part in run for t in part]
    return ["BlockStored", [h for h, _, _ in run], run[0][1], tokens, BLOCK, None, MEDIUM]


class ZmqPublisher:
    """A PUB socket bound to ``endpoint`` (``tcp://*:5557`` as vLLM's default) and one thread that
    sends what ``publish`` queued: the cache never waits on the network, and a full queue drops
    events (counted in ``dropped``; a subscriber sees the gap in the sequence numbers)."""

    def __init__(self, endpoint: str, topic: str = "", queue_size: int = DEFAULT_QUEUE):
        try:
            import msgpack
            import zmq
        except ImportError as err:
            raise ValueError(f"--kv-events needs pyzmq and msgpack (pip install 'turnkv[kv-events]'): {err}") from None

        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 1000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as err:
            self._sock.close()
            raise ValueError(f"--kv-events {endpoint}: {err}") from None
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.topic = topic.encode()
        self.seq = 0
        self.dropped = 0
        self._queue: queue.Queue[list | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._send_loop, name="turnkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += len(events)

    def _send_loop(self) -> None:
        while True:
            events = self._queue.get()
            if events is None:
                self._queue.task_done()
                return
            taken = 1
            while len(events) < 1000:           # what queued meanwhile goes in the same batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                taken += 1
                if more is None:
                    self._queue.put(None)
                    break
                events = events + more
            try:
                payload = self._pack([time.time(), events])
                self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
                self.seq += 1
            except Exception:           # the stream is advisory: a fault never reaches the cache
                log.exception("turnkv: publishing KV events failed")
            for _ in range(taken):
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything published so far has been sent (tests)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self._sock.close()
