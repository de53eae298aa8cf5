"""The 1- to 3-bit GGUF types (IQ1_S / IQ1_M included) and the ternary TQ1_0 / TQ2_0 on the native
kernels (csrc/lowbit.h, turnkv/kernels/lowbit.py):
the reference's integer decoding == gguf-py's dequantization, every native path == the PyTorch
reference bit for bit, a row's result independent of the rows it runs with (chunk-invariant),
the largest integer dots exact, the error within activation rounding, and the C++ grids ==
gguf-py's. Random valid blocks: every byte pattern is one (the grids take every index)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import gguf.quants
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

import turnkv.kernels as tk
from turnkv.kernels import GGUFWeight, build, lowbit, reference, tiles

TYPES = [q for q in lowbit.LOWBIT if q in tk.SUPPORTED]
ISAS = tk.available_isas()
N, K = 67, 512                          # a partial 8-row tile; 2 super-blocks a row
D_AT = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.TQ1_0: (52,), Q.TQ2_0: (64,)}   # float16 scales' offsets (IQ: 0)


def random_weight(qtype: Q, n: int = N, k: int = K, seed: int = 0) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in D_AT.get(qtype, (0,)):
        d = rng.uniform(1e-4, 2e-3, size=(n, k // block)).astype(np.float16)
        if qtype == Q.IQ1_M:   # d's 4 nibbles in the top of the 4 scale words (bytes 49, 51, 53, 55)
            for i, byte in enumerate((49, 51, 53, 55)):
                blocks[..., byte] = (blocks[..., byte] & 0x0F) | (((d.view(np.uint16) >> (4 * i)) & 0xF) << 4).astype(np.uint8)
        else:
            blocks[..., at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return GGUFWeight.from_raw(blocks.reshape(n, -1), qtype, (n, k))


def _x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[1 % m, :32] = 0.0   # an all-zero activation block (scale 0)
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decoding_equals_gguf_dequantize(qtype):
    w = random_weight(qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(w.rows().numpy(), qtype).astype(np.float32))
    assert torch.equal(w.dequantize(), ref)
    u = reference.unpack(w.rows(), qtype, K)
    val = u["d"].double().unsqueeze(-1) * u["w"].double()
    if u["mn"] is not None:
        val = val - u["dmin"].double().unsqueeze(-1) * u["mn"].double()
    assert torch.equal(val.reshape(N, K).float(), ref)       # every product exact in float32 too


@pytest.mark.parametrize("qtype", [q for q in TYPES if q.name.startswith("IQ")], ids=lambda q: q.name)
def test_dequantize_and_lookup_before_gguf_made_its_grid(qtype):
    """A process whose first use of an IQ type is our dequantize (an embedding row, a float copy)
    still finds gguf-py's grid, which gguf builds lazily."""
    w = random_weight(qtype)
    cls = getattr(gguf.quants, qtype.name)
    cls.grid = None
    out = w.dequantize()
    assert torch.equal(w.lookup(torch.tensor([3, 0])), out[[3, 0]])
    assert torch.equal(out, torch.from_numpy(gguf.quants.dequantize(w.rows().numpy(), qtype).astype(np.float32)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_tiles_round_trip(qtype):
    w = random_weight(qtype, n=13)
    if not tk.native_available():
        pytest.skip("tiles are the native kernels' layout")
    assert w.tiled and w.raw.shape[0] == 16
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (13, w.row_bytes), dtype=np.uint8))
    assert torch.equal(tk.untile_rows(tk.tile_rows(rows, qtype), qtype, 13), rows)
    assert sum(tiles._FIELDS[qtype]) == GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_equals_reference_and_rows_run_alone(qtype):
    """Every path == the reference; a row's result is the same alone, in any chunk and at any
    position (M = 1 decode .. 37 prefill: the 8- and 16-row tiles), N = 67 and 1000 (threads)."""
    for n in (N, 1000):
        w = random_weight(qtype, n=n, seed=n)
        x = _x(37) * 3
        ref = w.matmul(x, native=False)
        assert torch.equal(w.matmul(x[17:18], native=False)[0], ref[17])
        for isa in ISAS:
            full = w.matmul(x, isa=isa)
            assert torch.equal(full, ref), (isa, n)
            for m in (1, 2, 3, 5, 8, 9, 16, 17):
                for r0 in (0, 37 - m):
                    assert torch.equal(w.matmul(x[r0:r0 + m], isa=isa), ref[r0:r0 + m]), (isa, n, m, r0)


@pytest.mark.parametrize("qtype", [q for q in TYPES if q.name.startswith("IQ")], ids=lambda q: q.name)
def test_decode_path_equals_general(qtype):
    """M = 1..8 (the grid types' decode path, csrc/grid_fused.inc: a tile's 8 rows' grid entries
    gathered into vector lanes, no scratch) == the same rows inside an M = 40 call (the unpack +
    dot path), on every path, with the AVX-512 paths' row pairing on and off (the low-bit types
    dot their rows unpaired either way); N = 67 (a partial tile) and 1000."""
    if not tk.native_available():
        pytest.skip("the decode path is the native kernels'")
    before = tk._ext.set_pair(1)
    try:
        for n in (N, 1000):
            w = random_weight(qtype, n=n, seed=n + 2)
            x = _x(40) * 5
            x[33, 96:128] = 0.0
            for isa in ISAS:
                full = w.matmul(x, isa=isa)
                for pair in (1, 0):
                    tk._ext.set_pair(pair)
                    for m in range(1, 9):
                        for r0 in (0, 40 - m):
                            assert torch.equal(w.matmul(x[r0:r0 + m], isa=isa), full[r0:r0 + m]), (isa, n, m, r0, pair)
                tk._ext.set_pair(1)
    finally:
        tk._ext.set_pair(before)


