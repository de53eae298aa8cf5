"""A MoE router's logits for a row do not depend on the rows computed beside it.

The router picks each token's experts (top-k), so a last-bit difference in its logits can pick
another expert and move the output by far more than rounding: on a Qwen3-30B-A3B-shape Q4_K_M
file (128 experts), a turn restored from the cache differed from the cold run (max |d logit|
0.026) because the restored prefix left 301 rows in the chunk where the cold run had 512, and the
float GEMM rounds a row by its neighbours. ``rowwise_linear`` multiplies each row alone.
"""

from __future__ import annotations

import torch

from turnkv.models.base import rowwise_linear


def test_a_rows_logits_are_the_same_bits_in_any_slice_of_the_chunk():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 2048, generator=g) * 0.02     # Qwen3-30B-A3B's router shape
    x = torch.randn(301, 2048, generator=g)
    full = rowwise_linear(x, w)
    for lo, hi in ((0, 1), (5, 13), (17, 301), (300, 301)):
        assert torch.equal(rowwise_linear(x[lo:hi], w), full[lo:hi])
    assert torch.allclose(full, x @ w.T, atol=1e-4)     # the same product, only rounded per row
    assert rowwise_linear(x[:0], w).shape == (0, 128)


def test_qwen3_moe_routes_each_row_alone():
    from turnkv.models.qwen3_moe import MoE

    g = torch.Generator().manual_seed(1)
    moe = MoE.__new__(MoE)
    torch.nn.Module.__init__(moe)
    moe.top_k, moe.norm_topk = 8, True
    moe.w_router = torch.nn.Parameter(torch.randn(128, 2048, generator=g) * 0.02, requires_grad=False)
    x = torch.randn(64, 2048, generator=g)
    weights, chosen = moe.route(x)
    for i in (0, 31, 63):
        w1, c1 = moe.route(x[i:i + 1])
        assert torch.equal(c1, chosen[i:i + 1]) and torch.equal(w1, weights[i:i + 1])
