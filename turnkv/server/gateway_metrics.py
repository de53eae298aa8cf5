"""The series gateways schedule by, under the names they already read (docs/scale-out.md).

The Gateway API Inference Extension's model-server protocol, which llm-d's endpoint picker
implements, asks a model server for its queue length, its running requests and its K/V
utilisation as Prometheus gauges, and names vLLM's series for them (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``; optionally ``vllm:cache_config_info``
with the block size for its prefix scorer). turnkv publishes those, vLLM's prefix-cache counters
and SGLang's names for the same quantities, beside its own ``turnkv_*`` series; every series is
read at scrape time, so a gateway sees the load of this instant."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def gauge(name: str, help_text: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["model_name"])
    family.add_metric([model], float(value))
    return family


def counter(name: str, help_text: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=["model_name"])
    family.add_metric([model], float(value))
    return family


class GatewayCollector:
    """``load()``: ``waiting``, ``running``, ``kv_usage`` (0..1), ``block_size``, ``kv_blocks``
    (the live capacity in blocks); ``prefix()``: (prompt tokens looked up, tokens restored) of
    finished requests since start-up."""

    def __init__(self, model: str, load: Callable[[], dict], prefix: Callable[[], tuple[int, int]]):
        self.model, self.load, self.prefix = model, load, prefix

    def collect(self):
        m, load = self.model, self.load()
        queries, hits = self.prefix()
        waiting, running, usage = load["waiting"], load["running"], load["kv_usage"]
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot (vLLM's name)", m, waiting)
        yield gauge("vllm:num_requests_running", "Requests holding a slot (vLLM's name)", m, running)
        yield gauge("vllm:kv_cache_usage_perc", "Share of the live KV capacity running requests hold, "
                    "1 = full (vLLM's name)", m, usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV block size and the live capacity in "
                                 "blocks (labels; vLLM's name)", labels=["block_size", "num_gpu_blocks", "model_name"])
        info.add_metric([str(load["block_size"]), str(load["kv_blocks"]), m], 1.0)
        yield info
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prompt cache (vLLM's name)",
                      m, queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens restored from the prompt cache (vLLM's name)",
                      m, hits)
        yield gauge("sglang:num_queue_reqs", "Requests waiting for a slot (SGLang's name)", m, waiting)
        yield gauge("sglang:num_running_reqs", "Requests holding a slot (SGLang's name)", m, running)
        yield gauge("sglang:token_usage", "Share of the live KV capacity in use (SGLang's name)", m, usage)
        yield gauge("sglang:cache_hit_rate", "Prompt tokens restored / looked up since start-up (SGLang's name)",
                    m, hits / queries if queries else 0.0)
