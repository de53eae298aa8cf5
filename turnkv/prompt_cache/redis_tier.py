"""The Redis tier: snapshots shared by every server that points at one Redis.

Keys live under ``turnkv:<model>:`` (the model fingerprint's hash): ``m:<id>`` manifests,
``p:<id>`` payloads, ``e:<id>`` the entry's block and index keys, ``b:<key>`` blocks (stored once,
reference counted in the hash ``refs``), ``i:<level>`` sorted sets of entry ids per index level,
``lru`` (entry id -> last use) and ``bytes`` (what the prefix holds). An entry is written by one
Lua script, so it appears whole or not at all, and two servers writing the same blocks at once
store them once; eviction (least recently used first, down to ``--redis-cache-mb``) is a script
too.

A Redis that is down or slower than the timeout makes the tier unavailable for a few seconds
(counted, one warning): lookups go on with the local tiers and writes are skipped, never an error
to a client.
"""

from __future__ import annotations

import logging
import time

from ..cache.serialize import Encoded, Manifest, Refused
from .tier import DEFAULT_KEEP_TURNS, MAX_CANDIDATES, Tier, Unavailable, model_dir

log = logging.getLogger("turnkv.tiers")

RETRY_AFTER_S = 5.0

# KEYS: m, p, e, lru, refs, bytes, <nb block keys>, <ni index keys>
# ARGV: manifest, payload, now, id, nb, ni, e-value, <nb block values, "" = expected present>
_PUT = """
local nb, ni = tonumber(ARGV[5]), tonumber(ARGV[6])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
  return 0
end
for i = 1, nb do
  if ARGV[7 + i] == '' and redis.call('EXISTS', KEYS[6 + i]) == 0 then return -1 end
end
for i = 1, nb do
  local k, v = KEYS[6 + i], ARGV[7 + i]
  if v ~= '' and redis.call('SET', k, v, 'NX') then redis.call('INCRBY', KEYS[6], string.len(v)) end
  redis.call('HINCRBY', KEYS[5], k, 1)
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[7])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[6], string.len(ARGV[1]) + string.len(ARGV[2]) + string.len(ARGV[7]))
for i = 1, ni do redis.call('ZADD', KEYS[6 + nb + i], ARGV[3], ARGV[4]) end
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
return 1
"""

