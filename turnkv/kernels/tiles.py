"""Tiles of 8 rows: the layout the native GGUF kernels read a weight in.

Tile t holds rows 8t..8t+7 (the last tile padded with zero rows, whose blocks have scale 0),
block after block; block b of a tile is its 8 rows' block b cut into fields (2- or 4-byte pieces,
and MXFP4's 1-byte scale: scales, mins, high bits, the quants as 4-byte groups), each field of the
8 rows side by side:
    Q4_1 block of a tile = d[8] (16 B) | m[8] (16 B) | group 0 of rows 0..7 (32 B) | ... group 3
so one 32-byte load gives a group of all 8 rows (row r in bytes 4r..4r+3), the layout the dot
products want, where GGUF's rows needed an 8x8 transpose per block (docs/kernels.md, "Layouts").
The field at byte o of a row's block starts at byte 8 * o of the tile's block. The bytes are
GGUF's own, only moved: a tile is exactly 8 rows' bytes."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .weight_memory import buffer as mapped_buffer

TILE_ROWS = 8
SMALL = 2 << 20       # tiles smaller than a huge page stay in malloc's memory
_Q = GGMLQuantizationType
# a block's fields in GGUF order, as byte widths (csrc/common.h, block_fields)
_FIELDS = {
    _Q.Q4_0: (2,) + (4,) * 4,                                 # d, qs
    _Q.Q4_1: (2, 2) + (4,) * 4,                               # d, m, qs
    _Q.Q5_0: (2, 4) + (4,) * 4,                               # d, qh, qs
    _Q.Q5_1: (2, 2, 4) + (4,) * 4,                            # d, m, qh, qs
    _Q.Q8_0: (2,) + (4,) * 8,                                 # d, qs
    _Q.Q4_K: (2, 2) + (4,) * 3 + (4,) * 32,                   # d, dmin, scales, qs
    _Q.Q5_K: (2, 2) + (4,) * 3 + (4,) * 8 + (4,) * 32,        # d, dmin, scales, qh, qs
    _Q.Q6_K: (4,) * 32 + (4,) * 16 + (4,) * 4 + (2,),         # ql, qh, scales, d
    _Q.IQ4_NL: (2,) + (4,) * 4,                               # d, qs
    _Q.IQ4_XS: (2, 2, 4) + (4,) * 32,                         # d, scales_h, scales_l, qs
    _Q.MXFP4: (1,) + (4,) * 4,                                # e (E8M0), qs
    _Q.Q2_K: (4,) * 4 + (4,) * 16 + (2, 2),                   # scales, qs, d, dmin
    _Q.Q3_K: (4,) * 8 + (4,) * 16 + (4,) * 3 + (2,),          # hmask, qs, scales, d
    _Q.IQ2_XXS: (2,) + (4,) * 16,                             # d, qs (indices, signs + scale)
    _Q.IQ2_XS: (2,) + (4,) * 16 + (4,) * 2,                   # d, qs, scales
    _Q.IQ2_S: (2,) + (4,) * 8 + (4,) * 8 + (4,) * 2 + (4,) * 2,   # d, qs, signs, qh, scales
    _Q.IQ3_XXS: (2,) + (4,) * 16 + (4,) * 8,                  # d, qs, scales and signs
    _Q.IQ3_S: (2,) + (4,) * 16 + (4,) * 2 + (4,) * 8 + (4,),  # d, qs, qh, signs, scales
    _Q.TQ1_0: (4,) * 12 + (4,) + (2,),                        # qs (5 trits a byte), qh (4 a byte), d
    _Q.TQ2_0: (4,) * 16 + (2,),                               # qs (2 bits a value), d
    _Q.IQ1_S: (2,) + (4,) * 8 + (4,) * 4,                     # d, qs, qh
    _Q.IQ1_M: (4,) * 8 + (4,) * 4 + (4,) * 2,                 # qs, qh, scales (and d's bits)
    _Q.F16: (2,),                                             # one value a "block"
    _Q.BF16: (2,),
}


def _tile_fields(rows: torch.Tensor, qtype) -> torch.Tensor:
    """What ``tile_rows`` does, as tensor ops on any dtype (built once per row size, on positions)."""
    fields = _FIELDS[GGMLQuantizationType(qtype)]
    n, rb = rows.shape
    bb = sum(fields)
    blocks = rows.reshape(n // TILE_ROWS, TILE_ROWS, rb // bb, bb).transpose(1, 2)   # [tiles, nb, 8, bb]
    parts, off = [], 0
    for w in fields:
        parts.append(blocks[..., off:off + w].reshape(n // TILE_ROWS, rb // bb, TILE_ROWS * w))
        off += w
    return torch.cat(parts, -1).reshape(n, rb)


def _unit(qtype) -> int:
    """The bytes a tile moves as one: 2 where every field is 2 or 4 bytes wide, 1 for MXFP4 (its
    1-byte scale; a row may then have an odd size)."""
    return 1 if any(w % 2 for w in _FIELDS[GGMLQuantizationType(qtype)]) else 2


@functools.lru_cache(maxsize=None)
def _tile_index(qtype, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, inverse) gathers over a tile's units (``_unit`` bytes): unit j of a tile comes
    from unit forward[j] of its 8 rows, and back. One numpy take per weight moves its bytes at
    memory speed, where field-by-field tensor ops took seconds per layer of a 1B model."""
    u = _unit(qtype)
    units = torch.arange(TILE_ROWS * row_bytes // u).view(TILE_ROWS, row_bytes // u)
    forward = _tile_fields(units.repeat_interleave(u, 1), qtype).reshape(-1)[::u].numpy().copy()
    return forward, np.argsort(forward)


# the native extension's gather (kernels/__init__.py sets it when the build has one), else numpy's
native_gather = None


def weight_buffer(rows: int, cols: int) -> torch.Tensor:
    """A weight's [rows, cols] uint8 tiles: a mapping of its own (weight_memory.py) from a huge
    page's size on, else malloc's memory."""
    if rows * cols < SMALL:
        return torch.empty((rows, cols), dtype=torch.uint8)
    return mapped_buffer(rows, cols)


@functools.lru_cache(maxsize=None)
def _index_tensor(qtype, row_bytes: int, inverse: bool) -> torch.Tensor:
    return torch.from_numpy(_tile_index(qtype, row_bytes)[int(inverse)].astype(np.int64))


def _native_job(rows: torch.Tensor, qtype, out: torch.Tensor, order: torch.Tensor | None, inverse: bool = False):
    """``native_gather``'s arguments for one job: ``rows`` [n, row_bytes] (or, with ``order``, the
    rows it names) into the tiles ``out`` [ceil(n / 8) * 8, row_bytes]; padding rows are order -1
    (zeros, written by the gather itself). ``inverse``: tiles back into rows (whole tiles)."""
    rb, npad = rows.shape[1], out.shape[0]
    n = rows.shape[0] if order is None else order.numel()
    if order is not None or npad != n:
        full = torch.full((npad,), -1, dtype=torch.int64)
        full[:n] = torch.arange(n) if order is None else order
        order = full
    return rows.contiguous(), _index_tensor(qtype, rb, inverse), out, _unit(qtype), order


def _gather_numpy(src: torch.Tensor, qtype, inverse: bool, out: torch.Tensor) -> None:
    """``src`` [tiles * 8, row_bytes] uint8, each tile's units gathered by ``_tile_index``'s
    forward (or ``inverse``) index into ``out`` (a contiguous uint8 tensor of src's shape)."""
    index = _tile_index(qtype, src.shape[1])[int(inverse)]
    view = np.int16 if _unit(qtype) == 2 else np.uint8
    np.take(src.contiguous().numpy().view(view).reshape(out.shape[0] // TILE_ROWS, -1), index, axis=1,
            out=out.numpy().view(view).reshape(out.shape[0] // TILE_ROWS, -1), mode="clip")


def _tile_numpy(rows: torch.Tensor, qtype, out: torch.Tensor, order: torch.Tensor | None) -> None:
    """One job of ``tile_many`` without the build: the rows permuted first, the last tile padded."""
    if order is not None:
        rows = rows.index_select(0, order)
    n, npad = rows.shape[0], out.shape[0]
    whole = n - n % TILE_ROWS
    if whole:
        _gather_numpy(rows[:whole], qtype, False, out[:whole])
    if npad != whole:      # the last tile, padded with zero rows
        last = rows.new_zeros(TILE_ROWS, rows.shape[1])
        last[:n - whole] = rows[whole:]
        _gather_numpy(last, qtype, False, out[whole:])


def tile_many(jobs: list[tuple], parallel: bool = True) -> None:
    """Each job ``(rows, qtype, out, order)``: ``tile_rows(rows, qtype, out, order)``, all of them
    in one native call (one parallel region, the jobs' bytes shared out over the threads: the end
    of a load tiles every weight left at once, kernels/__init__.py ``settle_deferred``)."""
    if not jobs:
        return
    if native_gather is None:
        for rows, qtype, out, order in jobs:
            _tile_numpy(rows, qtype, out, order)
        return
    _native([_native_job(*job) for job in jobs], parallel)


def _native(jobs: list[tuple], parallel: bool = True) -> None:
    """One ``native_gather`` call over ``_native_job`` argument tuples (its lists, one entry a job)."""
    native_gather(*(list(column) for column in zip(*jobs)), parallel)


def tile_rows(rows: torch.Tensor, qtype, out: torch.Tensor | None = None, order: torch.Tensor | None = None,
              parallel: bool = True) -> torch.Tensor:
    """GGUF rows [N, row_bytes] -> their tiles [ceil(N / 8) * 8, row_bytes], written into ``out``
    when given (a contiguous buffer of that shape: a slice of a fused weight's tiles), so rows
    still in a file's mapping are read once and written once; else into a ``weight_buffer``.
    ``order`` (int64 [N']): the weight's row i is ``rows[order[i]]`` (a family's row permutation,
    llama's q/k un-permute), moved as it is tiled rather than copied first. ``parallel`` False:
    the native gather runs on the calling thread alone (no OpenMP team)."""
    qtype = GGMLQuantizationType(qtype)
    n = rows.shape[0] if order is None else order.numel()
    if out is None:
        out = weight_buffer(-(-n // TILE_ROWS) * TILE_ROWS, rows.shape[1])
    tile_many([(rows, qtype, out, order)], parallel)
    return out


def untile_rows(tiles: torch.Tensor, qtype, n: int) -> torch.Tensor:
    """The inverse of ``tile_rows``: GGUF's rows [n, row_bytes]."""
    qtype = GGMLQuantizationType(qtype)
    rows = torch.empty(tiles.shape, dtype=torch.uint8)
    if native_gather is None:
        _gather_numpy(tiles, qtype, True, rows)
    else:
        _native([_native_job(tiles, qtype, rows, None, inverse=True)])
    return rows if n == tiles.shape[0] else rows[:n].contiguous()


@functools.lru_cache(maxsize=None)
def _row_gather(qtype, row_bytes: int) -> torch.Tensor:
    """[8, row_bytes] int64: where byte j of row i of a tile lies in that tile's bytes (the
    inverse of ``tile_rows`` for one row, as offsets from the tile's start)."""
    u = _unit(qtype)
    inverse = torch.from_numpy(_tile_index(GGMLQuantizationType(qtype), row_bytes)[1])
    return torch.stack([u * inverse + i for i in range(u)], 1).reshape(TILE_ROWS, row_bytes)
