"""Prometheus series of the prompt cache's lower tiers (disk, Redis), read at scrape time from
``stats()["tiers"]``: hits, misses, bytes, entries, evictions, load time, writes, refusals by
reason, Redis timeouts/errors, and the write-behind queue; and where resumed sessions got their
state from (``stats()["resumes"]``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_COUNTERS = (("hits", "Lookups a lower tier answered (loaded and promoted)"),
             ("misses", "Lookups a lower tier could not improve on"),
             ("tokens_reused", "Prompt tokens restored from a lower tier"),
             ("evictions", "Entries a lower tier evicted to stay under its budget"),
             ("writes", "Entries written to a lower tier"),
             ("write_errors", "Writes to a lower tier that failed"),
             ("timeouts", "Calls to a lower tier that timed out"),
             ("errors", "Calls to a lower tier that failed"))
_GAUGES = (("bytes", "Bytes a lower tier holds"), ("entries", "Entries a lower tier holds"),
           ("budget_bytes", "Byte budget of a lower tier"))


class TierCollector:
    def __init__(self, cache_stats: Callable[[], dict]):
        self.cache_stats = cache_stats

    def collect(self):
        tiers = dict(self.cache_stats().get("tiers") or {})
        if not tiers:             # no lower tiers configured: no series at all
            return
        wb = tiers.pop("write_behind", None)
        counters = {name: CounterMetricFamily(f"turnkv_cache_tier_{name}", help_text, labels=["tier"])
                    for name, help_text in _COUNTERS}
        gauges = {name: GaugeMetricFamily(f"turnkv_cache_tier_{name}", help_text, labels=["tier"])
                  for name, help_text in _GAUGES}
        load = CounterMetricFamily("turnkv_cache_tier_load_seconds", "Time spent loading from a lower tier",
                                   labels=["tier"])
        refusals = CounterMetricFamily("turnkv_cache_tier_refusals", "Entries a lower tier refused, by reason",
                                       labels=["tier", "reason"])
        for tier, s in tiers.items():
            for name, family in counters.items():
                family.add_metric([tier], float(s.get(name, 0) or 0))
            for name, family in gauges.items():
                family.add_metric([tier], float(s.get(name, 0) or 0))
            load.add_metric([tier], float(s.get("load_ms", 0)) / 1000)
            for reason, n in (s.get("refusals") or {}).items():
                refusals.add_metric([tier, reason], float(n))
        yield from counters.values()
        yield from gauges.values()
        yield load
        yield refusals
        if wb is not None:
            yield GaugeMetricFamily("turnkv_cache_write_queue_depth", "Snapshots waiting to be written to "
                                    "the lower tiers", value=float(wb.get("depth", 0)))
            yield CounterMetricFamily("turnkv_cache_write_dropped", "Lower-tier writes dropped because the "
                                      "write-behind queue was full", value=float(wb.get("dropped", 0)))


class SessionCollector:
    """Session resumes by source (memory, disk, redis, prefill) and the sessions' newest entries
    evicted from memory."""

    def __init__(self, cache_stats: Callable[[], dict]):
        self.cache_stats = cache_stats

    def collect(self):
        stats = self.cache_stats()
        resumes = stats.get("resumes")
        if resumes is None:          # no prompt cache
            return
        family = CounterMetricFamily("turnkv_cache_session_resumes", "Requests that resumed a session, by "
                                     "where its state came from (prefill: evicted and not found)", labels=["source"])
        for source, n in resumes.items():
            family.add_metric([source], float(n))
        yield family
        yield CounterMetricFamily("turnkv_cache_head_evictions", "Sessions' newest entries evicted from memory",
                                  value=float(stats.get("head_evictions", 0)))
