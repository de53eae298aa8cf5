"""The 1- to 3-bit GGUF types in the PyTorch reference: Q2_K, Q3_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, and the ternary TQ1_0 / TQ2_0 (csrc/lowbit.h does the same for the native
kernels).

A 256-value super-block decodes to integer values with one integer scale per 16 values (Q2_K: and
an integer min), and d, the block's float16 scale times a power of two (exact): ggml's IQ2 sub-block
scale d * (0.5 + s) / 4 is d / 8 * (2 s + 1) and IQ3_XXS's d * (0.5 + s) / 2 is d / 4 * (2 s + 1),
and IQ1's d (2 s + 1) (g +- 1/8) is d / 8 * (2 s + 1) (8 g +- 1), so ``d * w - dmin * mn`` is
gguf's dequantization. The grids are gguf-py's. TQ1_0 / TQ2_0: q - 1
(q a trit, or 2 bits), every scale 1.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
import gguf.quants

LOWBIT = (Q.Q2_K, Q.Q3_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0, Q.IQ1_S, Q.IQ1_M)
# the power of two each type's d is taken times
D_SCALE = {Q.IQ2_XXS: 0.125, Q.IQ2_XS: 0.125, Q.IQ2_S: 0.125, Q.IQ3_XXS: 0.25, Q.IQ1_S: 0.125, Q.IQ1_M: 0.125}


@functools.lru_cache(maxsize=None)
def grid(qtype: Q) -> torch.Tensor:
    """gguf-py's grid of the type: int32 [entries, 8 (IQ2) or 4 (IQ3) values]."""
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()
    return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)).to(torch.int32)


@functools.lru_cache(maxsize=None)
def signs(parity: bool) -> torch.Tensor:
    """[128 or 256, 8] int32 of +-1: the signs of an 8-value group from its sign bits (parity: 7
    bits, the eighth their parity, ggml's ksigns)."""
    b = torch.arange(128 if parity else 256)
    if parity:
        pop = sum((b >> i) & 1 for i in range(7))
        b = b | ((pop & 1) << 7)
    bits = (b.unsqueeze(-1) >> torch.arange(8)) & 1
    return (1 - 2 * bits).to(torch.int32)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[..., 4k] uint8 -> [..., k] int64 (little-endian uint32)."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2k] int64: per byte its low then high nibble."""
    b = b.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def _per16(v: torch.Tensor) -> torch.Tensor:
    """[N, nsb, 16] -> [N, nsb, 256]: each value over its 16 weights."""
    return v.unsqueeze(-1).expand(*v.shape, 16).reshape(*v.shape[:-1], 256)


