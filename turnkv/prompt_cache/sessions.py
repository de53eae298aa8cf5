"""Which lookups resume a session, and where their state came from.

A session (a conversation, an agent's run) comes back after think time with a prompt that
extends what the server generated for it last turn. The ledger remembers the end of every turn
it saw (each end-of-generation entry inserted, also one promoted from a lower tier) by the
chained hash of its tokens up to its last 64-token boundary (cache/serialize.py's ``chain``, the
tiers' own index key). A lookup whose prompt carries one of those hashes at a boundary is a
resume; it came from memory, disk or Redis when the restored state reaches that boundary, and is a
re-prefill otherwise (the session's state was evicted and not found in a lower tier).

A new conversation whose first 64-token boundaries repeat a turn end of another one (a first turn
shorter than a block past a shared system prompt) counts as a resume too; the ledger forgets the
oldest turn ends past ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict

from ..cache.kv import DEFAULT_BLOCK
from ..cache.serialize import chain, namespace_key

SOURCES = ("memory", "disk", "redis", "prefill")
DEFAULT_CAPACITY = 65536


class SessionLedger:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, block: int = DEFAULT_BLOCK):
        self.capacity, self.block = capacity, block
        self._ends: OrderedDict[str, None] = OrderedDict()
        self._ns_keys: dict = {}

    def _key(self, ns) -> str:
        key = self._ns_keys.get(ns)
        if key is None:
            key = self._ns_keys[ns] = namespace_key(ns)
        return key

    def turn_end(self, ns, tokens) -> None:
        """A turn ended at ``tokens`` (what the model was fed: prompt and reply but its last token)."""
        k = len(tokens) // self.block
        if k == 0:
            return
        h = chain(self._key(ns), tokens, self.block, k + 1)[k]
        self._ends[h] = None
        self._ends.move_to_end(h)
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)

    def resumes_at(self, ns, tokens) -> int:
        """The longest boundary (in tokens) at which ``tokens`` continue a recorded turn end; 0: none."""
        if not self._ends:
            return 0
        levels = chain(self._key(ns), tokens, self.block, len(tokens) // self.block + 1)
        for k in range(len(levels) - 1, 0, -1):
            if levels[k] in self._ends:
                return k * self.block
        return 0

    @staticmethod
    def source(hit, boundary: int) -> str:
        """Where a resume at ``boundary`` got its state: the hit's tier, or a re-prefill."""
        if hit is None or hit.usable < boundary:
            return "prefill"
        tier = hit.origin.split(":", 1)[0] if ":" in hit.origin else "memory"
        return tier if tier in SOURCES else "memory"
