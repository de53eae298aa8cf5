"""A MoE router's logits for a row do not depend on the rows computed beside it.

The router picks each token's experts (top-k), so a last-bit difference in its logits can pick
another expert and move the output by far more than rounding: on a Qwen3-30B-A3B-shape Q4_K_M
file (128 experts), a turn restored from the cache differed from the cold run (max |d logit|
0.026) because the restored prefix left 301 rows in the chunk where the cold run had 512, and the
float GEMM rounds a row by its neighbours. ``rowwise_linear`` computes every output in one fixed
order (kernels/row_linear.py: the native op, or its PyTorch reference), whatever the rows beside it.
"""

from __future__ import annotations

import native
import pytest
import torch

from turnkv.kernels.row_linear import native_op, reference, sigmoid_op, sigmoid_reference
from turnkv.models.base import rowwise_linear, sigmoid_each


def test_a_rows_logits_are_the_same_bits_in_any_slice_of_the_chunk():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 2048, generator=g) * 0.02     # Qwen3-30B-A3B's router shape
    x = torch.randn(301, 2048, generator=g)
    full = rowwise_linear(x, w)
    for lo, hi in ((0, 1), (5, 13), (17, 301), (300, 301)):
        assert torch.equal(rowwise_linear(x[lo:hi], w), full[lo:hi])
    assert torch.allclose(full, x @ w.T, atol=1e-4)     # the same product, only rounded per row
    assert rowwise_linear(x[:0], w).shape == (0, 128)
    # nor on where the weight sits (a BLAS one-row product reads an unaligned matrix otherwise)
    shifted = torch.empty(w.numel() + 3)[3:].view_as(w).copy_(w)
    assert torch.equal(rowwise_linear(x, shifted), full)


def test_a_bias_is_added_after_the_rows_product():
    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(32, 2880, generator=g) * 0.02, torch.randn(32, generator=g), torch.randn(9, 2880, generator=g)
    out = rowwise_linear(x, w, b)
    assert torch.equal(out, rowwise_linear(x, w) + b)
    assert torch.equal(rowwise_linear(x[4:5], w, b), out[4:5])


def _module(cls, **attrs):
    """A family's MoE with only what its router reads (real router shapes; the experts are not run)."""
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _families(H: int = 2048, E: int = 128):
    from turnkv.models import afmoe, gemma4, glm4_moe, gpt_oss, granitemoehybrid, kimi_linear, llama4, qwen3_moe, qwen3_next

    g = torch.Generator().manual_seed(3)
    w = torch.randn(E, H, generator=g) * 0.02
    bias = torch.randn(E, generator=g) * 0.01
    return {
        "qwen3_moe": _module(qwen3_moe.MoE, top_k=8, norm_topk=True, w_router=w),
        "qwen3_next": _module(qwen3_next.SparseMoE, top_k=8, norm_topk=True, w_router=w),
        "glm4_moe": _module(glm4_moe.MoE, top_k=8, n_group=8, topk_group=4, norm_topk=True, scaling=2.5, n_experts=E,
                            w_router=w, score_bias=bias),
        "kimi_linear": _module(kimi_linear.MoE, E=E, top_k=8, groups=8, topk_group=4, renormalize=True, scaling=2.5,
                               w_router=w, score_bias=bias),
        "afmoe": _module(afmoe.MoE, top_k=8, scaling=1.0, w_router=w, expert_bias=bias),
        "gpt_oss": _module(gpt_oss.MoE, top_k=4, w_router=w, b_router=bias),
        "gemma4": _module(gemma4.MoE, top_k=8, eps=1e-6, H=H, w_router=w, router_scale=torch.ones(H),
                          per_expert_scale=torch.ones(E)),
        "llama4": _module(llama4.MoE, top_k=1, router=w),
        "granitemoehybrid": _module(granitemoehybrid.MoE, top_k=8, router=w),
    }


@pytest.mark.parametrize("experts", [128, 40])
def test_every_moe_family_routes_a_row_the_same_in_any_chunk(experts):
    """(weights, experts) of each row alone == that row's in a 48-row chunk and in a slice of it,
    for every family's router (bailing_hybrid routes with kimi_linear's, qwen3_5 with qwen3_next's).
    40 experts: a lone row's scores end in a scalar tail of ATen's loop where the chunk's are all
    vector steps, which moved the sigmoid-scored routers (glm4_moe, kimi_linear, afmoe) before
    their sigmoid went through ``sigmoid_each``."""
    x = torch.randn(48, 2048, generator=torch.Generator().manual_seed(4))
    for name, moe in _families(E=experts).items():
        weights, chosen = moe.route(x)
        sw, sc = moe.route(x[7:30])
        assert torch.equal(sw, weights[7:30]) and torch.equal(sc, chosen[7:30]), name
        for i in range(x.shape[0]):
            w1, c1 = moe.route(x[i:i + 1])
            assert torch.equal(c1, chosen[i:i + 1]) and torch.equal(w1, weights[i:i + 1]), (name, i)