def _largest_block(qtype: Q) -> np.ndarray:
    """A block at the type's largest |value| x |scale| (Q2_K: q 3, scale 15, min 0; Q3_K: q - 4 =
    -4, scale -32; IQ: grid entry 0 of the largest value where there is one, all signs negative,
    sub-block scales at their top; TQ: every q at its largest, 2 (TQ2_0: 3); IQ1: grid entry top
    with delta +1/8, scales 15), d = 1."""
    size = GGML_QUANT_SIZES[qtype][1]
    b = np.zeros(size, np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == Q.Q2_K:
        b[0:16], b[16:80], b[80:82] = 0x0F, 0xFF, one
    elif qtype == Q.Q3_K:
        b[108:110] = one                                  # hmask 0: q - 4 = -4; scales 0 - 32
    elif qtype in (Q.TQ1_0, Q.TQ2_0):
        b[:-2], b[-2:] = 0xFF, one                        # TQ1_0: 0xFF x 3^n stays >= 171, trit 2
    elif qtype in (Q.IQ1_S, Q.IQ1_M):
        top = int(lowbit.grid(qtype).sum(-1).argmax())
        hi = (top >> 8) & 7
        if qtype == Q.IQ1_S:
            b[0:2], b[2:34] = one, top & 0xFF
            b[34:50] = np.tile(np.frombuffer((hi * 0x249 | 7 << 12).to_bytes(2, "little"), np.uint8), 8)
        else:   # d = 1.0 (0x3C00) in the scale words' top nibbles, every 3-bit scale 7
            b[0:32], b[32:48] = top & 0xFF, hi | hi << 4
            b[48:56] = np.frombuffer(np.array([0x0FFF, 0x0FFF, 0xCFFF, 0x3FFF], "<u2").tobytes(), np.uint8)
    else:
        b[0:2] = one
        g = lowbit.grid(qtype)
        top = int(g.sum(-1).argmax())                     # the entry with the largest values
        if qtype == Q.IQ2_XXS:
            aux = 0xF0000000 | sum(127 << (7 * l) for l in range(4))
            b[2:66] = np.tile(np.array([top] * 4 + list(int(aux).to_bytes(4, "little")), np.uint8), 8)
        elif qtype == Q.IQ2_XS:
            b[2:66] = np.tile(np.frombuffer(int(top | (127 << 9)).to_bytes(2, "little"), np.uint8), 32)
            b[66:74] = 0xFF
        elif qtype == Q.IQ2_S:
            b[2:34], b[34:66], b[66:74], b[74:82] = top & 0xFF, 0xFF, (top >> 8) * 0x55, 0xFF
        elif qtype == Q.IQ3_XXS:
            b[2:66] = top
            b[66:98] = np.tile(np.frombuffer(int(0xF0000000 | sum(127 << (7 * l) for l in range(4))).to_bytes(4, "little"), np.uint8), 8)
        else:   # IQ3_S
            b[2:66], b[66:74], b[74:106], b[106:110] = top & 0xFF, 0xFF if top >> 8 else 0, 0xFF, 0xFF
    return b


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_largest_values_stay_exact(qtype):
    """The largest integer dots there are (weights at their largest against activations at +-127):
    an int16 overflow in the AVX2 pair sums or VNNI's w + 128 would differ from the reference."""
    n, k = 24, 256
    raw = torch.from_numpy(np.tile(_largest_block(qtype), (n, 1)).copy())
    w = GGUFWeight.from_raw(raw, qtype, (n, k))
    assert w.dequantize().abs().max() > 0
    for sign in (1.0, -1.0):
        x = torch.full((13, k), 2.5 * sign)
        x[5:] *= torch.linspace(0.5, 1.0, k)
        ref = w.matmul(x, native=False)
        for isa in ISAS:
            for m in (1, 4, 13):
                assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, m, sign)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_error_bound_vs_float(qtype):
    """|y - x @ W^T| <= sum_k |W_nk| * dx_k / 2 (+ float32 slack): activation rounding only."""
    w = random_weight(qtype)
    x = _x(6)
    wf = w.dequantize().double()
    exact = x.double() @ wf.T
    _, dx = reference.quantize_activations(x, 32)
    bound = (dx.double().repeat_interleave(32, 1) / 2) @ wf.abs().T + 1e-5 * (x.double().abs() @ wf.abs().T) + 1e-30
    err = (w.matmul(x).double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()


def test_cpp_grids_equal_gguf():
    """The build's lowbit_grids.h holds gguf-py's grids, packed as its grid_hex (expanded by lowbit.h)."""
    text = build.grids_header()
    names = {Q.IQ2_XXS: "kIQ2XXSPacked", Q.IQ2_XS: "kIQ2XSPacked", Q.IQ2_S: "kIQ2SPacked",
             Q.IQ3_XXS: "kIQ3XXSPacked", Q.IQ3_S: "kIQ3SPacked", Q.IQ1_S: "kIQ1SPacked"}
    for qtype, name in names.items():
        body = re.search(name + r"\[\d+\] = \{(.*?)\};", text, re.S).group(1)
        packed = np.array([int(v, 16) for v in re.findall(r"0x[0-9a-f]+", body)], np.int64)
        cls = getattr(gguf.quants, qtype.name)
        bits = 4 if qtype.name.startswith("IQ3") else 2
        per = 8 if bits == 2 else 4
        idx = (packed[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
        assert torch.equal(torch.from_numpy(np.array(cls.grid_map, np.int64)[idx]).to(torch.int32), lowbit.grid(qtype)), qtype
