"""A GGUF's stacked experts (``ffn_{gate,up,down}_exps``) stay in their blocks under the ``gguf``
weight format: one ``GGUFStack`` per stack, each expert's weight a view of it (no copy) run by the
GGUF kernels; the start-up banner counts them as native. The experts' output equals the
dequantized-float experts' per token within the kernels' int8-activation error, a token's output
is the same bits whatever other tokens share the call, and a MoE model's requests batched equal
each alone bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import native
from test_engine_batching import run_all
from tiny import request
from turnkv import kernels
from turnkv.kernels import GGUFStack
from turnkv.loading import gguf_type_summary, load_checkpoint
from turnkv.loading.gguf import read_header
from turnkv.models import family_class
from turnkv.models.experts import RoutedExperts
from turnkv.models.gguf_weights import GGUFPacked
from turnkv.models.weights import load_model

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
# gemma4 keeps float copies of its experts for now (models/gemma4.py says why)
MOE = ("glm4_moe", "qwen3_5_moe", "afmoe", "kimi_linear", "bailing_hybrid", "gpt_oss", "gpt_oss_mxfp4")
# max |native - float| over a token's outputs, relative to the largest: the int8 rounding of the
# activations (per block of 32 or 256) at the gate/up and again at the down projection
TOLERANCE = 0.05

needs_native = native.needs(kernels.native_available(), "the native GGUF kernels")


def random_blocks(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random blocks: Q8_0 quantized from random floats; Q4_K random codes and 6-bit scales
    under small fp16 super-block scales (gguf-py cannot quantize K-quants)."""
    rng = np.random.default_rng(seed)
    if qtype == Q.Q8_0:
        import gguf
        return gguf.quants.quantize(rng.standard_normal((rows, k), dtype=np.float32) * 0.05, qtype)
    blocks = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    scales = np.stack([np.full(blocks.shape[:2], 0.002, np.float16), np.full(blocks.shape[:2], 0.001, np.float16)], -1)
    blocks[..., :4] = scales.view(np.uint8).reshape(*blocks.shape[:2], 4)
    return blocks.reshape(rows, -1)


def test_stack_views_are_the_experts_weights():
    """expert e of a stack multiplies as a GGUFWeight made from its own rows (N = 12: each expert
    padded to whole 8-row tiles on its own), and dequantizes as gguf-py does."""
    import gguf

    raw = random_blocks(Q.Q4_K, 3 * 12, 256, 0)
    stack = GGUFStack.from_raw(raw, Q.Q4_K, (3, 12, 256))
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K)).view(3, 12, 256)
    assert torch.equal(stack.dequantize(), want)
    x = torch.randn(5, 256)
    for e in range(3):
        alone = kernels.GGUFWeight.from_raw(raw.reshape(3, 12, -1)[e], Q.Q4_K, (12, 256))
        assert torch.equal(stack[e].matmul(x), alone.matmul(x)), e
    both = GGUFStack.cat_rows([stack, stack])
    assert both.shape == (3, 24, 256) and both.sources == 2
    assert torch.equal(both.dequantize(), torch.cat([want, want], 1))
    # experts of whole tiles (N = 16) join tile by tile: the same bytes as tiling the joined rows
    raw16 = random_blocks(Q.Q4_K, 3 * 16, 256, 5)
    s16 = GGUFStack.from_raw(raw16, Q.Q4_K, (3, 16, 256))
    joined = GGUFStack.cat_rows([s16, s16])
    rows = np.concatenate([raw16.reshape(3, 16, -1)] * 2, 1)
    assert torch.equal(joined.raw, GGUFStack.from_raw(rows.reshape(3 * 32, -1), Q.Q4_K, (3, 32, 256)).raw)
    assert torch.equal(joined[2].matmul(x), kernels.GGUFWeight.from_raw(rows[2], Q.Q4_K, (32, 256)).matmul(x))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_experts_on_blocks_equal_the_float_experts_per_token(qtype):
    E, hidden, inter = 6, 256, 64
    gu = GGUFStack.from_raw(random_blocks(qtype, E * 2 * inter, hidden, 1), qtype, (E, 2 * inter, hidden))
    down = GGUFStack.from_raw(random_blocks(Q.Q8_0, E * hidden, inter, 2), Q.Q8_0, (E, hidden, inter))
    blocks = RoutedExperts.gated(gu, down, torch.float32)
    floats = RoutedExperts.gated(gu.dequantize(), down.dequantize(), torch.float32)
    assert all(isinstance(m.wgu, GGUFPacked) and m.wgu.parts[0].base is gu for m in blocks)
    assert gu[3].raw.data_ptr() == gu.raw.data_ptr() + 3 * gu.raw.shape[0] // E * gu.raw.shape[1]   # a view

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, hidden, generator=g)
    chosen = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(9)])
    weights = torch.rand(9, 3, generator=g)
    got, want = blocks.forward(x, weights, chosen), floats.forward(x, weights, chosen)
    for t in range(9):
        err = (got[t] - want[t]).abs().max() / want[t].abs().max()
        assert err <= TOLERANCE, (t, err)
        # batch invariance: the token alone, and among other tokens, gives the same bits
        assert torch.equal(blocks.forward(x[t:t + 1], weights[t:t + 1], chosen[t:t + 1])[0], got[t])
    rev = torch.arange(8, -1, -1)
    assert torch.equal(blocks.forward(x[rev], weights[rev], chosen[rev]), got[rev])


