"""GGUF int8-activation matmul kernels (turnkv/kernels): layouts, native == reference, invariance.

The native paths are designed to be bit-identical to the PyTorch reference (exact int32 block
dot products, then the same float32 operations in the same order; docs/kernels.md), so (2) and
(3) assert torch.equal, not a tolerance.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

import native
import turnkv.kernels as tk
from turnkv.kernels import GGUFWeight, reference
from turnkv.loading import gguf as lg
from turnkv.loading.bundled import find_bundled, locate_bundled

QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # gguf.quants can quantize these
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # built as random valid blocks
IQ4 = [Q.IQ4_NL, Q.IQ4_XS]  # random valid blocks too (every byte pattern is one)
SUPER = KQUANTS + [Q.IQ4_XS]  # 256-value super-blocks
ALL = QUANTIZABLE + KQUANTS + IQ4 + [Q.MXFP4]
N, K = 67, 512  # N not a multiple of the 8-row tile; K = 16 blocks of 32 / 2 of 256
ISAS = tk.available_isas()


def _f16_bytes(rng, shape, lo, hi) -> np.ndarray:
    v = rng.uniform(lo, hi, size=shape).astype(np.float16)
    return v.view(np.uint8).reshape(*shape, 2)


def random_weight(qtype: Q, n: int = N, k: int = K, seed: int = 0) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return GGUFWeight.from_raw(gguf.quants.quantize(w, qtype), qtype, (n, k))
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if qtype in IQ4:
        blocks[..., 0:2] = _f16_bytes(rng, (n, k // block), 1e-4, 2e-3)  # d (IQ4_XS: its scales follow)
    elif qtype == Q.MXFP4:
        blocks[..., 0] = rng.integers(118, 125, size=(n, k // block))   # E8M0 scales 2^-10 .. 2^-4
    elif qtype in (Q.Q4_K, Q.Q5_K):
        blocks[..., 0:2] = _f16_bytes(rng, (n, k // block), 1e-4, 2e-3)  # d
        blocks[..., 2:4] = _f16_bytes(rng, (n, k // block), 1e-4, 2e-3)  # dmin
    else:  # Q6_K: d last
        blocks[..., 208:210] = _f16_bytes(rng, (n, k // block), 1e-5, 2e-4)
    return GGUFWeight.from_raw(blocks.reshape(n, -1), qtype, (n, k))


def _rows_of(path, pick) -> dict[Q, tuple[str, GGUFWeight]]:
    """A few rows (strided over the tensor) of one tensor per quant type of a GGUF file."""
    h = lg.read_header(path)
    tensors = h.tensors.values() if isinstance(h.tensors, dict) else h.tensors
    out = {}
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for t in tensors:
            if len(t.shape) != 2 or t.qtype not in tk.SUPPORTED or t.qtype in out or not pick(t):
                continue
            n, k = t.shape
            raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(n, -1)
            rows = raw[np.linspace(0, n - 1, 21).astype(int)].copy()
            out[t.qtype] = (t.name, GGUFWeight.from_raw(rows, t.qtype, (rows.shape[0], k)))
    return out


@pytest.fixture(scope="module")
def real_weights() -> list[tuple[str, GGUFWeight]]:
    found = []
    for name in ("smollm2-135m", "gemma3-270m"):
        installed, _ = find_bundled(name)
        if not installed:
            continue
        path = locate_bundled(name)
        for q, (tname, w) in _rows_of(path, lambda t: True).items():
            found.append((f"{name}:{tname}:{q.name}", w))
    if not found:
        pytest.skip("no bundled GGUF installed")
    return found


def _x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[1 % m, :32] = 0.0  # an all-zero activation block (scale 0)
    return x


# ------------------------------------------------------------------ the build


def test_native_built():
    """The install builds the extension (Makefile); a missing build must not pass silently."""
    assert tk.native_available(), tk.kernel_info()
    assert tk.kernel_info().startswith("native ")
    assert "scalar" in ISAS and "avx2" in ISAS  # every CI machine has AVX2


def test_isa_env_forces_lower_path():
    code = "import turnkv.kernels as k; print(k.kernel_info())"
    env = dict(os.environ, TURNKV_KERNEL_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "native scalar", out.stderr


def _amd_zen4_or_later() -> bool | None:
    """From /proc/cpuinfo, independently of csrc/cpu_family.h: an AMD family 0x1A+ CPU, or 0x19
    with AVX-512 (Zen 4; Zen 3 has none); None where /proc/cpuinfo is not there to say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if fields.get("vendor_id") != "AuthenticAMD":
        return False
    family, flags = int(fields.get("cpu family", "0")), fields.get("flags", "").split()
    return family >= 0x1A or (family == 0x19 and "avx512f" in flags)


