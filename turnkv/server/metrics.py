"""Prometheus metrics of the server (prometheus_client, exposed at GET /metrics).

Each server owns its own CollectorRegistry, so two apps in one process (tests) never share
counters. Names follow vLLM's where one exists (prefix cache queries / hits, TTFT, e2e latency).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for routes/status.py

from .worker import OK, JobOutcome

# CPU-scale latencies: a cached turn answers in tens of ms, a cold long prompt in many seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, model: str, cache_enabled: bool):
        self.registry = CollectorRegistry()
        self.cache_enabled = cache_enabled
        r = self.registry
        self.info = Gauge("turnkv_model_info", "The served model (value is always 1)", ["model"], registry=r)
        self.info.labels(model=model).set(1)
        self.requests = Counter("turnkv_requests", "Requests by endpoint and outcome "
                                "(ok, cancelled, timeout, failed, rejected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("turnkv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("turnkv_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.cache_queries = Counter("turnkv_prompt_cache_query_tokens",
                                     "Prompt tokens looked up in the prompt cache", registry=r)
        self.cache_hits = Counter("turnkv_prompt_cache_hit_tokens",
                                  "Prompt tokens served from the prompt cache (not prefilled)", registry=r)
        self.ttft = Histogram("turnkv_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token (queueing included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("turnkv_e2e_request_latency_seconds",
                             "Time from request arrival to the last token", buckets=E2E_BUCKETS, registry=r)
        self.queue = Gauge("turnkv_requests_pending", "Requests waiting for or running on the engine",
                           registry=r)
        self.drafted = Counter("turnkv_spec_draft_tokens", "Draft tokens verified (speculative decoding)",
                               ["kind"], registry=r)
        self.accepted = Counter("turnkv_spec_accepted_tokens", "Draft tokens accepted (what plain decoding "
                                "produced too)", ["kind"], registry=r)
        self.cache_bytes = Gauge("turnkv_prompt_cache_bytes", "Bytes held by the prompt cache", registry=r)
        self.cache_entries = Gauge("turnkv_prompt_cache_entries", "Snapshots held by the prompt cache",
                                   registry=r)
        self.model = model
        self.prefix_tokens = [0, 0]       # (looked up, restored): the gateways' prefix-cache counters

    def bind(self, pending: Callable[[], int], cache_stats: Callable[[], dict],
             memory: Callable[[], dict] | None = None, restarts: Callable[[], int] | None = None,
             gateway: Callable[[], dict] | None = None, threads: Callable[[], int] | None = None) -> None:
        """Gauges read at scrape time from the worker's published state; ``gateway``: the load
        under the names gateways read (gateway_metrics.py)."""
        self.queue.set_function(pending)
        if gateway is not None:
            from .gateway_metrics import GatewayCollector
            self.registry.register(GatewayCollector(self.model, gateway, lambda: tuple(self.prefix_tokens)))
        if memory is not None:
            for key, help_text in (("live_state_bytes", "Bytes of KV blocks and state live sequences hold"),
                                   ("kv_pool_bytes", "Bytes of the blocks the KV block pools have opened"),
                                   ("rss_bytes", "Resident set size of the server process")):
                Gauge(f"turnkv_{key}", help_text, registry=self.registry).set_function(
                    lambda key=key: float(memory().get(key, 0)))
        if restarts is not None:
            Gauge("turnkv_engine_restarts", "Times the engine loop died and was restarted",
                  registry=self.registry).set_function(lambda: float(restarts()))
        if threads is not None:
            Gauge("turnkv_compute_threads", "Compute threads the engine's steps run on now (docs/threads.md)",
                  registry=self.registry).set_function(lambda: float(threads()))
        from .tier_metrics import SessionCollector, TierCollector
        self.registry.register(TierCollector(cache_stats))    # disk / Redis tiers, when configured
        self.registry.register(SessionCollector(cache_stats))
        self.cache_bytes.set_function(lambda: float(cache_stats().get("bytes", 0) or 0))
        self.cache_entries.set_function(lambda: float(cache_stats().get("entries", 0) or 0))

    def rejected(self, endpoint: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome="rejected").inc()

    def observe(self, done: JobOutcome) -> None:
        """The worker's hook: called on the engine thread once per finished job."""
        self.requests.labels(endpoint=done.endpoint, outcome=done.outcome).inc()
        if done.outcome != OK or done.result is None:
            return
        usage, stats = done.result.usage, done.result.stats
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        if self.cache_enabled:
            self.cache_queries.inc(usage.prompt_tokens)
            self.cache_hits.inc(usage.cached_tokens)
            self.prefix_tokens = [self.prefix_tokens[0] + usage.prompt_tokens,
                                  self.prefix_tokens[1] + usage.cached_tokens]
        for kind, got in stats.drafts.items():      # by the drafter that drafted them, or "forced" (a grammar's)
            self.drafted.labels(kind=kind).inc(got["drafted"])
            self.accepted.labels(kind=kind).inc(got["accepted"])
        self.ttft.observe(done.queue_s + stats.ttft_ms / 1000)
        self.e2e.observe(done.total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
