"""Pure-PyTorch reference of the GGUF int8-activation matmul (fallback and test oracle).

The math, which the native kernels reproduce bit for bit (docs/kernels.md):

* Activations are quantized per row, in blocks of 32 values (every type, the k-quants too):
  ``amax = max|x|``, ``dx = amax / 127``,
  ``id = 127 / amax`` (0 when amax == 0), ``q = round_half_even(x * id)`` as int8; all float32.
* Per 32-value block b the integer dot products are exact int32 (any summation order gives the
  same integer), then one fixed float32 formula gives the block's term ``t_b`` (k-quants: d,
  dmin are the block's superblock scales, sc/m its sub-block scales, bsum sums of xq):

  - Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4: ``t = (dw * dx) * float(isum)``, isum = sum (q - offset) * xq
    (IQ4_NL: q = the table value kvalues_iq4nl[index], offset 0; MXFP4: q = twice the E2M1
    value, kvalues_mxfp4[code], and dw = 2^(e - 128), half the E8M0 scale, as ggml computes it)
  - Q4_1 / Q5_1:        ``t = (dw * dx) * float(isum) + mw * (dx * float(sum xq))``
  - Q4_K / Q5_K:        ``t = (d * dx) * float(sc * dot) - (dmin * dx) * float(m * bsum)``
  - Q6_K:               ``t = (d * dx) * float(sum_{two 16-value halves i} sc_i (dot_i - 32 bsum_i))``
  - IQ4_XS:             ``t = (d * dx) * float(sc * dot)``, sc = the sub-block's 6-bit scale - 32,
                        dot over the table values
  - Q3_K, TQ1_0 / TQ2_0 and the IQ1 / IQ2 / IQ3 grid types: as Q6_K, ``t = (d * dx) * float(sum_i
                        sc_i dot_i)`` over the chunk's two 16-value halves (Q3_K: dot over q - 4;
                        TQ: over q - 1, sc_i = 1; IQ1: over 8 g +- 1; IQ2 / IQ3: over the signed
                        grid values; IQ: d times a power of two); Q2_K: that ``- (dmin * dx) *
                        float(sum_i m_i bsum_i)`` (lowbit.py)

* The output is ``((t_0 + t_1) + t_2) + ...``: blocks added in order, one float32 accumulator per
  output element. Nothing depends on M, on the other rows, or on the thread count.
* F16 / BF16 weights (stored as such, widened exactly): no activation quantization; the output
  is ``((0 + w_0 x_0) + w_1 x_1) + ...`` in float32, k in order, a multiply then an add each.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
import gguf.quants

from .lowbit import LOWBIT, unpack as unpack_lowbit

SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16,
             Q.Q3_K, Q.Q2_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.MXFP4, Q.TQ1_0, Q.TQ2_0,
             Q.IQ1_S, Q.IQ1_M)
FLOAT_W = (Q.F16, Q.BF16)   # float weights kept as stored, float32 activations
# 256-value super-blocks with per-32 or per-16 integer scales (IQ4_XS and the low-bit types are
# computed like them)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS) + LOWBIT
# IQ4_NL / IQ4_XS: 4-bit indices into this table (ggml's kvalues_iq4nl)
IQ4_VALUES = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.int32)
# MXFP4: 4-bit E2M1 codes -> twice their value (ggml's kvalues_mxfp4); the E8M0 scale is halved
MXFP4_VALUES = torch.tensor(gguf.quants.MXFP4.kvalues, dtype=torch.int32)
# bound on M * N * blocks elements per reference chunk (memory of the fallback path)
_CHUNK = 1 << 22


def act_block(qtype: Q) -> int:
    """Activation quantization block: 32 values for every type.

    (llama.cpp uses 256-value Q8_K blocks for the k-quants; on Gemma 3's outlier activations
    that cost 0.013 nats/token against float, 32-value blocks cost ~0; docs/kernels.md.)"""
    return 32


def quantize_activations(x: torch.Tensor, qb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (xq int8 [M, K//qb, qb], dx float32 [M, K//qb])."""
    m, k = x.shape
    xb = x.float().reshape(m, k // qb, qb)
    amax = xb.abs().amax(-1)
    dx = amax / 127.0
    # torch.full_like(...) / amax: a true division (python_scalar / tensor would be reciprocal * 127)
    inv = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return xq, dx


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's E8M0 bytes [...] uint8 -> 2^(e - 128) float32 [...] (ggml's GGML_E8M0_TO_FP32_HALF;
    e < 2 give subnormals), exact."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 -> [..., 32] int32: low nibbles then high nibbles."""
    qs = qs.to(torch.int32)
    return torch.cat([qs & 0xF, qs >> 4], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 (little-endian uint32) -> [..., 32] int32 bits."""
    qh = qh.to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], 32)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed 6-bit scales [..., 12] uint8 -> (scales, mins) int32 [..., 8]."""
    q = sc.to(torch.int32)
    lo_s = q[..., 0:4] & 63
    lo_m = q[..., 4:8] & 63
    hi_s = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    hi_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat([lo_s, hi_s], -1), torch.cat([lo_m, hi_m], -1)


def _iq4xs(b: torch.Tensor) -> dict:
    n = b.shape[0]
    sh = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)          # [N, nsb]
    sl = b[..., 4:8].to(torch.int32).repeat_interleave(2, -1)                 # [N, nsb, 8]
    j = torch.arange(8, dtype=torch.int32, device=b.device)
    sc = (((sl >> (4 * (j % 2))) & 0xF) | (((sh.unsqueeze(-1) >> (2 * j)) & 3) << 4)) - 32
    q = IQ4_VALUES.to(b.device)[_nibbles(b[..., 8:].reshape(n, -1, 8, 16))]  # [N, nsb, 8, 32]
    return {"w": (q * sc.unsqueeze(-1)).reshape(n, -1, 256), "mn": None, "d": _f16(b[..., 0:2]), "dmin": None}


