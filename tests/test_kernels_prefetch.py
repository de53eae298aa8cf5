"""The fused paths' software prefetch distance, one setting per GGUF type (csrc/gguf_matmul.cpp
set_prefetch_fused, TURNKV_KERNEL_PREFETCH_FUSED for every type): the setter round-trips, and a
distance changes where the kernels read ahead, never their bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import native
import turnkv.kernels as tk
from test_kernels import ISAS, _x, random_weight

TYPES = [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS]


@native.needs(tk.native_available(), "the native kernels")
def test_prefetch_setter_round_trips_per_type():
    """Setting one type's distance returns its previous one and leaves the other types' alone;
    a type id outside the table or a negative distance is refused."""
    q8, q4 = tk._ext.set_prefetch_fused(int(Q.Q8_0), 1234), tk._ext.set_prefetch_fused(int(Q.Q4_1), 0)
    try:
        assert tk._ext.set_prefetch_fused(int(Q.Q8_0), 4096) == 1234
        assert tk._ext.set_prefetch_fused(int(Q.Q4_1), 0) == 0
        assert tk._ext.set_prefetch_fused(int(Q.Q8_0), 4096) == 4096
        for bad in ((64, 0), (-1, 0), (int(Q.Q8_0), -64)):
            with pytest.raises(RuntimeError):
                tk._ext.set_prefetch_fused(*bad)
    finally:
        tk._ext.set_prefetch_fused(int(Q.Q8_0), q8)
        tk._ext.set_prefetch_fused(int(Q.Q4_1), q4)


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_prefetch_distance_keeps_the_bits(qtype):
    """M = 1..8 (the fused decode paths) and M = 40 (the unpack path's full 8-row tiles) on every
    path with the type's prefetch off, at 1 KB, 8 KB and 1 MB ahead (far past the weight's end:
    a prefetch never faults) == the PyTorch reference; N = 1000 (split across threads)."""
    w = random_weight(qtype, n=1000, seed=11)
    x = _x(40) * 5
    ref = w.matmul(x, native=False)
    before = tk._ext.set_prefetch_fused(int(qtype), 0)
    try:
        for pf in (0, 1024, 8192, 1 << 20):
            tk._ext.set_prefetch_fused(int(qtype), pf)
            for isa in ISAS:
                assert torch.equal(w.matmul(x, isa=isa), ref), (isa, pf)
                for m in range(1, 9):
                    assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, pf, m)
    finally:
        tk._ext.set_prefetch_fused(int(qtype), before)


@native.needs(tk.native_available(), "the native kernels")
def test_prefetch_env_sets_every_type():
    """TURNKV_KERNEL_PREFETCH_FUSED=<bytes>, read at load (a fresh process), is every type's distance."""
    code = ("import turnkv.kernels as tk; "
            "print(sorted({tk._ext.set_prefetch_fused(q, 0) for q in (2, 3, 6, 8, 12, 14, 23)}))")
    env = dict(os.environ, TURNKV_KERNEL_PREFETCH_FUSED="2048")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[2048]", out.stderr[-2000:]
