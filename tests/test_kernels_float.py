"""F16 / BF16 GGUF weights kept as stored (csrc/float_matmul.inc): every path == the PyTorch
reference bit for bit (one float32 chain over k in order, a multiply then an add), a row's
result independent of the call's other rows and the thread count, the widening exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import turnkv.kernels as tk
from turnkv.kernels import GGUFWeight

TYPES = [Q.F16, Q.BF16]
ISAS = tk.available_isas()


def float_weight(qtype: Q, n: int = 67, k: int = 96, seed: int = 0, scale: float = 0.05) -> GGUFWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    w[0, :4] = torch.tensor([6.0e-8, -6.0e-8, 1.0e-5, 0.0])    # F16 subnormals, a zero
    stored = w.to(torch.float16 if qtype == Q.F16 else torch.bfloat16)
    return GGUFWeight.from_raw(stored.view(torch.uint8).reshape(n, 2 * k), qtype, (n, k))


def _x(m: int, k: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_the_stored_values(qtype):
    w = float_weight(qtype)
    dt = torch.float16 if qtype == Q.F16 else torch.bfloat16
    assert torch.equal(w.dequantize(), w.rows().view(dt).float())
    assert w.nbytes == 67 * 96 * 2          # half a float32 copy
    ids = torch.tensor([3, 0, 66])
    assert torch.equal(w.lookup(ids), w.dequantize()[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_equals_reference_and_float(qtype):
    w = float_weight(qtype)
    x = _x(9)
    ref = w.matmul(x, native=False)
    exact = x.double() @ w.dequantize().double().T
    assert (ref.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # the reference's own definition, written out
    wf = w.dequantize()
    acc = torch.zeros(9, 67)
    for j in range(96):
        acc = acc + x[:, j:j + 1] * wf[:, j]
    assert torch.equal(ref, acc)
    for isa in ISAS:
        assert torch.equal(w.matmul(x, isa=isa), ref), isa


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_and_threads_do_not_change_a_result(qtype):
    w = float_weight(qtype, n=1000, k=64, seed=2)
    x = _x(37, 64)
    threads = torch.get_num_threads()
    for isa in ISAS:
        full = w.matmul(x, isa=isa)
        for m in (1, 2, 3, 5, 8):
            assert torch.equal(w.matmul(x[3:3 + m], isa=isa), full[3:3 + m]), (isa, m)
        try:
            torch.set_num_threads(1)
            one = w.matmul(x, isa=isa)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, full), isa


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_extreme_values(qtype):
    """The type's largest finite values and the smallest F16 subnormal widen exactly on every path."""
    big = 65504.0 if qtype == Q.F16 else 3.0e38
    w = float_weight(qtype, n=16, k=32, seed=3)
    dt = torch.float16 if qtype == Q.F16 else torch.bfloat16
    vals = w.rows().view(dt).clone()
    vals[1, :] = big
    vals[2, :] = -big
    vals[3, :] = float(np.float16(2 ** -24)) if qtype == Q.F16 else 1e-38
    w = GGUFWeight.from_raw(vals.view(torch.uint8), qtype, (16, 32))
    x = torch.full((4, 32), 1e-3)
    x[1] = -1e-3
    ref = w.matmul(x, native=False)
    assert torch.isfinite(ref).all()
    for isa in ISAS:
        assert torch.equal(w.matmul(x, isa=isa), ref), isa
