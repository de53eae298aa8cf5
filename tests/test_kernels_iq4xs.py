"""IQ4_XS's fused decode path (csrc/iq4xs_fused.inc) with and without its AVX-512 VBMI table
lookup: the same bits as the PyTorch reference and the unpack path either way; the AVX2 unpack
path's int16 dots of IQ4_XS and Q8_0 (csrc/simd_body.inc, chunk_dot16)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

import native
import turnkv.kernels as tk
from turnkv.kernels import GGUFWeight

N, K = 1003, 1024   # a partial last tile; 4 super-blocks a row


def _weight(seed: int) -> GGUFWeight:
    """Random bytes (every pattern is a valid IQ4_XS block: all 64 sub-block scales, all 16
    table indices) with small float16 d."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[Q.IQ4_XS]
    b = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    b[..., 0:2] = rng.uniform(1e-4, 2e-3, size=(N, K // block)).astype(np.float16).view(np.uint8).reshape(N, -1, 2)
    return GGUFWeight.from_raw(b.reshape(N, -1), Q.IQ4_XS, (N, K))


@native.needs(tk.native_available(), "the native kernels")
def test_iq4xs_decode_lookup_same_bits_with_and_without_vbmi():
    """M = 1..8 unpaired rows (pairs off, so every M takes the fused path) on every 8-row path,
    the vpermb lookup on (where the CPU has VBMI) and off: each equals the reference and the same
    rows inside an M = 40 call (the unpack + dot path); activations with an all-zero block and
    large outliers (full int8 range against every table value and scale)."""
    w = _weight(7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, K, generator=g)
    x[0, 64:96] = 0.0
    x[:, ::37] *= 40.0
    ref = w.matmul(x, native=False)
    pair, vbmi = tk._ext.set_pair(0), tk._ext.set_vbmi(1)
    try:
        for isa in [i for i in tk.available_isas() if i != "scalar"]:
            full = w.matmul(x, isa=isa)
            assert torch.equal(full, ref), isa
            for on in (1, 0):
                tk._ext.set_vbmi(on)
                for m in range(1, 9):
                    assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, on, m)
                    assert torch.equal(w.matmul(x[40 - m:], isa=isa), ref[40 - m:]), (isa, on, m)
    finally:
        tk._ext.set_pair(pair)
        tk._ext.set_vbmi(vbmi)


def _int16_rows_equal_reference(qtype: Q, rows: tuple[int, ...]) -> None:
    """Random bytes (Q8_0: -128 among them) at K = 4096, activations with outliers at the full
    int8 range: calls of M = rows (last rows of 64) on avx2 and the best path == the reference."""
    rng = np.random.default_rng(5)
    n, k = 29, 4096
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    b[..., 0:2] = rng.uniform(1e-4, 2e-3, size=(n, k // block)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    w = GGUFWeight.from_raw(b.reshape(n, -1), qtype, (n, k))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(9))
    x[:, ::29] *= 50.0
    ref = w.matmul(x, native=False)
    for m in rows:
        for isa in ("avx2", None):
            assert torch.equal(w.matmul(x[64 - m:], isa=isa), ref[64 - m:]), (qtype.name, isa, m)


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.IQ4_XS], ids=lambda q: q.name)
def test_unpack_path_int16_dots_same_bits(qtype):
    """The avx2 unpack path (M > 8) of Q8_0 and IQ4_XS takes weights as int16 pairs (IQ4_XS's
    already times their sub-block scale) against an int16 copy of the call's activations
    (widened once a call for all threads): the reference's bits for calls of growing and
    shrinking M (rows 4 at a time and a tail). With the fused decode path off
    (TURNKV_KERNEL_FUSED=0, read at load: a fresh process) M <= 8 takes the unpack path too,
    with no shared copy: each thread widens its own."""
    _int16_rows_equal_reference(qtype, (9, 64, 13, 40, 10))
    code = ("import sys; sys.path.insert(0, 'tests'); from gguf import GGMLQuantizationType as Q; "
            "from test_kernels_iq4xs import _int16_rows_equal_reference as f; "
            f"f(Q.{qtype.name}, (1, 3, 8, 13)); print('ok')")
    env = dict(os.environ, TURNKV_KERNEL_FUSED="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