# KEYS: lru, refs, bytes ; ARGV: prefix, budget (-1: no budget pass), max evictions, then entry ids to
# drop and "!<block key>" for blocks to delete
_DROP = """
local prefix, budget, maxn = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local function drop(id)
  local e = redis.call('GET', prefix .. 'e:' .. id)
  local n = 0
  for _, k in ipairs({prefix .. 'm:' .. id, prefix .. 'p:' .. id, prefix .. 'e:' .. id}) do
    n = n + redis.call('STRLEN', k)
    redis.call('DEL', k)
  end
  redis.call('DECRBY', KEYS[3], n)
  redis.call('ZREM', KEYS[1], id)
  if e then
    local sep = string.find(e, '|', 1, true)
    for b in string.gmatch(string.sub(e, 1, sep - 1), '[^,]+') do
      if redis.call('HINCRBY', KEYS[2], b, -1) <= 0 then
        redis.call('HDEL', KEYS[2], b)
        redis.call('DECRBY', KEYS[3], redis.call('STRLEN', b))
        redis.call('DEL', b)
      end
    end
    for i in string.gmatch(string.sub(e, sep + 1), '[^,]+') do redis.call('ZREM', i, id) end
  end
end
for i = 4, #ARGV do
  local a = ARGV[i]
  if string.sub(a, 1, 1) == '!' then       -- a block known to be bad: its bytes go now
    local b = string.sub(a, 2)
    redis.call('DECRBY', KEYS[3], redis.call('STRLEN', b))
    redis.call('DEL', b)
  else
    drop(a)
  end
end
local count = 0
if budget >= 0 then
  while count < maxn and tonumber(redis.call('GET', KEYS[3]) or '0') > budget do
    local ids = redis.call('ZRANGE', KEYS[1], 0, 0)
    if #ids == 0 then break end
    drop(ids[1])
    count = count + 1
  end
end
return {count, tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('ZCARD', KEYS[1])}
"""


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, fingerprint: str, budget_bytes: int, timeout_s: float = 0.5,
                 keep_turns: int = DEFAULT_KEEP_TURNS):
        super().__init__(budget_bytes, keep_turns)
        import redis

        self._errors = (redis.RedisError, OSError)
        self._timeout_errors = (redis.TimeoutError, TimeoutError)
        self.url = url
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = f"turnkv:{model_dir(fingerprint)}:"
        self._put = self.r.register_script(_PUT)
        self._drop = self.r.register_script(_DROP)
        self._down_until = 0.0
        self._usage = {"entries": 0, "bytes": 0}

    def k(self, kind: str, name: str = "") -> str:
        return f"{self.prefix}{kind}:{name}" if name else f"{self.prefix}{kind}"

    def _call(self, fn):
        if time.monotonic() < self._down_until:
            with self.lock:
                self.counts["unavailable"] += 1
            raise Unavailable(self.url)
        try:
            return fn()
        except self._errors as err:
            kind = "timeouts" if isinstance(err, self._timeout_errors) else "errors"
            with self.lock:
                self.counts[kind] += 1
            self._down_until = time.monotonic() + RETRY_AFTER_S
            log.warning("turnkv: Redis at %s unavailable (%s: %s); local tiers only for %g s",
                        self.url, type(err).__name__, err, RETRY_AFTER_S)
            raise Unavailable(self.url) from None

    # --- the Tier interface ------------------------------------------------------------------------
    def members(self, levels):
        def go():
            pipe = self.r.pipeline(transaction=False)
            for level in levels:
                pipe.zrevrange(self.k("i", level), 0, MAX_CANDIDATES - 1)
            return [[i.decode() for i in ids] for ids in pipe.execute()]
        return self._call(go)

    def manifests(self, ids):
        if not ids:
            return {}
        datas = self._call(lambda: self.r.mget([self.k("m", i) for i in ids]))
        out = {}
        for eid, data in zip(ids, datas):
            if data is None:
                continue                  # evicted since the index was read
            try:
                m = Manifest.from_bytes(data)
                out[eid] = m if m.id == eid else Refused("corrupt", "manifest stored under another id")
            except Refused as err:
                out[eid] = err
        return out

    def fetch(self, m, keys):
        def go():
            pipe = self.r.pipeline(transaction=False)
            pipe.zadd(self.k("lru"), {m.id: time.time()}, xx=True)
            pipe.get(self.k("p", m.id))
            if keys:
                pipe.mget([self.k("b", key) for key in keys])
            res = pipe.execute()
            return res[1], dict(zip(keys, res[2] if keys else []))
        return self._call(go)

    def put(self, enc: Encoded) -> bool:
        m = enc.manifest
        keys = list(enc.blocks)
        bkeys = [self.k("b", key) for key in keys]
        levels = [self.k("i", level) for level in m.levels()]
        present = self._call(lambda: self._exists_many(bkeys)) if bkeys else []
        e_value = ",".join(bkeys) + "|" + ",".join(levels)
        for attempt in range(2):
            values = [b"" if have and attempt == 0 else enc.block_bytes(key) for key, have in zip(keys, present)]
            res = self._call(lambda: self._put(
                keys=[self.k("m", m.id), self.k("p", m.id), self.k("e", m.id), self.k("lru"), self.k("refs"),
                      self.k("bytes"), *bkeys, *levels],
                args=[enc.manifest_bytes, enc.payload, time.time(), m.id, len(bkeys), len(levels), e_value,
                      *values]))
            if res != -1:       # -1: a block we skipped was evicted meanwhile; send them all
                break
        if res == 1:
            self.drop_subsumed(enc)
            self.drop_old_turns(enc)
        self._evict()
        return res == 1

    def _exists_many(self, keys):
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(x) for x in pipe.execute()]

    def _run_drop(self, ids=(), budget: int = -1, maxn: int = 0):
        count, nbytes, entries = self._call(lambda: self._drop(
            keys=[self.k("lru"), self.k("refs"), self.k("bytes")],
            args=[self.prefix, budget, maxn, *ids]))
        self._usage = {"entries": int(entries), "bytes": int(nbytes)}
        return int(count)

    def _evict(self) -> None:
        n = self._run_drop(budget=self.budget_bytes, maxn=1000)
        with self.lock:
            self.counts["evictions"] += n

    def delete(self, entry_id, blocks=()):
        # known-bad blocks go too, so every other entry that needs them misses (and is deleted)
        self._run_drop(ids=[entry_id, *("!" + self.k("b", key) for key in blocks)])

    def clear(self) -> None:
        def go():
            for key in self.r.scan_iter(match=self.prefix + "*", count=1000):
                self.r.delete(key)
        self._call(go)
        self._usage = {"entries": 0, "bytes": 0}

    def usage(self) -> dict:
        with self.lock:
            return {**self._usage, "timeouts": self.counts["timeouts"], "unavailable": self.counts["unavailable"]}