def test_paired_rows_default_follows_the_cpu_kind():
    """The paired 512-bit decode rows are on by default exactly on the CPU kinds they were
    measured faster on (AMD Zen 4 and Zen 5; docs/kernels.md), where the AVX-512 path runs, and
    the start-up line says so; TURNKV_KERNEL_PAIR overrides it."""
    zen4 = _amd_zen4_or_later()
    if zen4 is None:
        pytest.skip("no /proc/cpuinfo")
    code = "import turnkv.kernels as k; print(k.kernel_info())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKV_KERNEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    on = "decode rows paired" in out.stdout
    assert on == (zen4 and tk.best_isa().startswith("avx512")), (out.stdout, out.stderr)
    if tk.best_isa().startswith("avx512"):
        forced = subprocess.run([sys.executable, "-c", code], env=dict(env, TURNKV_KERNEL_PAIR="0" if on else "1"),
                                capture_output=True, text=True, timeout=60)
        assert ("decode rows paired" in forced.stdout) == (not on), forced.stderr


# ------------------------------------------------------------------ (1) layouts


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_dequantize_exact_and_unpack_layout(qtype):
    w = random_weight(qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(w.rows().numpy(), qtype).astype(np.float32))
    assert torch.equal(w.dequantize(), ref)
    # the integer unpacking that both matmul paths use decodes the same values
    u = reference.unpack(w.rows(), qtype, K)
    if qtype in SUPER:
        val = u["d"].double().unsqueeze(-1) * u["w"].double()
        if u["mn"] is not None:
            val = val - u["dmin"].double().unsqueeze(-1) * u["mn"].double()
    else:
        val = u["d"].double().unsqueeze(-1) * u["w"].double()
        if u["m"] is not None:
            val = val + u["m"].double().unsqueeze(-1)
    val = val.reshape(N, K)
    assert (val - ref.double()).abs().max() <= 1e-6 * ref.abs().max()
    if qtype not in SUPER:  # same float32 formula as gguf: bit-exact
        assert torch.equal(val.float(), ref)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 8, 67])