def gguf_moe(name: str):
    path = FIXTURES / name / f"{name}-q8_0.gguf"
    ckpt = load_checkpoint(path, dtype=torch.float32, progress=False, keep_quantized=True)
    model = load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, torch.float32, "gguf",
                       quantized=ckpt.quantized)
    return path, ckpt, model.eval()


@needs_native
@pytest.mark.parametrize("name", MOE)
def test_fixture_experts_stay_in_blocks(name):
    path, ckpt, model = gguf_moe(name)
    stacks = [q for q in ckpt.quantized.values() if isinstance(q, GGUFStack)]
    assert stacks and not [n for n, t in ckpt.tensors.items() if t.ndim == 3 and "experts" in n]
    assert not [note for note in model.weight_notes if "experts" in note]    # every expert is a kernel matmul
    for stack in stacks:   # every expert's weight is a view into its stack
        assert len(stack.views()) == stack.shape[0]
        lo, hi = stack.raw.data_ptr(), stack.raw.data_ptr() + stack.raw.numel()
        assert all(lo <= v.raw.data_ptr() < hi for v in stack.views())
    # the banner counts each of the file's expert tensors of a loaded layer as kept in blocks
    layers = ckpt.config["num_hidden_layers"]
    exps = [n for n in read_header(path).tensors if "_exps.weight" in n and int(n.split(".")[1]) < layers]
    assert sum(s.sources for s in stacks) == len(exps)
    without = {n: q for n, q in ckpt.quantized.items() if not isinstance(q, GGUFStack)}
    assert gguf_type_summary(path, ckpt.quantized) != gguf_type_summary(path, without)


@needs_native
@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_moe"])
def test_moe_requests_batched_equal_each_alone_bit_for_bit(name):
    """GLM-4 MoE and Qwen 3 MoE (its layers fused, models/fused.py) on their Q8_0 blocks: five
    requests sharing steps (chunked prefills beside decodes) give each the tokens and the first
    logits, torch.equal, of its run alone."""
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache

    _, ckpt, model = gguf_moe(name)
    vocab = ckpt.config["vocab_size"]

    def make(**kw):
        return Engine(model, None, fingerprint=f"{name}-q8", prompt_cache=PromptCache(0), max_context=1024, **kw)

    rng = random.Random(4)
    toks = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731
    system = toks(40)
    reqs = [request([system, toks(9)], 6), request([system, toks(25)], 4), request([toks(90)], 5),
            request([toks(3)], 8), request([toks(50), toks(5)], 1)]
    sinks, _ = run_all(make(max_seqs=4, max_batch_tokens=24, prefill_chunk=16), reqs)
    for req, sink in zip(reqs, sinks):
        ref = make(prefill_chunk=512).generate(req)
        assert sink.result.token_ids == ref.token_ids
        assert torch.equal(sink.result.first_logits, ref.first_logits)


def unfused(model) -> list:
    """Turn every RoutedExperts' native call off (the grouped path); returns what was on."""
    on = [m for m in model.modules() if isinstance(m, RoutedExperts) and m.native is not None]
    for m in on:
        m.native = None
    return on


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_fused_experts_are_the_grouped_experts_bits(qtype):
    """The native call gives the grouped path's bits, into zeros or into a given output: a decode
    step's few rows (row by row) and a prefill chunk's (grouped per expert natively), an expert
    no row chose included."""
    E, hidden, inter = 8, 256, 64
    gu = GGUFStack.from_raw(random_blocks(qtype, E * 2 * inter, hidden, 3), qtype, (E, 2 * inter, hidden))
    down = GGUFStack.from_raw(random_blocks(Q.Q8_0, E * hidden, inter, 4), Q.Q8_0, (E, hidden, inter))
    experts = RoutedExperts.gated(gu, down, torch.float32)
    assert experts.fuse()
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, hidden, generator=g)
        # expert E - 1 left out of the 9-row call: the grouped native path skips an empty group
        chosen = torch.stack([torch.randperm(E - (rows == 9), generator=g)[:4] for _ in range(rows)])
        weights = torch.rand(rows, 4, generator=g)
        base = torch.randn(rows, hidden, generator=g)
        fused = [experts.forward(x, weights, chosen), experts.forward(x, weights, chosen, out=base.clone())]
        native, experts.native = experts.native, None
        grouped = [experts.forward(x, weights, chosen), experts.forward(x, weights, chosen, out=base.clone())]
        experts.native = native
        assert all(torch.equal(a, b) for a, b in zip(fused, grouped)), rows


@needs_native
@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_5_moe"])
def test_fixture_decode_fused_equals_grouped(name):
    from turnkv.cache.specs import make_caches

    _, ckpt, model = gguf_moe(name)
    assert any(isinstance(m, RoutedExperts) and m.native is not None for m in model.modules())

    def decode(steps: int = 6) -> list[torch.Tensor]:
        caches, x, out = make_caches(model.cache_specs()), torch.arange(3, 23), []
        with torch.no_grad():
            for _ in range(steps):
                logits = model.step(x, caches, logits="last").float().reshape(-1)
                out.append(logits)
                x = logits.argmax().reshape(1)
        return out

    fused = decode()
    unfused(model)
    assert all(torch.equal(a, b) for a, b in zip(fused, decode()))