def unpack(raw: torch.Tensor, qtype: Q, k: int) -> dict:
    """raw uint8 [N, row_bytes] -> integer weights and per-block float scales.

    32-block types: {"w": int32 [N, nb, 32] (q - offset), "d": f32 [N, nb], "m": f32 [N, nb] or None}
    k-quants:       {"w": int32 [N, nsb, 256] (scale * q), "mn": int32 [N, nsb, 256] (min per element)
                     or None, "d": f32 [N, nsb], "dmin": f32 [N, nsb] or None}
    """
    block, size = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    b = raw.reshape(n, k // block, size)
    if qtype in LOWBIT:
        return unpack_lowbit(b, qtype)
    if qtype == Q.Q8_0:
        return {"w": b[..., 2:].contiguous().view(torch.int8).to(torch.int32), "d": _f16(b[..., 0:2]), "m": None}
    if qtype == Q.Q4_0:
        return {"w": _nibbles(b[..., 2:]) - 8, "d": _f16(b[..., 0:2]), "m": None}
    if qtype == Q.IQ4_NL:
        return {"w": IQ4_VALUES.to(raw.device)[_nibbles(b[..., 2:])], "d": _f16(b[..., 0:2]), "m": None}
    if qtype == Q.IQ4_XS:
        return _iq4xs(b)
    if qtype == Q.MXFP4:
        return {"w": MXFP4_VALUES.to(raw.device)[_nibbles(b[..., 1:])], "d": e8m0_half(b[..., 0]), "m": None}
    if qtype == Q.Q4_1:
        return {"w": _nibbles(b[..., 4:]), "d": _f16(b[..., 0:2]), "m": _f16(b[..., 2:4])}
    if qtype == Q.Q5_0:
        return {"w": (_nibbles(b[..., 6:]) | (_bits32(b[..., 2:6]) << 4)) - 16, "d": _f16(b[..., 0:2]), "m": None}
    if qtype == Q.Q5_1:
        w = _nibbles(b[..., 8:]) | (_bits32(b[..., 4:8]) << 4)
        return {"w": w, "d": _f16(b[..., 0:2]), "m": _f16(b[..., 2:4])}
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])  # [N, nsb, 8]
        if qtype == Q.Q4_K:
            qs = b[..., 16:144].to(torch.int32).reshape(n, -1, 4, 32)  # 4 chunks of 64 values
            q = torch.stack([qs & 0xF, qs >> 4], 3)  # [N, nsb, 4, 2, 32]
        else:
            qh = b[..., 16:48].to(torch.int32)  # [N, nsb, 32]
            qs = b[..., 48:176].to(torch.int32).reshape(n, -1, 4, 32)
            shifts = torch.arange(8, dtype=torch.int32, device=raw.device).reshape(4, 2, 1)
            hbit = (qh.unsqueeze(2).unsqueeze(2) >> shifts) & 1  # [N, nsb, 4, 2, 32]
            q = torch.stack([qs & 0xF, qs >> 4], 3) | (hbit << 4)
        q = q.reshape(n, -1, 8, 32)
        w = (q * sc.unsqueeze(-1)).reshape(n, -1, 256)
        mnv = mn.unsqueeze(-1).expand(n, mn.shape[1], 8, 32).reshape(n, -1, 256)
        return {"w": w, "mn": mnv, "d": d, "dmin": dmin}
    if qtype == Q.Q6_K:
        ql = b[..., 0:128].to(torch.int32).reshape(n, -1, 2, 2, 32)  # [half][ql lo/hi 32][l]
        qh = b[..., 128:192].to(torch.int32).reshape(n, -1, 2, 32)  # [half][l]
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int32)  # [N, nsb, 16]
        d = _f16(b[..., 208:210])
        hs = [(qh >> s) & 3 for s in (0, 2, 4, 6)]
        q1 = (ql[:, :, :, 0] & 0xF) | (hs[0] << 4)
        q2 = (ql[:, :, :, 1] & 0xF) | (hs[1] << 4)
        q3 = (ql[:, :, :, 0] >> 4) | (hs[2] << 4)
        q4 = (ql[:, :, :, 1] >> 4) | (hs[3] << 4)
        q = torch.stack([q1, q2, q3, q4], 3).reshape(n, -1, 16, 16)  # [N, nsb, 16 sub-blocks, 16]
        w = ((q - 32) * sc.unsqueeze(-1)).reshape(n, -1, 256)
        return {"w": w, "mn": None, "d": d, "dmin": None}
    raise NotImplementedError(qtype.name)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, n: int, k: int) -> torch.Tensor:
    """Y[M, N] float32 = X[M, K] @ W[N, K]^T, W as GGUF bytes raw uint8 [N, row_bytes]."""
    qtype = Q(qtype)
    x = x.float().reshape(-1, k)
    if qtype in FLOAT_W:
        return _float_matmul(x, raw, qtype, n, k)
    m = x.shape[0]
    qb = act_block(qtype)
    xq, dx = quantize_activations(x, qb)  # [M, nb, qb], [M, nb]
    nb = k // qb
    xq64 = xq.to(torch.float64)
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    step = max(1, _CHUNK // max(1, m * nb))
    bsx = xq.to(torch.int32).sum(-1).float() if qtype in (Q.Q4_1, Q.Q5_1) else None
    for n0 in range(0, n, step):
        u = unpack(raw[n0 : n0 + step], qtype, k)
        nc = u["w"].shape[0]
        w, d = u["w"], u["d"]
        if qtype in K_QUANTS:  # per 32-value chunk: its superblock's scales
            w, d = w.reshape(nc, nb, 32), d.repeat_interleave(8, 1)
        # exact integer dot products per block: float64 holds these integers exactly
        isum = torch.einsum("mbk,nbk->mnb", xq64, w.to(torch.float64)).to(torch.float32)
        dd = d.unsqueeze(0) * dx.unsqueeze(1)  # [M, Nc, nb]
        t = dd * isum
        if qtype in (Q.Q4_1, Q.Q5_1):
            sx = dx * bsx  # [M, nb]
            t = t + u["m"].unsqueeze(0) * sx.unsqueeze(1)
        elif u.get("mn") is not None:   # Q4_K, Q5_K, Q2_K
            mn = u["mn"].reshape(nc, nb, 32).to(torch.float64)
            imn = torch.einsum("mbk,nbk->mnb", xq64, mn).to(torch.float32)
            t = t - (u["dmin"].repeat_interleave(8, 1).unsqueeze(0) * dx.unsqueeze(1)) * imn
        acc = torch.zeros(m, t.shape[1], dtype=torch.float32, device=x.device)
        for b in range(nb):
            acc = acc + t[:, :, b]
        out[:, n0 : n0 + step] = acc
    return out


def _float_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: Q, n: int, k: int) -> torch.Tensor:
    """F16 / BF16: each output one float32 chain over k in order (csrc/float_matmul.inc)."""
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK // max(1, x.shape[0] * 64))
    for n0 in range(0, n, step):
        w = dequantize(raw[n0 : n0 + step], qtype, (min(step, n - n0), k))   # exact widening
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
        for j in range(k):
            acc = acc + x[:, j : j + 1] * w[:, j]
        out[:, n0 : n0 + step] = acc
    return out


def dequantize(raw: torch.Tensor | np.ndarray, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    """[N, K] float32, bit-exact with gguf.quants.dequantize."""
    qtype = Q(qtype)
    t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
    n = t.shape[0]
    if n == 0:
        return torch.empty(shape, dtype=torch.float32, device=t.device)
    if not t.is_cpu:  # gguf's block kernels are numpy: decode on the CPU, return on t's device
        return dequantize(t.cpu(), qtype, shape).to(t.device)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT_W:      # exact widening (gguf's own: f16 -> f32, bf16 << 16)
        return t.contiguous().view(torch.float16 if qtype == Q.F16 else torch.bfloat16).float().reshape(n, shape[1])
    if qtype == Q.Q8_0:
        # gguf's own arithmetic (f16 scale -> f32, times int8 -> f32), in torch
        b = t.reshape(-1, size)
        d = b[:, :2].contiguous().view(torch.float16).float()
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, shape[1])
    # the package's block kernel on all blocks at once (its dequantize() loops over groups of
    # rows in Python); elementwise, so the same values
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()   # the IQ types' grids (gguf's own dequantize() does this first)
    out = cls.dequantize_blocks(t.contiguous().numpy().reshape(-1, size))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(n, shape[1]))
