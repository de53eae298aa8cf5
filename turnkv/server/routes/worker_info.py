"""What maintained routers ask a worker when it joins: SGLang's ``/server_info`` and ``/model_info``
(and their older ``/get_`` forms, which routers fall back to). sglang-router (and vllm-router,
its fork) takes the model's id from ``served_model_name`` (else ``model_id``, else
``model_path``) and names it in its own ``/v1/models``; without these routes it registers every
turnkv replica as the model ``unknown``. docs/scale-out.md lists the fields and what reads them.

``model_path`` is left out on purpose: a router that finds one loads a tokenizer from it (from the
Hugging Face hub when it is not a folder on the router's machine), and turnkv's bundled names are
not hub ids."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request

from ..auth import authorize
from ..context import ServerContext
from ..http_app import App


def turnkv_version() -> str:
    try:
        return version("turnkv")
    except PackageNotFoundError:
        return "unknown"


def server_info(ctx: ServerContext) -> dict:
    engine = ctx.engine
    scheduler = engine.scheduler
    return {
        "served_model_name": engine.name,
        "model_id": engine.name,
        "version": turnkv_version(),
        "engine": "turnkv",
        "context_length": engine.max_context,
        "max_model_len": engine.max_context,
        # one engine per process: the routers' data-parallel discovery must see one rank
        "tp_size": 1,
        "dp_size": 1,
        "max_running_requests": scheduler.max_seqs,
        "max_num_reqs": scheduler.max_seqs,
        "max_queued_requests": scheduler.max_queue,
        "max_prefill_tokens": max(scheduler.max_batch_tokens, engine.prefill_chunk),   # no stream decoding
        "chunked_prefill_size": engine.prefill_chunk,
        "prompt_cache_enabled": ctx.cache_enabled,
        "kv_cache_mode": engine.kv_mode,
        "weights": engine.weights,
    }


def model_info(ctx: ServerContext) -> dict:
    engine = ctx.engine
    vision = hasattr(engine.model, "encode_image")
    return {
        "served_model_name": engine.name,
        "is_generation": True,
        "model_type": engine.family,
        "context_length": engine.max_context,
        "max_context_length": engine.max_context,
        "supports_vision": vision,
        "has_image_understanding": vision,
        "has_audio_understanding": False,
        "preferred_sampling_params": None,
    }


def register(app: App, ctx: ServerContext) -> None:
    keys = ctx.config.keys

    async def server(request: Request):
        authorize(request, keys)
        return server_info(ctx)

    async def model(request: Request):
        authorize(request, keys)
        return model_info(ctx)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model, methods=["GET"])
