"""``x @ w.T`` for small float matrices in one fixed order per output (csrc/row_linear.h).

A float GEMM's blocking depends on how many rows it multiplies, so a row's last bits change with
the rows beside it; where the product picks something discrete (a MoE router's top-k) that moves
the output by far more than rounding. Here every output is 16 lane sums over k (lane = k % 16,
increasing k, a multiply then an add), then the fixed tree (l + 8), (l + 4), (l + 2), (l + 1):
the same bits for any number of rows, on the native op (``torch.ops.turnkv_ops.row_linear``,
one call, register tiles) and in ``reference`` (PyTorch ops, the fallback and the tests' oracle).

``sigmoid_each`` is the elementwise companion for what such a product feeds (a gate per row, router
scores): every element's sigmoid computed on its own, never by its position in the tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native_available

LANES = 16


def _op(name: str):
    """``torch.ops.turnkv_ops.<name>``, or None (no build, or a build from before it)."""
    if not native_available():
        return None
    try:
        return getattr(torch.ops.turnkv_ops, name)
    except (AttributeError, RuntimeError):
        return None


def native_op():
    """The row_linear op, or None."""
    return _op("row_linear")


def sigmoid_op():
    """``torch.ops.turnkv_ops.sigmoid_each``, or None."""
    return _op("sigmoid_each")


def each_row_op():
    """``torch.ops.turnkv_ops.each_row`` (models/base.py ``each_row``'s blocks on the threads), or None."""
    return _op("each_row")


def sigmoid_reference(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` of each element of x as a tensor of its own: one element never
    reaches ATen's vector steps (their exp rounds otherwise), so it takes the scalar formula the
    native op runs. One call an element: the fallback without a build, and the tests' oracle."""
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for i, v in enumerate(flat.split(1)):
        out[i:i + 1] = torch.sigmoid(v)
    return out.view(x.shape)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] float32 of float32 x [M, K], w [N, K], in the native op's order; rows in groups so
    that the [rows, N, 16] lane sums stay small."""
    m, k = x.shape
    n = w.shape[0]
    pad = (-k) % LANES    # zero products: the native op's last partial group
    nb = (k + pad) // LANES
    xb = F.pad(x, (0, pad)).view(m, nb, LANES)
    wb = F.pad(w, (0, pad)).view(1, n, nb, LANES)
    out = x.new_empty(m, n)
    step = max(1, 4096 // max(1, n))
    for m0 in range(0, m, step):
        xs = xb[m0:m0 + step, None]
        acc = x.new_zeros(xs.shape[0], n, LANES)
        for b in range(nb):
            acc = acc + xs[:, :, b] * wb[:, :, b]
        h = LANES
        while h > 1:
            h //= 2
            acc = acc[..., :h] + acc[..., h:2 * h]
        out[m0:m0 + step] = acc[..., 0]
    return out