def _k_values(b: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Q2_K / Q3_K: the 2-bit q (Q3_K: with its third bit, hmask) of each value, [N, nsb, 256]."""
    n, nsb = b.shape[:2]
    qs = b[..., 16:80] if qtype == Q.Q2_K else b[..., 32:96]
    shifts = torch.arange(0, 8, 2, dtype=torch.int64).reshape(1, 1, 1, 4, 1)
    q = (qs.to(torch.int64).reshape(n, nsb, 2, 1, 32) >> shifts) & 3          # [half][j][l]
    q = q.reshape(n, nsb, 256)
    if qtype == Q.Q3_K:
        hbit = (b[..., 0:32].to(torch.int64).reshape(n, nsb, 1, 32) >> torch.arange(8).reshape(1, 1, 8, 1)) & 1
        q = q | (hbit.reshape(n, nsb, 256) << 2)
    return q


def _k_unpack(b: torch.Tensor, qtype: Q) -> dict:
    q = _k_values(b, qtype)
    if qtype == Q.Q2_K:
        sc = b[..., 0:16].to(torch.int64)
        return {"w": q * _per16(sc & 0xF), "mn": _per16(sc >> 4), "d": _f16(b[..., 80:82]), "dmin": _f16(b[..., 82:84])}
    s = b[..., 96:108].to(torch.int64)
    i = torch.arange(16)
    lo = (s[..., i % 8] >> (4 * (i // 8))) & 0xF
    hi = (s[..., 8 + i % 4] >> (2 * (i // 4))) & 3
    sc = (lo | (hi << 4)) - 32
    return {"w": (q - 4) * _per16(sc), "mn": None, "d": _f16(b[..., 108:110]), "dmin": None}


def _tq_values(b: torch.Tensor, qtype: Q) -> torch.Tensor:
    """TQ1_0 / TQ2_0: each value's q (0..2 / 0..3), [N, nsb, 256], in ggml's order."""
    n, nsb = b.shape[:2]
    if qtype == Q.TQ2_0:
        shifts = torch.arange(0, 8, 2, dtype=torch.int64).reshape(1, 1, 1, 4, 1)
        return ((b[..., 0:64].to(torch.int64).reshape(n, nsb, 2, 1, 32) >> shifts) & 3).reshape(n, nsb, 256)
    pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int64)

    def trits(q: torch.Tensor, k: int) -> torch.Tensor:   # [.., m] bytes -> [.., k, m]: trit j of each
        return ((q.to(torch.int64).unsqueeze(-2) * pow3[:k, None]) % 256 * 3) >> 8

    parts = [trits(b[..., 0:32], 5), trits(b[..., 32:48], 5), trits(b[..., 48:52], 4)]
    return torch.cat([p.reshape(n, nsb, -1) for p in parts], -1)


def _iq1_values(b: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ1_S / IQ1_M: (8 g +- 1 [N, nsb, 256], integer scales 2 s + 1 [N, nsb, 16])."""
    n, nsb = b.shape[:2]
    g = grid(qtype)
    if qtype == Q.IQ1_S:
        qh = b[..., 34:50].to(torch.int64).reshape(n, nsb, 8, 2)
        qh = qh[..., 0] | (qh[..., 1] << 8)                                              # [N, nsb, 8]
        idx = b[..., 2:34].to(torch.int64).reshape(n, nsb, 8, 4) | (((qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7) << 8)
        neg = ((qh >> 15) & 1).reshape(n, nsb, 8, 1, 1).expand(n, nsb, 8, 4, 1)
        sc = (2 * ((qh >> 12) & 7) + 1).repeat_interleave(2, -1)
    else:
        h = _nibbles(b[..., 32:48]).reshape(n, nsb, 8, 4)                                 # group 4 ib + l
        idx = b[..., 0:32].to(torch.int64).reshape(n, nsb, 8, 4) | ((h & 7) << 8)
        neg = (h >> 3).unsqueeze(-1)
        sw = b[..., 48:56].to(torch.int64).reshape(n, nsb, 4, 2)
        sw = sw[..., 0] | (sw[..., 1] << 8)                                              # [N, nsb, 4]
        sc = (2 * ((sw.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7) + 1).reshape(n, nsb, 16)
    vals = 8 * g[idx] + 1 - 2 * neg                                                        # [N, nsb, 8, 4, 8]
    return vals.reshape(n, nsb, 256), sc


def iq1m_d(b: torch.Tensor) -> torch.Tensor:
    """IQ1_M's float16 d [N, nsb] from the top 4 bits of its 4 scale words (bytes 48..55)."""
    sw = b[..., 48:56].to(torch.int32).reshape(*b.shape[:2], 4, 2)
    sw = sw[..., 0] | (sw[..., 1] << 8)
    bits = (sw[..., 0] >> 12) | ((sw[..., 1] >> 8) & 0xF0) | ((sw[..., 2] >> 4) & 0xF00) | (sw[..., 3] & 0xF000)
    return bits.to(torch.int16).view(torch.float16).float()


def _iq_values(b: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ grid types: (signed values [N, nsb, 256], integer scales [N, nsb, 16])."""
    n, nsb = b.shape[:2]
    if qtype in (Q.IQ1_S, Q.IQ1_M):
        return _iq1_values(b, qtype)
    g = grid(qtype)
    if qtype in (Q.IQ2_XXS, Q.IQ3_XXS):
        if qtype == Q.IQ2_XXS:
            q = b[..., 2:66].reshape(n, nsb, 8, 8)
            vals = g[q[..., 0:4].long()]                                          # [.., 8, 4, 8]
            aux = _u32(q[..., 4:8]).squeeze(-1)                                   # [N, nsb, 8]
        else:
            vals = g[b[..., 2:66].long()].reshape(n, nsb, 8, 4, 8)
            aux = _u32(b[..., 66:98])
        sg = signs(True)[(aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21])) & 127]   # [.., 8, 4, 8]
        sc = (2 * (aux >> 28) + 1).repeat_interleave(2, -1)
        return (vals * sg).reshape(n, nsb, 256), sc
    if qtype == Q.IQ2_XS:
        q = b[..., 2:66].to(torch.int64).reshape(n, nsb, 32, 2)
        q = q[..., 0] | (q[..., 1] << 8)
        vals, sg = g[q & 511], signs(True)[q >> 9]
        return (vals * sg).reshape(n, nsb, 256), 2 * _nibbles(b[..., 66:74]) + 1
    if qtype == Q.IQ2_S:
        qh = (b[..., 66:74].to(torch.int64).unsqueeze(-1) >> torch.tensor([0, 2, 4, 6])) & 3
        idx = b[..., 2:34].to(torch.int64) | (qh.reshape(n, nsb, 32) << 8)
        vals, sg = g[idx], signs(False)[b[..., 34:66].long()]
        return (vals * sg).reshape(n, nsb, 256), 2 * _nibbles(b[..., 74:82]) + 1
    # IQ3_S
    qh = (b[..., 66:74].to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1
    idx = b[..., 2:66].to(torch.int64) | (qh.reshape(n, nsb, 64) << 8)
    vals = g[idx].reshape(n, nsb, 32, 8)
    sg = signs(False)[b[..., 74:106].long()]
    sc = (1 + 2 * _nibbles(b[..., 106:110])).repeat_interleave(2, -1)
    return (vals * sg).reshape(n, nsb, 256), sc


def unpack(b: torch.Tensor, qtype: Q) -> dict:
    """b: uint8 [N, nsb, block bytes] -> {"w": int32 [N, nsb, 256] (scale * value), "mn": int32
    [N, nsb, 256] (Q2_K's min per value) or None, "d": f32 [N, nsb], "dmin": f32 [N, nsb] or None}."""
    if qtype in (Q.Q2_K, Q.Q3_K):
        u = _k_unpack(b, qtype)
    elif qtype in (Q.TQ1_0, Q.TQ2_0):
        u = {"w": _tq_values(b, qtype) - 1, "mn": None, "d": _f16(b[..., -2:]), "dmin": None}
    else:
        vals, sc = _iq_values(b, qtype)
        d = iq1m_d(b) if qtype == Q.IQ1_M else _f16(b[..., 0:2])
        u = {"w": vals.to(torch.int64) * _per16(sc), "mn": None, "d": d * D_SCALE.get(qtype, 1.0), "dmin": None}
    u["w"] = u["w"].to(torch.int32)
    if u["mn"] is not None:
        u["mn"] = u["mn"].to(torch.int32)
    return u