def test_tiles_of_8_rows(qtype, n):
    """With the build, weights are held as tiles of 8 rows (kernels/__init__.py, tile_rows): the same
    bytes moved, each block's fields of the 8 rows side by side, the last tile padded with zero
    rows. Checked byte by byte against GGUF's rows, and back."""
    block, bb = GGML_QUANT_SIZES[qtype]
    rows = torch.from_numpy(np.random.default_rng(n).integers(0, 256, size=(n, 3 * bb), dtype=np.uint8))
    tiles = tk.tile_rows(rows, qtype)
    npad = -(-n // 8) * 8
    assert tiles.shape == (npad, 3 * bb)
    assert torch.equal(tk.untile_rows(tiles, qtype, n), rows)
    assert (tk.untile_rows(tiles, qtype, npad)[n:] == 0).all()       # zero rows pad the last tile
    # GGUF's block fields (ggml-common.h): 2-byte scales, then 4-byte pieces; Q6_K's d comes last
    head = {Q.Q4_0: (2,), Q.Q4_1: (2, 2), Q.Q5_0: (2, 4), Q.Q5_1: (2, 2, 4), Q.Q8_0: (2,),
            Q.Q4_K: (2, 2), Q.Q5_K: (2, 2), Q.Q6_K: (), Q.IQ4_NL: (2,), Q.IQ4_XS: (2, 2), Q.MXFP4: (1,)}[qtype]
    tail = (2,) if qtype == Q.Q6_K else ()
    widths = head + (4,) * ((bb - sum(head) - sum(tail)) // 4) + tail
    flat = tiles.view(-1)
    for r in range(n):
        t, i = divmod(r, 8)
        for b in range(3):
            at = (t * 8 * 3 + b * 8) * bb       # block b of tile t
            off = 0
            for w in widths:                    # field of 8 rows: row i at i * w
                got = flat[at + 8 * off + i * w: at + 8 * off + (i + 1) * w]
                assert torch.equal(got, rows[r, b * bb + off: b * bb + off + w]), (r, b, off)
                off += w
    if tk.native_available():
        w = GGUFWeight.from_raw(rows.reshape(n, -1)[:, : 3 * bb], qtype, (n, 3 * block))
        assert w.tiled and torch.equal(w.raw, tiles) and torch.equal(w.rows(), rows)
        assert w.nbytes == n * 3 * bb
        # an untiled weight never reaches the native kernels (they would read it as tiles)
        with pytest.raises(RuntimeError):
            GGUFWeight(rows, qtype, (n, 3 * block)).matmul(torch.randn(1, 3 * block))


def test_dequantize_real(real_weights):
    for name, w in real_weights:
        ref = torch.from_numpy(gguf.quants.dequantize(w.rows().numpy(), w.qtype).astype(np.float32))
        assert torch.equal(w.dequantize(), ref), name


# ------------------------------------------------------------------ (2) native == reference


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_native_equals_reference(qtype):
    w = random_weight(qtype)
    x = _x(9)
    ref = w.matmul(x, native=False)
    for isa in ISAS:
        assert torch.equal(w.matmul(x, isa=isa), ref), isa


def test_native_equals_reference_real(real_weights):
    for name, w in real_weights:
        x = _x(5, w.shape[1]) * 3
        ref = w.matmul(x, native=False)
        for isa in ISAS:
            assert torch.equal(w.matmul(x, isa=isa), ref), (name, isa)


# ------------------------------------------------------------------ (3) batch invariance


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_batch_invariance(qtype):
    w = random_weight(qtype)
    x = _x(37)
    for isa in ISAS:
        full = w.matmul(x, isa=isa)
        for r in (0, 1, 17, 36):
            assert torch.equal(w.matmul(x[r : r + 1], isa=isa)[0], full[r]), (isa, r)
        assert torch.equal(w.matmul(x[30:35], isa=isa), full[30:35]), isa
        # same row among different neighbours, at a different position
        other = torch.cat([torch.randn(3, K) * 100, x[17:18], torch.randn(2, K)])
        assert torch.equal(w.matmul(other, isa=isa)[3], full[17]), isa
    assert torch.equal(w.matmul(x[17:18], native=False)[0], w.matmul(x, native=False)[17])


ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 10, 12, 15, 16, 17, 23, 24, 31)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_decode_fast_path_equals_general(qtype):
    """M = 1..8 (decode and decode batches: the fused path of the 32-value block types and of
    Q4_K / Q6_K / IQ4_XS at unpaired rows, weights
    decoded straight into registers, rows dotted in groups of up to 4; where rows go in pairs, up
    to 31 rows in passes of 8 over each tile) == the same rows inside an M = 40 call (unpack + dot
    path), on every path; N = 67 (a partial tile) and N = 1000 (split across threads)."""
    for n in (N, 1000):
        w = random_weight(qtype, n=n, seed=n)
        x = _x(40) * 5
        for isa in ISAS:
            full = w.matmul(x, isa=isa)
            for m in ROW_COUNTS:
                for r0 in (0, 40 - m):
                    assert torch.equal(w.matmul(x[r0 : r0 + m], isa=isa), full[r0 : r0 + m]), (isa, n, m, r0)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_paired_rows_same_bits_as_unpaired(qtype):
    """The AVX-512 paths' paired decode rows (2..31 activation rows, two rows a 512-bit vector:
    csrc/simd_body.inc fused_pairs, and dot_rows_k_pair for the k-quants; past 8 rows in passes
    of 8) == the 256-bit path one row group at a time (pairs off: the fused path to 8 rows, the
    unpack + dot path past them) == the paired path held to 8 rows (set_fused_rows) == the
    reference, forced on and off whatever the CPU's default (on for AMD Zen 4 and 5 only); N = 67
    (a partial tile) and 1000 (split across threads), odd and even M."""
    wide = [isa for isa in ISAS if isa.startswith("avx512")]
    if not wide:
        pytest.skip("no AVX-512 path on this CPU")
    before, rows_before = tk._ext.set_pair(1), tk._ext.set_fused_rows(31)
    try:
        for n in (N, 1000):
            w = random_weight(qtype, n=n, seed=n + 1)
            x = _x(31) * 4
            x[5, 64:96] = 0.0  # an all-zero block in a paired row's partner
            x[12, 0:32] = 0.0  # and in a later pass's
            ref = w.matmul(x, native=False)
            for isa in wide:
                for m in ROW_COUNTS[1:]:
                    tk._ext.set_pair(1)
                    paired = w.matmul(x[:m], isa=isa)
                    tk._ext.set_fused_rows(8)
                    assert torch.equal(w.matmul(x[:m], isa=isa), paired), (isa, n, m)
                    tk._ext.set_fused_rows(31)
                    tk._ext.set_pair(0)
                    assert torch.equal(w.matmul(x[:m], isa=isa), paired), (isa, n, m)
                    assert torch.equal(paired, ref[:m]), (isa, n, m)
    finally:
        tk._ext.set_pair(before)
        tk._ext.set_fused_rows(rows_before)


def _largest_block(qtype: Q) -> np.ndarray:
    """One GGUF block whose quantized values are all the type's largest (4-bit 15, 5-bit 31,
    6-bit 63; IQ4 index 0 = -127, IQ4_XS sub-block scales -32; MXFP4 +-12), scales 1."""
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    ff = lambda n: np.full(n, 0xFF, np.uint8)   # noqa: E731  every nibble / high bit set
    parts = {
        Q.Q4_0: [one, ff(16)],
        Q.Q4_1: [one, np.zeros(2, np.uint8), ff(16)],                       # minimum 0
        Q.Q5_0: [one, ff(4), ff(16)],
        Q.Q5_1: [one, np.zeros(2, np.uint8), ff(4), ff(16)],
        Q.Q4_K: [one, one, np.full(12, 0x01, np.uint8), ff(128)],           # 6-bit scales / mins 1 or 0
        Q.Q5_K: [one, one, np.full(12, 0x01, np.uint8), ff(32), ff(128)],
        Q.Q6_K: [ff(128), ff(64), np.full(16, 1, np.uint8), one],           # ql, qh, int8 scales, d
        Q.Q8_0: [one, np.tile(np.array([0x7F, 0x80], np.uint8), 16)],       # +127 and -128 (VNNI: w + 128 = 255, 0)
        Q.IQ4_NL: [one, np.zeros(16, np.uint8)],                            # -127 (VNNI: w + 128 = 1)
        Q.IQ4_XS: [one, np.zeros(6, np.uint8), np.zeros(128, np.uint8)],    # -127 x scale -32
        Q.MXFP4: [np.full(1, 128, np.uint8), np.full(16, 0x7F, np.uint8)],  # -12 and +12 (doubled), scale 1
    }[qtype]
    block = np.concatenate(parts)
    assert block.size == GGML_QUANT_SIZES[qtype][1]
    return block


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_largest_values_stay_exact(qtype):
    """Every weight at its largest quantized value against activations at +127 or -127: the
    largest integer block dots there are. The AVX2 paths add several vpmaddubsw pair sums in
    int16 before widening, and the VNNI paths take Q8_0's weights as w + 128 (0..255); an
    overflow there would show as a difference from the reference (which computes in float64)."""
    n, k = 24, 256
    block = _largest_block(qtype)
    raw = torch.from_numpy(np.tile(block, (n, k // GGML_QUANT_SIZES[qtype][0])).copy())
    w = GGUFWeight.from_raw(raw, qtype, (n, k))
    for sign in (1.0, -1.0):
        x = torch.full((13, k), 2.5 * sign)
        x[5:] *= torch.linspace(0.5, 1.0, k)          # other rows: not all at the block maximum
        ref = w.matmul(x, native=False)
        for isa in ISAS:
            for m in (1, 4, 8, 13):
                assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, m, sign)



def _largest_scale_blocks(qtype: Q) -> list[np.ndarray]:
    """Super-blocks whose values and integer sub-block scales are all at their largest magnitude
    (Q4_K / Q5_K scales and mins 63, Q6_K scales -128 and 127, IQ4_XS scales -32 and 31)."""
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    ff = lambda n: np.full(n, 0xFF, np.uint8)   # noqa: E731
    z = lambda n: np.zeros(n, np.uint8)   # noqa: E731
    return {
        Q.Q4_K: [[one, one, ff(12), ff(128)]],
        Q.Q5_K: [[one, one, ff(12), ff(32), ff(128)]],
        Q.Q6_K: [[ff(128), ff(64), np.tile(np.array([0x80, 0x7F], np.uint8), 8), one],
                 [z(128), z(64), np.tile(np.array([0x7F, 0x80], np.uint8), 8), one]],   # values 0 (- 32)
        Q.IQ4_XS: [[one, z(6), z(128)], [one, ff(6), z(128)], [one, ff(6), ff(128)]],   # -127 / 113 x -32 / 31
    }[qtype]


@pytest.mark.parametrize("qtype", SUPER, ids=lambda q: q.name)
def test_largest_scales_stay_exact(qtype):
    """The 256-value types' integer scales at their largest against activations at +-127, through
    the decode path (M = 1, 4, 8: Q4_K / Q5_K / Q6_K / IQ4_XS straight from registers, the scale in
    the widening vpmaddwd, the mins and Q6_K's offsets one vpmaddwd of int16 pairs) and the unpack
    path's row groups (M = 13, 14, 40: AVX2 passes of 4 rows, of 2 for Q6_K, and the rows
    left over one at a time): the AVX2 path multiplies the int16 pair sums by the scales in the
    vpmaddwd that widens them and Q6_K's offsets by one vpmaddwd of int16 pairs (32 x the scales
    against the activations' 16-value sums), so an int16 or int32 overflow there would differ from
    the reference; Q4_K / Q5_K's min term is float(m) * float(bsum) there, exact below 2^24."""
    n, k = 24, 512
    for block in _largest_scale_blocks(qtype):
        block = np.concatenate(block)
        raw = torch.from_numpy(np.tile(block, (n, k // 256)).copy())
        w = GGUFWeight.from_raw(raw, qtype, (n, k))
        x = torch.full((40, k), 2.5)
        x[1::2] *= -1.0
        x[20:] *= torch.linspace(0.5, 1.0, k)
        x[30:, ::3] *= -1.0
        ref = w.matmul(x, native=False)
        for isa in ISAS:
            for m in (1, 4, 8, 13, 14, 40):
                assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, m)


def test_decode_fast_path_equals_general_real(real_weights):
    for name, w in real_weights:
        x = _x(13, w.shape[1]) * 3
        for isa in ISAS:
            full = w.matmul(x, isa=isa)
            for m in range(1, 9):
                assert torch.equal(w.matmul(x[:m], isa=isa), full[:m]), (name, isa, m)


def test_thread_count_invariance():
    w = random_weight(Q.Q4_K, n=1000)
    x = _x(33)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.matmul(x)
        torch.set_num_threads(max(2, threads))
        many = w.matmul(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


# ------------------------------------------------------------------ (4) error vs float32


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_error_bound_vs_float(qtype):
    """|y - x @ W^T| <= sum_k |W_nk| * dx_k / 2 (+ float32 slack): activation rounding only."""
    w = random_weight(qtype)
    x = _x(6)
    y = w.matmul(x)
    wf = w.dequantize().double()
    exact = x.double() @ wf.T
    qb = reference.act_block(qtype)
    _, dx = reference.quantize_activations(x, qb)
    half_step = dx.double().repeat_interleave(qb, 1) / 2  # [M, K]
    bound = half_step @ wf.abs().T + 1e-5 * (x.double().abs() @ wf.abs().T) + 1e-30
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    # and in practice: a fraction of a percent of the output scale
    assert err.max() <= 0.02 * exact.abs().max()


# ------------------------------------------------------------------ (5) row operations, dtypes


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4], ids=lambda q: q.name)
def test_take_rows_cat_lookup(qtype):
    w = random_weight(qtype)
    x = _x(4)
    full = w.matmul(x)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    wp = w.take_rows(perm)
    assert wp.shape == (N, K) and wp.qtype == qtype
    assert torch.equal(wp.matmul(x), full[:, perm])
    assert torch.equal(wp.dequantize(), w.dequantize()[perm])
    sel = w.take_rows(torch.tensor([5, 5, 0]))
    assert torch.equal(sel.dequantize(), w.dequantize()[[5, 5, 0]])

    a, b = w.take_rows(torch.arange(0, 20)), w.take_rows(torch.arange(20, N))
    c = GGUFWeight.cat([a, b])
    assert c.shape == (N, K) and c.nbytes == w.nbytes
    assert torch.equal(c.raw, w.raw) and torch.equal(c.rows(), w.rows())
    assert torch.equal(torch.cat([a.matmul(x), b.matmul(x)], 1), full)
    # parts of whole tiles (16 rows, then the rest) join tile by tile: the same bytes as above
    a, b = w.take_rows(torch.arange(0, 16)), w.take_rows(torch.arange(16, N))
    c = GGUFWeight.cat([a, b])
    assert c.shape == (N, K) and torch.equal(c.raw, w.raw) and torch.equal(c.rows(), w.rows())
    with pytest.raises(ValueError):
        GGUFWeight.cat([w, random_weight(Q.Q5_0 if qtype != Q.Q5_0 else Q.Q4_0)])
    with pytest.raises(ValueError):
        GGUFWeight.cat([w, random_weight(qtype, k=256 if qtype in SUPER else 64)])

    ids = torch.tensor([[3, 0], [66, 3]])
    emb = w.lookup(ids, torch.bfloat16)
    assert emb.shape == (2, 2, K) and emb.dtype == torch.bfloat16
    assert torch.equal(emb, w.dequantize()[ids].to(torch.bfloat16))
    assert torch.equal(w.lookup(ids[0], torch.float32), w.dequantize()[ids[0]])


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_native_row_lookup_is_gguf_py_dequantization(qtype):
    """GGUFWeight.lookup's native row dequantization (csrc/row_dequant.inc) gives gguf-py's
    dequantize bits for every row (each tile position, the padded last tile's rows, repeats), on
    random bytes whatever the scales hold (subnormal, huge, infinite or NaN float16 d / dmin)."""
    rng = np.random.default_rng(7)
    n, k = 43, 768
    raw = rng.integers(0, 256, size=(n, k // 256 * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    w = GGUFWeight.from_raw(raw, qtype, (n, k))
    with np.errstate(invalid="ignore", over="ignore"):       # inf x 0 and the like: NaN, as it should be
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    ids = torch.tensor([0, 7, 8, 42, 41, 40, 5, 5, 17])
    got = tk._ext.dequant_rows(w.raw, int(qtype), ids, n, k)
    assert torch.equal(got.view(torch.int32), want[ids].view(torch.int32))
    assert torch.equal(w.lookup(ids.view(3, 3)).view(torch.int32), want[ids].view(3, 3, k).view(torch.int32))
    with pytest.raises(RuntimeError):
        tk._ext.dequant_rows(w.raw, int(qtype), torch.tensor([n]), n, k)


@native.needs(tk.native_available(), "the native kernels")
def test_native_row_lookup_lets_other_threads_run():
    """The native row dequantization runs without the GIL: another Python thread (a server's)
    runs while a lookup is in progress. No timing: the switch interval is made longer than the
    test, so this thread keeps the GIL between bytecodes and the other thread can run inside the
    window where ``inside`` is set only where a call in it lets go of the GIL, and the window holds
    nothing but lookups (held, the other thread would run only at the join and see False). Their
    results are kept until the window closes: freeing one lets go of the GIL too."""
    rng = np.random.default_rng(8)
    n, k = 512, 4096
    raw = rng.integers(0, 256, size=(n, k // 256 * GGML_QUANT_SIZES[Q.Q6_K][1]), dtype=np.uint8)
    tiled = GGUFWeight.from_raw(raw, Q.Q6_K, (n, k)).raw
    ids = torch.arange(n)
    inside, seen, go, results = [False], [], threading.Event(), []

    def other() -> None:
        go.wait()
        seen.append(inside[0])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)        # before the thread starts: every wait for the GIL uses it
    try:
        thread = threading.Thread(target=other)
        thread.start()                   # returns once it waits on go (the GIL is free only then)
        inside[0] = True
        go.set()
        for _ in range(32):              # 8 MB each; the first lets the other thread run
            results.append(tk._ext.dequant_rows(tiled, int(Q.Q6_K), ids, n, k))
            if seen:
                break
        inside[0] = False
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen == [True]


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_deferred_weights_tile_on_use_or_into_the_fused_buffer(qtype):
    """A weight made with defer=True keeps GGUF's rows until used (the loader: a view of the
    file's mapping); alone it tiles on first use, in a fused weight straight into its place:
    the same bytes as the eager weights either way."""
    rows = random_weight(qtype).rows()                  # 67 rows: the last tile padded
    cut = 24
    eager = [GGUFWeight.from_raw(rows[:cut], qtype, (cut, K)), GGUFWeight.from_raw(rows[cut:], qtype, (N - cut, K))]
    lazy = [GGUFWeight.from_raw(rows[:cut], qtype, (cut, K), defer=True),
            GGUFWeight.from_raw(rows[cut:], qtype, (N - cut, K), defer=True)]
    assert all(w._pending is not None for w in lazy) and lazy[1].nbytes == eager[1].nbytes
    fused = GGUFWeight.cat(lazy)
    assert all(w._pending is not None for w in lazy)     # cat read their rows, tiled none of them
    assert torch.equal(fused.raw, GGUFWeight.cat(eager).raw)
    x = _x(3)
    assert torch.equal(lazy[1].matmul(x), eager[1].matmul(x)) and lazy[1]._pending is None
    tk.settle_deferred()
    assert lazy[0]._pending is None and torch.equal(lazy[0].raw, eager[0].raw)


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.BF16],
                         ids=lambda q: q.name)
def test_native_tile_gather_equals_numpy(qtype, monkeypatch):
    """The load's repack runs on the extension's gather; numpy's take (the build-less path) moves
    the same bytes, both ways, padded last tile included."""
    from turnkv.kernels import tiles

    assert tiles.native_gather is not None
    block, size = GGML_QUANT_SIZES[qtype]
    rows = torch.randint(0, 256, (67, 512 // block * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    fast = tiles.tile_rows(rows, qtype)
    back = tiles.untile_rows(fast, qtype, 67)
    monkeypatch.setattr(tiles, "native_gather", None)
    assert torch.equal(fast, tiles.tile_rows(rows, qtype)) and torch.equal(back, rows)
    assert torch.equal(tiles.untile_rows(fast, qtype, 67), rows)


def test_bfloat16_and_leading_dims():
    w = random_weight(Q.Q4_0)
    x = _x(6).to(torch.bfloat16)
    y = w.matmul(x.reshape(2, 3, K))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, N)
    assert torch.equal(y.reshape(6, N), w.matmul(x.float()).to(torch.bfloat16))


def test_from_raw_checks():
    w = random_weight(Q.Q4_0)
    with pytest.raises(ValueError):
        GGUFWeight.from_raw(w.rows(), Q.Q4_0, (N, K + 16))
    with pytest.raises(NotImplementedError):
        GGUFWeight.from_raw(w.rows(), Q.Q8_1, (N, K))   # a type without a kernel
    again = GGUFWeight.from_raw(w.rows().numpy(), Q.Q4_0, (N, K))
    assert again.nbytes == N * K // 32 * 18 and torch.equal(again.raw, w.raw)


# ------------------------------------------------------------------ RMSNorm (csrc/norm.cpp)


@native.needs(tk.native_available(), "the native kernels")
@pytest.mark.parametrize("D", [64, 250, 576, 640])
def test_native_rms_norm_equals_torch_and_is_row_invariant(D):
    """One native call instead of torch's six ops: within float32 rounding of F.rms_norm, with and
    without a weight, on strided views (q/k heads of a fused projection), and every row the same
    bits alone as in a 512-row prefill batch or a 3-row decode batch."""
    from turnkv.kernels.norm import native_rms_norm
    from turnkv.models.base import rms_norm

    op = native_rms_norm()
    assert op is not None
    g = torch.Generator().manual_seed(D)
    x = 3 * torch.randn(512, D, generator=g)
    w = torch.randn(D, generator=g)
    for weight in (w, None):
        want = torch.nn.functional.rms_norm(x, (D,), weight, 1e-6)
        got = op(x, weight, 1e-6)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
        assert torch.equal(rms_norm(x, weight, 1e-6), got)          # the models' helper takes it
        for r in (0, 17, 511):
            assert torch.equal(op(x[r:r + 1], weight, 1e-6), got[r:r + 1])
        assert torch.equal(op(x[5:8], weight, 1e-6), got[5:8])
    heads = x[:12].view(12, 2, D // 2).transpose(0, 1) if D % 2 == 0 else None   # [2, 12, D/2] view
    if heads is not None:
        assert not heads.is_contiguous()
        assert torch.equal(op(heads, None, 1e-6), op(heads.contiguous(), None, 1e-6))
        assert torch.allclose(op(heads, None, 1e-6), torch.nn.functional.rms_norm(heads, (D // 2,), None, 1e-6),
                              rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.bfloat16(), None, 1e-6)
