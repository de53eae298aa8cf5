"""K/V widened to float32 a key block at a time inside the attention units (csrc/attention_widen.inc).

int4 K/V always, and int8 ones in spans of at least ``set_block_rows`` queries (8 by default:
prefill chunks): before a tile's queries read a key block, the unit widens the block's rows into
its own scratch and reads them there as float32. The int8 widening is exact, so the rows are the bits of the same call reading the stored rows on load (``set_block_rows(0)``) and of
the kernel on a dequantized float32 copy, on every ISA path, rule, head shape and thread count, one
span or several; and no call copies the context: a decode row and a 16-query chunk over 65,536 keys
leave the process's peak resident memory where it was.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

import native
from test_attention_kernel import threads
from turnkv.cache.storage import dequantize_int8, quantize_int8
from turnkv.kernels import attention as A

needs_blocks = native.needs(A.native_attention_available() and hasattr(torch.ops.turnkv_attn, "set_block_rows"),
                            "the native attention kernel widening key blocks")
SIMD = [i for i in A.attention_isas() if i != "scalar"] or ["none"]   # int8 K/V
RULES = [("full", 0), ("sliding", 37), ("chunked", 50)]


def lo(kind, span, p):
    return 0 if kind == "full" else max(0, p - span + 1) if kind == "sliding" else (p // span) * span


@contextlib.contextmanager
def block_rows(n: int):
    before = torch.ops.turnkv_attn.set_block_rows(n)
    try:
        yield
    finally:
        torch.ops.turnkv_attn.set_block_rows(before)


def stored(k: torch.Tensor, v: torch.Tensor):
    """(k, v, scales, float32 copies) of K/V stored as int8 with row scales."""
    (kq, ks), (vq, vs) = quantize_int8(k * 3), quantize_int8(v)
    return kq, vq, (ks, vs), (dequantize_int8(kq, ks, torch.float32), dequantize_int8(vq, vs, torch.float32))


@needs_blocks
@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("heads,D", [((32, 8), 64), ((4, 1), 256), ((6, 2), 80), ((2, 2), 7)])
def test_int8_key_blocks_widened_in_the_unit_change_no_bit(isa, heads, D):
    """Widened blocks (every span, prefill spans, never) == the float32 copy's rows, on 1 and 2
    threads (2 threads split a decode row's key blocks), decode rows, chunks whose queries see
    different keys of a block, softcap; attend_many with a decode row beside a chunk."""
    Hq, Hk = heads
    g = torch.Generator().manual_seed(D + Hq)
    for T, S, cap in ((1, 300, None), (70, 300, None), (9, 130, 25.0), (16, 65, None)):
        q = torch.randn(T, Hq, D, generator=g).transpose(0, 1)          # strided, as the families' q
        k, v, scales, (kf, vf) = stored(torch.randn(Hk, S, D, generator=g), torch.randn(Hk, S, D, generator=g))
        for kind, span in RULES:
            q0 = S - T
            k0 = lo(kind, span, q0)
            sc = (scales[0][:, k0:], scales[1][:, k0:])
            want = A.attend_native(q, kf[:, k0:], vf[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa)
            for n, th in ((0, 1), (1, 1), (8, 1), (1, 2), (8, 2)):
                with block_rows(n), threads(th):
                    got = A.attend_native(q, k[:, k0:], v[:, k0:], q0, k0, kind, span, 0.2, cap, isa=isa, scales=sc)
                assert torch.equal(got, want), (T, S, kind, n, th)
        many_sc = [scales, (scales[0][:, :S - T + 1], scales[1][:, :S - T + 1])]
        for n in (0, 8):
            with block_rows(n):
                many = A.attend_many_native([q, q[:, :1]], [k, k[:, :S - T + 1]], [v, v[:, :S - T + 1]], [S - T, S - T],
                                            [0, 0], ["full", "full"], [0, 0], 0.2, cap, isa=isa, scales=many_sc)
            assert torch.equal(many[:T], A.attend_native(q, kf, vf, S - T, 0, "full", 0, 0.2, cap, isa=isa)), n


_PEAK = """
import resource, torch
from turnkv.kernels import attention as A
Hk, S, D = 8, 65536, 64
g = torch.Generator().manual_seed(0)
# the stored rows made directly (quantizing float32 rows would set the peak before the calls)
if {int4}:
    kp, vp = (torch.randint(0, 256, (Hk, S, D // 2), dtype=torch.uint8, generator=g) for _ in range(2))
    ks, vs = (torch.rand(Hk, S, 2, generator=g).add_(0.5).half() for _ in range(2))
else:
    kp, vp = (torch.randint(-127, 128, (Hk, S, D), dtype=torch.int8, generator=g) for _ in range(2))
    ks, vs = (torch.rand(Hk, S, 1, generator=g).add_(0.5).div_(127).half() for _ in range(2))
q = torch.randn(32, 16, D, generator=g)
for n in (1, 2):
    torch.set_num_threads(n)
    A.attend_native(q[:, :1], kp[:, :256], vp[:, :256], 255, 0, "full", 0, 0.125, scales=(ks[:, :256], vs[:, :256]))
    A.attend_native(q, kp[:, :256], vp[:, :256], 240, 0, "full", 0, 0.125, scales=(ks[:, :256], vs[:, :256]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for n in (1, 2):
    torch.set_num_threads(n)
    A.attend_native(q[:, :1], kp, vp, S - 1, 0, "full", 0, 0.125, scales=(ks, vs))
    A.attend_native(q, kp, vp, S - 16, 0, "full", 0, 0.125, scales=(ks, vs))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@needs_blocks
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_long_context_attention_copies_no_context(mode):
    """A decode row and a 16-query chunk over 65,536 int8 or int4 keys of 8 heads (268 MB as float32
    copies, which the calls made and kept before the units widened a block at a time: int4 until
    session 19, int8 prefill chunks until session 20) leave the peak resident memory of a fresh
    process within 24 MB of where it was."""
    if mode == "int8" and A.attention_isas()[-1] == "scalar":
        pytest.skip("int8 K/V need the avx2 or avx512 path")
    run = subprocess.run([sys.executable, "-c", _PEAK.format(int4=mode == "int4")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert int(run.stdout.split()[-1]) < 24, f"peak resident memory grew by {run.stdout.split()[-1]} MB"
