"""A Qwen 3 MoE layer as the fused layer calls (models/fused.py with ``moe``; kernels/csrc
moe_experts.inc ``fused_out_moe``): under the gguf weights at float32 every block of the Q8_0
fixture runs fused, a decode step's layers in one native call, and every logit is the same bits
as the Python path's (router in Python, the experts' own native call or the grouped path): whole
prompts, chunks of at most and of more than the experts' row-by-row limit (longer chunks go
grouped per expert natively), decode steps, the three-call layer, and several sequences in one
batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import native
from test_fused_layer import Switch, fused_blocks, prompt, run
from turnkv import kernels
from turnkv.loading import load_checkpoint
from turnkv.models import family_class
from turnkv.models.experts import RoutedExperts
from turnkv.models.fused import FusedBlock, FusedStack, fused_available
from turnkv.models.weights import load_model

pytestmark = [native.needs(kernels.native_available(), "the native kernels"),
              pytest.mark.skipif(not fused_available(), reason="the fused layer is off here")]

FIXTURE = Path(__file__).resolve().parent / "gguf_fixtures" / "qwen3_moe" / "qwen3_moe-q8_0.gguf"


@pytest.fixture(scope="module")
def model():
    q = load_checkpoint(str(FIXTURE), dtype=torch.float32, progress=False, keep_quantized=True)
    return load_model(family_class(q.architecture), q.config, q.tensors, torch.float32, "gguf", quantized=q.quantized)


def experts(model) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def test_every_moe_block_runs_fused(model):
    blocks = fused_blocks(model)
    assert len(blocks) == model.args.num_hidden_layers
    assert all(b.fused.moe is not None and b.fused.native is not None for b in blocks)
    # decode steps and prefill chunks alike: the native experts go grouped per expert past 8 rows
    for rows in (1, 8, 9, 512):
        assert all(b.fused.takes(torch.zeros(rows, model.args.hidden_size)) for b in blocks), rows


def count_calls(monkeypatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(kernels._ext, name)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(kernels._ext, name, counted)
    return calls


@pytest.mark.parametrize("grouped", [False, True], ids=["experts-native", "experts-grouped"])
def test_same_bits_as_the_python_path(model, monkeypatch, grouped):
    """Fused (one call a step for decode and for every prefill chunk) against the blocks' Python
    path, with the experts' own native call or, ``grouped``, the grouped per-expert path."""
    ids = prompt(40, 3, model.vocab_size)
    stack_calls = count_calls(monkeypatch, "fused_layers")
    with torch.inference_mode():
        fused, chunked, small = run(model, ids, None, 6), run(model, ids, 16, 6), run(model, ids, 5, 6)
    # through the stack: every chunk (the whole 40-row prompt; 16, 16, 8; eight of 5) and decode step
    assert stack_calls[0] == (1 + 6) + (3 + 6) + (8 + 6), stack_calls[0]
    switch, kept = Switch(model), [(e, e.native) for e in experts(model)]
    switch(False)
    if grouped:
        for e, _ in kept:
            e.native = None
    try:
        with torch.inference_mode():
            plain = run(model, ids, None, 6)
    finally:
        switch(True)
        for e, n in kept:
            e.native = n
    assert torch.equal(fused, plain)
    assert torch.equal(chunked, plain)
    assert torch.equal(small, plain)


def test_three_calls_same_bits_as_one(model, monkeypatch):
    """Without the one-call layer (caches the kernel does not write, or TURNKV_FUSED_LAYER=0) a MoE
    block runs fused_qkv, the attention and fused_out_moe from Python: the same bits."""
    ids = prompt(20, 5, model.vocab_size)
    with torch.inference_mode():
        one = run(model, ids, 4, 5)
    monkeypatch.setattr(FusedBlock, "one_call", False)
    monkeypatch.setattr(FusedStack, "enabled", False)
    out_moe = count_calls(monkeypatch, "fused_out_moe")
    with torch.inference_mode():
        three = run(model, ids, 4, 5)
    assert out_moe[0] == (5 + 5) * model.args.num_hidden_layers
    assert torch.equal(one, three)
