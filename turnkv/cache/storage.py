"""KV storage: where attention caches keep K and V, in the layer's storage mode.

A store is a slot array ``[heads, capacity, ...]`` for K and V: a layer's block pool
(cache/blocks.py) decides which token sits in which slot; the store only writes, decodes (to the
compute dtype), loads and exports slots.
Payloads (what snapshots keep) are dicts of tensors whose dim 1 is the token axis, in the stored
representation: a quantized snapshot keeps the quantized bytes as they are, and loading it back
is a copy, never a re-quantization.

Quantized modes quantize every token and head on its own (int8: one scale per token and head;
int4: one scale per group of channels, ``int4_groups``), so a token's stored bytes depend only on
its own K/V: a prefix stored in chunks, one token at a time or all at once is the same bytes, and
a snapshot of it equals a cold prefill's. Both are symmetric with float16 scales: per-token K/V
rows are close to zero-centred, and a zero point would cost bytes (int4 would fall from 3.6x to
3.2x smaller than bf16) while measuring worse than symmetric once keys are rotated. int4 keys are
stored rotated (see ``quantize_int4``), which roughly halves their NLL cost; values need no
rotation (4-bit values alone cost ~0.005 nats/token).

Reads dequantize the whole range every call (a decode step reads the whole context), with no
dequantized shadow: a float shadow would make a quantized live cache larger than a native one,
and the KV-read cost it would save is measured by bench/kv_modes.py.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch

NATIVE = "native"
MODES = ("native", "bf16", "fp16", "int8", "int4")

SCALE_DTYPE = torch.float16
INT4_GROUP = 32
# Scales are clamped into float16's finite, non-zero range so a zero or tiny row never divides by
# zero; values are quantized against the rounded scale, so the clamp costs no accuracy that matters.
_SCALE_MIN = 2.0 ** -24
_SCALE_MAX = 65504.0


# --- codecs (pure functions over [heads, T, head_dim]) ---------------------------------------------

def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q int8 [H, T, D] in -127..127, scale float16 [H, T, 1]); x ~= q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)
    q = torch.round(xf / scale.float()).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # int8 x float16-representable scale is exact in float32, so float32 reads are exactly q * scale.
    return torch.mul(q, scale.to(dtype))


def int4_group_size(head_dim: int) -> int:
    """``INT4_GROUP`` channels per scale; the whole head when it is smaller, and the largest
    divisor below ``INT4_GROUP`` for head sizes that are not a multiple of it (80 -> 20)."""
    if head_dim % 2:
        raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}")
    return next(g for g in range(min(INT4_GROUP, head_dim), 0, -1) if head_dim % g == 0)


# Heads at least this wide (a multiple of it) store int4 keys in groups of INT4_KEY_GROUP_WIDE and
# values in groups of INT4_VALUE_GROUP_WIDE: keys are where 4 bits lose (on Gemma 3, keys alone
# cost ~10x what values cost), and the finer key scales are paid for by coarser value scales, so
# the store stays 3.5x smaller than bf16 (Gemma 3 270M, 4096 tokens of coriolanus.txt: +0.054 ->
# +0.036 nats/token, bench/kv_modes.py). Narrower heads keep INT4_GROUP for both (at head_dim 64
# the same split would fall below 3.5x).
INT4_WIDE_HEAD = 128
INT4_KEY_GROUP_WIDE = 16
INT4_VALUE_GROUP_WIDE = 128


def int4_groups(head_dim: int) -> dict[str, int]:
    """Channels per scale for int4 keys and values of a head of ``head_dim`` channels."""
    if head_dim >= INT4_WIDE_HEAD and head_dim % INT4_WIDE_HEAD == 0:
        return {"k": INT4_KEY_GROUP_WIDE, "v": INT4_VALUE_GROUP_WIDE}
    g = int4_group_size(head_dim)
    return {"k": g, "v": g}


def rotation_size(group: int) -> int:
    """Channels one Hadamard block of the int4 key rotation spans: the largest power of two that
    divides the scale group (a block must share one scale), so 32 for heads of 64, 128, 256."""
    r = 1
    while group % (2 * r) == 0:
        r *= 2
    return r


def _rotation_signs(n: int) -> list[int]:
    """A fixed pseudo-random +-1 pattern (a 32-bit LCG's top bit), the same on every machine."""
    state, signs = 0x6B76, []
    for _ in range(n):
        state = (state * 1664525 + 1013904223) % 2**32
        signs.append(-1 if state >> 31 else 1)
    return signs


_ROTATIONS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def rotation(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs [n], matrix [n, n]) of the key rotation R = diag(signs) @ H / sqrt(n), H the +-1
    Sylvester Hadamard matrix: ``x @ R`` flips signs then mixes the block; it is undone by
    ``y @ R.T``, and ``matrix = (diag(signs) @ H).T`` has +-1 entries, so ``q @ matrix`` over small
    integers is exact in float32."""
    key = (n, str(device))
    if key not in _ROTATIONS:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.tensor(_rotation_signs(n), dtype=torch.float32)
        _ROTATIONS[key] = (signs.to(device), (signs[:, None] * h).T.contiguous().to(device))
    return _ROTATIONS[key]


def fwht(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ H`` (unnormalized Hadamard) on each block of ``n`` channels, by butterflies:
    elementwise adds in a fixed order, so a token's result never depends on how many tokens are
    transformed with it (a matmul may change its summation order with the batch shape)."""
    shape = x.shape
    h = 1
    while h < n:
        y = x.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(shape)


def quantize_int4(x: torch.Tensor, group: int, rotate: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed uint8 [H, T, D/2], scale float16 [H, T, D/group]).

    Each group's value of largest magnitude ``m`` maps to -8 exactly (scale = m / -8, as
    llama.cpp's Q4_0), so the 16 levels -8..7 are all used. With ``rotate`` (a power of two
    dividing ``group``), each block of ``rotate`` channels is first rotated (``rotation``): that
    spreads an outlier channel (post-RoPE keys have a few) over the block, so it no longer sets a
    coarse scale for its neighbours. Byte ``j`` holds channel ``j`` in its low nibble and channel
    ``j + D/2`` in its high nibble, so unpacking is two shifts and a stack with no interleave."""
    H, T, D = x.shape
    xf = x.float()
    if rotate:
        signs, _ = rotation(rotate, x.device)
        xf = fwht((xf.view(H, T, D // rotate, rotate) * signs).view(H, T, D), rotate) * rotate ** -0.5
    xg = xf.reshape(H, T, D // group, group)
    s = xg.gather(-1, xg.abs().argmax(-1, keepdim=True)) / -8
    s = torch.where(s.abs() < _SCALE_MIN, _SCALE_MIN, s).clamp_(-_SCALE_MAX, _SCALE_MAX).to(SCALE_DTYPE)
    q = torch.round(xg / s.float()).clamp_(-8, 7).to(torch.int8).view(H, T, D)
    packed = (q[..., : D // 2] & 15) | (q[..., D // 2:] << 4)
    return packed.view(torch.uint8), s.squeeze(-1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [H, S, D/2] -> int8 [H, S, D] in -8..7."""
    p = packed.view(torch.int8)
    # arithmetic shifts on int8 sign-extend the nibbles back to -8..7
    H, S, half = p.shape
    return torch.stack(((p << 4) >> 4, p >> 4), dim=-2).view(H, S, 2 * half)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rotate: int = 0) -> torch.Tensor:
    q = unpack_int4(packed)
    H, S, D = q.shape
    G = scale.shape[-1]
    if not rotate:
        return torch.mul(q.view(H, S, G, -1), scale.to(dtype)[..., None]).view(H, S, D)
    # Undo the rotation on the integers: q @ matrix sums small integers, exact in float32 in any
    # order, so this GEMM gives the same bits whatever the shape; one rounding in the scale multiply.
    y = torch.matmul(q.view(H, S, D // rotate, rotate).float(), rotation(rotate, q.device)[1])
    y.view(H, S, G, -1).mul_((scale.float() * rotate ** -0.5)[..., None])    # y is ours: no new buffer
    return y.view(H, S, D).to(dtype)


# --- stores ---------------------------------------------------------------------------------------

_FLOAT_STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class KVStore:
    """Plain float storage; ``native`` keeps the compute dtype, bf16/fp16 cast on write and read.

    Storage is a dict of named parts (``k``, ``v`` and, for quantized subclasses, their scales),
    each ``[heads, capacity, width]``; slot bookkeeping (grow, move, export, load, nbytes) is
    shared, subclasses only say how a token is encoded and decoded."""

    # name suffixes of the tensors one of K or V is stored as ("" = the values themselves)
    SUFFIXES: ClassVar[tuple[str, ...]] = ("",)
    # how the native attention call may write these buffers itself (kernels.attention.write_attend):
    # "plain" (``k`` / ``v`` hold the values, a cast of them at most, rounded as ``copy_`` rounds),
    # "int8" (``Int8Store``: int8 values and float16 scales, computed as ``quantize_int8`` does), or
    # None (the store encodes in Python)
    native_layout: ClassVar[str | None] = "plain"
    # ``decode_side(i, stored, scale)``: keys (0) or values (1) from the rows ``stored_of`` hands out
    # and their ``scales_of``, for a view's readers other than the native kernel; None: the view
    # widens them itself (float16 / bfloat16 / int8)
    decode_side: ClassVar[Callable | None] = None

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device, mode: str = NATIVE, capacity: int = 0):
        self.heads, self.head_dim = heads, head_dim
        self.dtype, self.device, self.mode = dtype, torch.device(device), mode
        self.layout = self._layout()
        self.parts: dict[str, torch.Tensor] = {}
        self.capacity = 0
        if capacity:
            self.grow(capacity, keep=0)

    # --- what a subclass defines -------------------------------------------------------------------
    def _widths(self) -> tuple[tuple[int, torch.dtype], ...]:
        """(width, dtype) of each stored tensor of K (and of V), aligned with SUFFIXES."""
        return ((self.head_dim, self.storage_dtype),)

    def _encode(self, which: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``which`` is "k" or "v"; returns the tensors stored for it, aligned with SUFFIXES."""
        return (x,)  # the cast happens in the copy into storage

    def _decode(self, which: str, stored: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = stored[0]
        return x if x.dtype == self.dtype else x.to(self.dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return _FLOAT_STORAGE.get(self.mode, self.dtype)

    @property
    def parts_dtype(self) -> torch.dtype:
        """The element type of the ``k`` / ``v`` buffers (int8 for ``Int8Store``)."""
        return self.layout["k"][1]

    # --- shared slot machinery ---------------------------------------------------------------------
    def _layout(self) -> dict[str, tuple[int, torch.dtype]]:
        return {f"{which}{suffix}": wd for which in ("k", "v") for suffix, wd in zip(self.SUFFIXES, self._widths())}

    @property
    def k(self) -> torch.Tensor | None:
        return self.parts.get("k")

    @property
    def v(self) -> torch.Tensor | None:
        return self.parts.get("v")

    def grow(self, capacity: int, keep: int) -> None:
        if capacity <= self.capacity:
            return
        parts = {name: torch.empty((self.heads, capacity, width), dtype=dt, device=self.device)
                 for name, (width, dt) in self.layout.items()}
        if keep:
            for name, t in parts.items():
                t[:, :keep].copy_(self.parts[name][:, :keep])
        self.parts, self.capacity = parts, capacity

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        for which, x in (("k", k), ("v", v)):
            for suffix, t in zip(self.SUFFIXES, self._encode(which, x)):
                self.parts[which + suffix][:, slot:slot + n].copy_(t)

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) in the compute dtype from stored rows (a payload: this store's parts)."""
        return tuple(self._decode(which, tuple(parts[which + s] for s in self.SUFFIXES)) for which in ("k", "v"))

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of slots ``[a, b)`` in the compute dtype."""
        return self.decode({name: t[:, a:b] for name, t in self.parts.items()})

    def stored_of(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored K/V rows themselves when they are a plain float16 / bfloat16 copy of the
        values (``fp16``, ``bf16``: no scales), for a reader that widens them itself (the native
        attention kernel); None otherwise (``decode`` then)."""
        if self.mode not in _FLOAT_STORAGE or self.SUFFIXES != ("",) or self.storage_dtype == self.dtype:
            return None
        return parts["k"], parts["v"]

    def scales_of(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With ``stored_of``: the per-row scales its int8 rows come with (``Int8Store``), else None."""
        return None

    def export(self, a: int, b: int) -> dict[str, torch.Tensor]:
        return {name: t[:, a:b].clone() for name, t in self.parts.items()}

    def check_payload(self, payload: dict[str, torch.Tensor]) -> int:
        """The payload's length, after checking it holds this store's tensors (names, shapes, dtypes)."""
        n = payload_len(payload)
        want = {name: ((self.heads, n, width), dt) for name, (width, dt) in self.layout.items()}
        got = {name: (tuple(t.shape), t.dtype) for name, t in payload.items()}
        if got != want:
            raise ValueError(f"{self.mode} KV payload must be {want}, got {got}")
        return n

    def load(self, slot: int, payload: dict[str, torch.Tensor]) -> None:
        n = self.check_payload(payload)
        for name, t in payload.items():
            self.parts[name][:, slot:slot + n].copy_(t)

    def load_many(self, slot: int, payloads: list[dict[str, torch.Tensor]]) -> None:
        """Consecutive payloads into consecutive slots from ``slot``: one concatenation per tensor
        straight into the slots (many small copies cost more in dispatch than in bytes)."""
        n = sum(self.check_payload(p) for p in payloads)
        for name, t in self.parts.items():
            torch.cat([p[name] for p in payloads], 1, out=t[:, slot:slot + n])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def bytes_per_token(self) -> int:
        return sum(self.heads * width * torch.empty((), dtype=dt).element_size()
                   for width, dt in self.layout.values())


class Int8Store(KVStore):
    """int8 values with one float16 scale per token and head (symmetric, absmax / 127)."""

    SUFFIXES = ("", "_scale")
    native_layout = "int8"

    def _widths(self):
        return ((self.head_dim, torch.int8), (1, SCALE_DTYPE))

    def _encode(self, which, x):
        return quantize_int8(x)

    def _decode(self, which, stored):
        return dequantize_int8(stored[0], stored[1], self.dtype)

    def stored_of(self, parts):
        """The int8 rows as stored, for the native attention kernel, which reads ``q * scale``
        (``scales_of``) exactly as ``_decode`` computes it; float32 compute only."""
        if self.dtype != torch.float32:
            return None
        return parts["k"], parts["v"]

    def scales_of(self, parts):
        return parts["k_scale"], parts["v_scale"]


class Int4Store(KVStore):
    """4-bit values, two per byte, with one float16 scale per token, head and group of channels.

    Keys are stored rotated (random signs + Hadamard over blocks of ``rotation["k"]`` channels):
    their outlier channels are what 4 bits lose most on, while values quantize well as they are
    (bench/kv_modes.py). The rotation is undone on read, exactly and in the same GEMM as before."""

    SUFFIXES = ("", "_scale")
    native_layout = None

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device, mode: str = "int4", capacity: int = 0):
        self.groups = int4_groups(head_dim)
        self.rotation = {"k": rotation_size(self.groups["k"]), "v": 0}
        super().__init__(heads, head_dim, dtype, device, mode, capacity)

    def _layout(self):
        return {f"{which}{suffix}": wd for which in ("k", "v")
                for suffix, wd in zip(self.SUFFIXES, ((self.head_dim // 2, torch.uint8),
                                                      (self.head_dim // self.groups[which], SCALE_DTYPE)))}

    def _encode(self, which, x):
        return quantize_int4(x, self.groups[which], self.rotation[which])

    def _decode(self, which, stored):
        return dequantize_int4(stored[0], stored[1], self.dtype, self.rotation[which])

    def stored_of(self, parts):
        """The packed rows as stored, for the native attention kernel, which widens them to exactly
        what ``_decode`` computes (keys' rotation undone on the integers); float32 compute only."""
        if self.dtype != torch.float32:
            return None
        return parts["k"], parts["v"]

    def scales_of(self, parts):
        return parts["k_scale"], parts["v_scale"]

    def decode_side(self, i: int, stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Keys (``i`` 0) or values (1) from their stored rows and scales, as ``decode`` gives them."""
        return self._decode("kv"[i], (stored, scale))


def payload_len(payload: dict[str, torch.Tensor]) -> int:
    return next(iter(payload.values())).shape[1]


def slice_payload(payload: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    return {name: t[:, a:b] for name, t in payload.items()}


STORES: dict[str, type[KVStore]] = {"native": KVStore, "bf16": KVStore, "fp16": KVStore,
                                    "int8": Int8Store, "int4": Int4Store}


def make_store(mode: str, heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 0) -> KVStore:
    if mode not in STORES:
        raise ValueError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(MODES)}")
    return STORES[mode](heads, head_dim, dtype, device, mode=mode, capacity=capacity)


# --- the per-layer table ----------------------------------------------------------------------------

def layer_modes(attention_layers: list[bool], mode: str = NATIVE, boundary_layers: int = 0) -> list[str]:
    """Per-layer mode table: ``mode`` on attention layers except the first and last
    ``boundary_layers`` attention layers; ``native`` everywhere else."""
    if mode not in MODES:
        raise ValueError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(MODES)}")
    if boundary_layers < 0:
        raise ValueError(f"kv boundary layers must be >= 0, got {boundary_layers}")
    attn_idx = [i for i, a in enumerate(attention_layers) if a]
    kept = set(attn_idx[:boundary_layers]) | set(attn_idx[len(attn_idx) - boundary_layers:] if boundary_layers else [])
    return [mode if (a and i not in kept) else NATIVE for i, a in enumerate(attention_layers)]


def effective_mode(table: list[str]) -> str:
    """The one non-native mode a table applies ("native" when none, "mixed" when several)."""
    quantized = {m for m in table if m != NATIVE}
    return quantized.pop() if len(quantized) == 1 else ("mixed" if quantized else NATIVE)
