"""What /v1/cache/stats, DELETE /v1/cache and /metrics report: the prompt cache's counters, the KV
modes each layer really uses, the engine's load and where the process's memory goes."""

from __future__ import annotations

from ..engine.threads import threads_dict


def store_stats(engine, owner: str | None = None) -> dict:
    # PromptCache.stats() takes the store's lock, so it is safe beside the engine thread
    out = dict(engine.prompt_cache.stats(owner)) if engine.prompt_cache is not None else {}
    if owner is None and getattr(engine, "encoder_cache", None) is not None:
        out["images"] = engine.encoder_cache.stats()     # the image encoder cache (docs/images.md)
    return out


def gateway_load(engine) -> dict:
    """The engine's load as gateways read it (gateway_metrics.py): requests waiting and running, the
    share of the live KV capacity in use, the KV block size and that capacity in blocks."""
    from ..cache.blocks import BLOCK
    running = len(engine.scheduler.running)
    try:
        usage = engine.kv_usage()
    except RuntimeError:         # a slot changed under us (the engine thread): report 0 this time
        usage = 0.0
    return {"waiting": max(0, engine.pending() - running), "running": running, "kv_usage": usage,
            "block_size": BLOCK, "kv_blocks": engine.scheduler.max_seqs * -(-engine.max_context // BLOCK)}


def memory_stats(engine, cache_bytes: int) -> dict:
    """Where the process's memory goes: the KV blocks and recurrent state live sequences hold, the
    prompt cache's blocks (the two overlap where they share blocks), everything the KV block
    pools have allocated (live, stored and free blocks), and the RSS beside them."""
    import psutil
    try:
        live = engine.live_bytes
    except RuntimeError:         # a slot changed under us (the engine thread): report 0 this time
        live = 0
    return {"live_state_bytes": live, "prompt_cache_bytes": cache_bytes, "kv_pool_bytes": engine.pool.pool_bytes,
            "rss_bytes": psutil.Process().memory_info().rss}


def cache_stats_json(engine, stats: dict, enabled: bool, global_view: bool = True, worker=None) -> dict:
    """The store's stats plus what the store cannot know: which KV mode each layer really uses.
    A tenant's view (``global_view`` False) holds its own counters and nothing of others' load."""
    counts: dict[str, int] = {}
    for spec, mode in zip(engine.specs, engine.modes):
        if spec.is_attention:
            counts[mode] = counts.get(mode, 0) + 1
    load = {}
    if global_view:
        load = {
            # the engine's live state slots (not counted in the budget) and its load right now
            "live_bytes": engine.live_bytes,
            "running": len(engine.scheduler.running),
            "waiting": engine.pending() - len(engine.scheduler.running),
            "max_seqs": engine.scheduler.max_seqs,
            "memory": memory_stats(engine, stats.get("bytes", 0)),
            "engine_restarts": worker.restarts if worker is not None else 0,
            # drafted / accepted tokens, verify steps, requests whose speculation was off and why
            "speculative": {"default": engine.speculative, "draft_max": engine.draft_max, **engine.spec.as_dict()},
            # compute threads: fixed, or adapting to the load (engine/threads.py)
            "threads": threads_dict(engine.threads),
        }
    return {
        **stats,
        "model": engine.name,
        "prompt_cache_enabled": enabled,
        "weights": engine.weights,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_mode": engine.kv_mode,
        "kv_cache_mode_effective": list(engine.modes),
        "kv_cache_mode_attention_layers": counts,
        "layers": [spec.describe() for spec in engine.specs],
        **load,
    }
