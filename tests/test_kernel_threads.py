"""A weight matmul's parallel region (kernels/csrc/gguf_matmul.cpp ``run_parts``) at any thread
count gives every output the pure-PyTorch reference's bits: parts
of two quantization types side by side (a fused weight whose parts differ, a MoE row's experts),
decode and prefill row counts. Run through ``norm_head`` (the final norm and the lm_head in one
call, models/fused.py NormHead), whose weight is a QLinear of parts."""

from __future__ import annotations

import native
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_kernels import _x, random_weight

import turnkv.kernels as tk

pytestmark = native.needs(tk.native_available() and hasattr(tk._ext, "norm_head"), "norm_head")


@pytest.fixture(scope="module")
def parts():
    # 1.6 MB of weights: a region of 2 and 3 threads at one row (one a started 256 KB)
    return [random_weight(Q.Q4_K, n=1003, k=2048, seed=1), random_weight(Q.Q6_K, n=250, k=2048, seed=2)]


@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_any_thread_count_gives_the_references_bits(parts, m):
    lin = tk._ext.QLinear([p.raw for p in parts], [int(p.qtype) for p in parts], [int(p.shape[0]) for p in parts], 2048)
    x = _x(m, 2048)
    norm = torch.rand(2048, generator=torch.Generator().manual_seed(3)) + 0.5
    h = torch.ops.turnkv_ops.rms_norm(x, norm, 1e-6)
    want = torch.cat([p.matmul(h, native=False) for p in parts], dim=1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = tk._ext.norm_head(x, norm, 1e-6, lin, tk._isa_index(None))
            assert torch.equal(got, want), n
    finally:
        torch.set_num_threads(threads)