def _gate_values(n: int, seed: int) -> torch.Tensor:
    """Logits over the sigmoid's whole range, with its edges (signed zeros, infinities, saturation,
    subnormals) and a NaN."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 6
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 88.0, -88.0, 104.0, -104.0, 1e-40, float("nan")])
    x[:min(n, len(edges))] = edges[:n]
    return x


def test_sigmoid_each_gives_an_element_its_bits_alone_at_any_length():
    """Each element of ``sigmoid_each`` is ``torch.sigmoid`` of that element alone, whatever the
    tensor's length (vector steps and tails of 8, 16 or 32 floats, and a split over threads past
    ATen's 32768-element grain), and close to ``torch.sigmoid`` of the whole."""
    for n in (1, 7, 8, 16, 33, 1000):
        x = _gate_values(n, n)
        got = sigmoid_each(x)
        alone = torch.cat([torch.sigmoid(x[i:i + 1]) for i in range(n)])
        assert torch.equal(got.view(torch.int32), alone.view(torch.int32)), n     # NaN included
        assert torch.allclose(got, torch.sigmoid(x), rtol=1e-6, atol=0, equal_nan=True)
        assert torch.equal(sigmoid_each(x.view(1, n, 1)).view(n).view(torch.int32), got.view(torch.int32))
    x = _gate_values(70001, 9)
    whole = sigmoid_each(x)
    assert torch.equal(torch.cat([sigmoid_each(p) for p in x.split([1, 7, 8, 16, 33, 1000, 68936])]).view(torch.int32),
                       whole.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):     # computed in float32 as ATen does, then rounded
        h = _gate_values(1000, 10).to(dtype)
        assert torch.equal(sigmoid_each(h).float().nan_to_num(7.0),
                           torch.cat([torch.sigmoid(h[i:i + 1]) for i in range(1000)]).float().nan_to_num(7.0))


@native.needs(sigmoid_op() is not None, "the native sigmoid_each op")
def test_the_native_sigmoid_is_the_references_bits():
    x = _gate_values(17 * 241, 11).view(17, 241)
    assert torch.equal(sigmoid_op()(x).view(torch.int32), sigmoid_reference(x).view(torch.int32))
    assert torch.equal(sigmoid_op()(x.t()).view(torch.int32), sigmoid_reference(x.t()).view(torch.int32))
    assert sigmoid_op()(x[:0]).shape == (0, 241)


def test_qwen3_next_shared_expert_gate_is_per_row():
    from turnkv.models.qwen3_next import SparseMoE

    g = torch.Generator().manual_seed(5)
    moe = _module(SparseMoE, w_shared_gate=torch.randn(1, 2048, generator=g) * 0.02)
    x = torch.randn(40, 2048, generator=g)
    full = moe.shared_gate(x)
    assert all(torch.equal(moe.shared_gate(x[i:i + 1]), full[i:i + 1]) for i in range(40))


@native.needs(native_op() is not None, "the native row_linear op")
def test_the_native_op_is_the_references_bits_on_every_path():
    """Each output's fixed order (16 lanes, then a tree) is the same on the scalar, AVX2 and AVX-512
    paths and in the PyTorch reference: the tails of K (not a multiple of 16), of the 4-row and
    4-output tiles, a decode row and an empty call included."""
    import turnkv.kernels as tk

    op = native_op()
    g = torch.Generator().manual_seed(6)
    for m, k, n in ((1, 2048, 128), (37, 2048, 128), (6, 2880, 32), (5, 100, 7), (3, 7, 1), (0, 64, 8)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.02
        ref = reference(x, w)
        for isa in range(min(2, tk.ISAS.index(tk.best_isa())) + 1):
            assert torch.equal(op(x, w, isa), ref), (m, k, n, isa)
    assert torch.equal(rowwise_linear(x, w), ref)


def test_the_reference_is_the_same_bits_for_a_row_in_any_group():
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(128, 2048, generator=g) * 0.02, torch.randn(70, 2048, generator=g)   # 70 > one group of 32
    full = reference(x, w)
    assert all(torch.equal(reference(x[i:i + 1], w), full[i:i + 1]) for i in (0, 31, 32, 69))
    assert torch.allclose(full, x @ w.T, atol=1e-4)


@native.needs(native_op() is not None, "the native row_linear op")
def test_a_decode_steps_outputs_split_over_threads_are_the_references_bits():
    """A decode step's few rows through a router of >= 512 KB split the outputs between the threads
    (runs of 4, the last short when N is not a multiple of 4): each output the reference's bits,
    at one thread and at two, on every path."""
    import turnkv.kernels as tk

    op = native_op()
    g = torch.Generator().manual_seed(8)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m, k, n in ((1, 2048, 128), (3, 2048, 130), (8, 2880, 61), (2, 1024, 7)):
                x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.02
                ref = reference(x, w)
                for isa in range(min(2, tk.ISAS.index(tk.best_isa())) + 1):
                    assert torch.equal(op(x, w, isa), ref), (threads, m, k, n, isa)
    finally:
        torch.set_num_threads(before)
