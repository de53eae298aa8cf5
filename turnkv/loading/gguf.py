"""GGUF file -> (architecture, HF-style config dict, transformers-named tensors).

The values match what transformers holds after
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`: same names, same
dequantized numbers (bit for bit), the same reversal of llama.cpp's q/k
permutation and of its "+1" on Gemma norm weights.

The header is parsed here rather than with `gguf.GGUFReader`: the reader walks
every metadata array element through numpy memmap slicing, which takes ~13 s
for Gemma 3's 262k-token vocabulary on these machines. Quant constants and the
block dequantizers still come from the `gguf` package.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
import gguf.quants

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata arrays longer than this stay unparsed (tokenizer vocabularies):
# only their length is needed here; the tokenizer converter reads them itself.
_LAZY_ARRAY_MIN = 1024
_CHUNK_ELEMENTS = 1 << 22
_U64 = struct.Struct("<Q")

# GGUF metadata value types (gguf.GGUFValueType)
_T_STRING, _T_ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_TYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}


class _Corrupt(Exception):
    """Internal: the header is malformed; rephrased as ModelLoadError."""


@dataclass(frozen=True)
class GGUFArray:
    """A long metadata array left unparsed (e.g. tokenizer.ggml.tokens)."""

    item_type: int
    count: int
    offset: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first), as transformers sees it
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset of the data
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    file_size: int
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing the required key '{key}'")
        return default


class _Cursor:
    def __init__(self, buf: mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"header ends early (needs {n} bytes at offset {self.pos}, file is {self.size} bytes)")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"invalid UTF-8 string at offset {self.pos - n}") from None

    def skip_strings(self, count: int) -> None:
        # Hot loop (262k vocabulary entries): locals only, one bounds check at the end.
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except struct.error:
            raise _Corrupt(f"string array runs past the end of the file (offset {pos})") from None
        self.pos = pos
        self.need(0)

    def value(self, vtype: int) -> Any:
        if vtype == _T_STRING:
            return self.string()
        if vtype == _T_ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if count > self.size:
                raise _Corrupt(f"array length {count} exceeds the file size")
            start = self.pos
            if item_type in _NUMPY_TYPES:
                itemsize = np.dtype(_NUMPY_TYPES[item_type]).itemsize
                self.need(count * itemsize)
                if count >= _LAZY_ARRAY_MIN:
                    self.pos += count * itemsize
                    return GGUFArray(item_type, count, start)
                arr = np.frombuffer(self.buf, dtype=_NUMPY_TYPES[item_type], count=count, offset=start)
                self.pos += count * itemsize
                return [v.item() for v in arr]
            if item_type == _T_STRING:
                if count >= _LAZY_ARRAY_MIN:
                    self.skip_strings(count)
                    return GGUFArray(item_type, count, start)
                return [self.string() for _ in range(count)]
            if item_type == _T_ARRAY:
                return [self.value(_T_ARRAY) for _ in range(count)]
            raise _Corrupt(f"unknown array item type {item_type}")
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise _Corrupt(f"unknown metadata value type {vtype}")
        return self.scalar(fmt)


def _open_mmap(path: Path) -> tuple[mmap.mmap, int]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelLoadError(f"{path}: file is empty, not a GGUF model")
            # ACCESS_COPY gives writable (copy-on-write) buffers, so numpy and torch
            # can wrap them without read-only warnings; nothing is ever written.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), size
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise ModelLoadError(f"{path}: permission denied") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None


def _parse_header(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        cur = _Cursor(buf, size)
        cur.pos = 4
        version = cur.scalar("<I")
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
        if version not in _SUPPORTED_VERSIONS:
            raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        if n_tensors > size or n_kv > size:
            raise _Corrupt(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.scalar("<I")
            metadata[key] = cur.value(vtype)

        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            raw_type = cur.scalar("<I")
            rel = cur.scalar("<Q")
            infos.append((name, tuple(reversed(dims)), raw_type, rel))

        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"invalid general.alignment {alignment!r}")
        data_offset = -(-cur.pos // alignment) * alignment
    except _Corrupt as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header: {e}") from None

    tensors: dict[str, TensorInfo] = {}
    for name, shape, raw_type, rel in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor '{name}' has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise ModelLoadError(
                f"{path}: tensor '{name}' has shape {list(shape)} that does not fit {qtype.name} blocks of {block}"
            )
        n_elements = int(np.prod(shape, dtype=np.int64))
        nbytes = n_elements // block * type_size
        offset = data_offset + rel
        if offset + nbytes > size:
            raise ModelLoadError(
                f"{path}: file is truncated: tensor '{name}' needs bytes {offset}..{offset + nbytes} "
                f"but the file has only {size} bytes"
            )
        if name in tensors:
            raise ModelLoadError(f"{path}: corrupt GGUF: tensor '{name}' appears twice")
        tensors[name] = TensorInfo(name, shape, qtype, offset, nbytes)
    return GGUFHeader(path, size, version, metadata, tensors, data_offset)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF header (metadata + tensor table) without touching tensor data."""
    path = Path(path)
    buf, size = _open_mmap(path)
    try:
        return _parse_header(path, buf, size)
    finally:
        buf.close()


def fingerprint(path: str | os.PathLike) -> str:
    """Cheap stable id of a GGUF file: its resolved path, size and mtime."""
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"gguf|{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


# ---------------------------------------------------------------- dequantizing


def _q8_0_rows(raw: np.ndarray) -> torch.Tensor:
    # Same float32 arithmetic as gguf.quants.Q8_0 (f16 scale -> f32, times int8 -> f32),
    # in torch so it runs on all cores: the Gemma embedding is 167M values.
    rows = raw.shape[0]
    blocks = torch.from_numpy(raw).view(-1, 34)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (q * d).view(rows, -1)


def _dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """raw: uint8 [rows, row_bytes] -> float32 [rows, row_elements]."""
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16)).float()
    if qtype == GGMLQuantizationType.Q8_0:
        return _q8_0_rows(raw)
    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None or not hasattr(quant, "dequantize_blocks"):
        raise NotImplementedError(qtype.name)
    # Whole chunks at once through the package's block kernel (its dequantize()
    # loops over groups of 16 rows in Python); elementwise, so identical values.
    quant.init_grid()
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = quant.dequantize_blocks(raw.reshape(-1, type_size))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1))


def dequantize(buf: mmap.mmap, info: TensorInfo, dtype: torch.dtype, path: Path) -> torch.Tensor:
    """Dequantize one tensor into a fresh tensor of `dtype`, a row chunk at a time."""
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    row_elems = info.shape[-1]
    n_rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    row_bytes = row_elems // block * type_size
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(n_rows, row_bytes)
    out = torch.empty((n_rows, row_elems), dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // row_elems)
    try:
        for start in range(0, n_rows, step):
            out[start : start + step] = _dequantize_rows(raw[start : start + step], info.qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor '{info.name}' uses quantization {info.qtype.name}, which cannot be dequantized"
        ) from None
    return out.view(info.shape)


# Types held as float (never kept quantized): the matmul of a float tensor is the native one.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                         GGMLQuantizationType.F64})


def raw_rows(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """A 2-D tensor's stored bytes as a fresh uint8 tensor [rows, row_bytes] (a copy: the file's
    mmap is closed after the load)."""
    rows = info.shape[0]
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1)
    out = torch.empty(raw.shape, dtype=torch.uint8)
    out.numpy()[...] = raw
    return out


# ------------------------------------------------------------- architectures


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF `general.architecture` maps onto a transformers model type."""

    model_type: str
    build_config: Callable[[GGUFHeader], dict]
    # blk.{i}.<gguf name> -> model.layers.{i}.<transformers name> (".weight" required, ".bias" optional)
    layer_tensors: dict[str, str]
    # (transformers name, float32 tensor, config) -> tensor; None when nothing to undo
    transform: Callable[[str, torch.Tensor, dict], torch.Tensor] | None = None
    needs_transform: Callable[[str], bool] = field(default=lambda name: False)
    # True when ``transform`` only reorders whole rows of a 2-D tensor (llama's q/k un-permute):
    # it may then run on a quantized tensor's raw block rows (blocks run along a row), which
    # keeps the tensor quantized. Otherwise a transformed tensor is always dequantized.
    transform_permutes_rows: bool = False
    # Families whose layers differ (hybrids, MoE, shared-KV layers) name their tensors themselves:
    # (header, config) -> {gguf name: transformers name} for every tensor they need (missing ones
    # are reported by ``tensor_name_map``), replacing the layer_tensors / global-tensor walk.
    tensor_names: Callable[[GGUFHeader, dict], dict[str, str]] | None = None
    # After every tensor is read and transformed: (transformers-named tensors, config) -> the
    # tensors the family's from_checkpoint takes (split stacked experts, fuse, reshape, drop).
    # Tensors kept quantized (the ``gguf`` weight format) are not in this dict. It may also set
    # config keys that say how the tensors it leaves are laid out (Qwen 3.5's
    # ``linear_value_heads_tiled`` when quantized delta-net projections keep the file's head order).
    finish: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]] | None = None


def _token_ids(h: GGUFHeader) -> dict:
    out = {}
    for gguf_key, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
        ("unknown_token_id", "unk_token_id"),
    ):
        value = h.metadata.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            out[key] = value
    return out


def _vocab_size(h: GGUFHeader, arch: str) -> int:
    size = h.metadata.get(f"{arch}.vocab_size")
    if size is None:
        tokens = h.metadata.get("tokenizer.ggml.tokens")
        size = len(tokens) if tokens is not None else h.tensors["token_embd.weight"].shape[0]
    return int(size)


def _scalar(h: GGUFHeader, key: str, default: Any = ...) -> Any:
    value = h.get(key, default)
    if isinstance(value, (list, GGUFArray)):
        raise ModelLoadError(f"{h.path}: per-layer values for '{key}' are not supported")
    return value


def _rope_scaling(h: GGUFHeader, arch: str) -> dict | None:
    kind = h.metadata.get(f"{arch}.rope.scaling.type")
    factor = h.metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"{h.path}: rope scaling type '{kind}' is not supported")


def _default_rope(h: GGUFHeader, arch: str, rope_theta: float, **extra: Any) -> dict:
    """rope_parameters: default RoPE at ``rope_theta`` (with ``extra``, e.g. a partial rotary
    factor), updated by the file's linear scaling if it has one."""
    rope = {"rope_type": "default", "rope_theta": rope_theta, **extra}
    if scaling := _rope_scaling(h, arch):
        rope.update(scaling)
    return rope


def _llama_style_config(h: GGUFHeader, arch: str, *, model_type: str, architecture: str, layers: int, hidden: int,
                        heads: int, head_dim: int, context: int, eps: float) -> dict:
    """The leading entries of a plain pre-norm SwiGLU decoder's config (llama and the families
    written with its key set): the caller appends its rope, window and token entries."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": _vocab_size(h, arch),
        "hidden_size": hidden,
        "intermediate_size": _scalar(h, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(h, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _scalar(h, f"{arch}.attention.layer_norm_rms_epsilon", eps),
    }


def _llama_config(h: GGUFHeader) -> dict:
    from .gguf_archs.rope_freqs import freq_factors, llama3_rope

    a = "llama"
    hidden = _scalar(h, f"{a}.embedding_length")
    heads = _scalar(h, f"{a}.attention.head_count")
    head_dim = _scalar(h, f"{a}.rope.dimension_count", hidden // heads)
    rope_theta = float(_scalar(h, f"{a}.rope.freq_base", 10000.0))
    rope = _default_rope(h, a, rope_theta)
    # Llama 3.1+ / 3.2: the converter writes rope_type llama3 as per-dimension divisors
    if (factors := freq_factors(h, head_dim)) is not None:
        rope = {"rope_theta": rope_theta, **llama3_rope(factors, head_dim, rope_theta)}
    return {
        **_llama_style_config(
            h, a, model_type="llama", architecture="LlamaForCausalLM", layers=_scalar(h, f"{a}.block_count"),
            hidden=hidden, heads=heads, head_dim=head_dim,
            context=_scalar(h, f"{a}.context_length", 2048), eps=1e-6),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **_token_ids(h),
    }


def _reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # Undo convert_hf_to_gguf.py's LlamaModel.permute (rotary halves interleaved per head).
    # A permutation of whole rows: it applies as well to raw quantized rows (uint8 [N, row_bytes]).
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _llama_transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return _reverse_permute(w, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return _reverse_permute(w, config["num_key_value_heads"])
    return w


GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0


def _gemma3_config(h: GGUFHeader) -> dict:
    a = "gemma3"
    layers = _scalar(h, f"{a}.block_count")
    head_dim = _scalar(h, f"{a}.attention.key_length", 256)
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    rope_theta = float(_scalar(h, f"{a}.rope.freq_base", 1_000_000.0))
    full_rope = _default_rope(h, a, rope_theta)  # Gemma 3 scales the global layers' rope only
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": _vocab_size(h, a),
        "hidden_size": _scalar(h, f"{a}.embedding_length"),
        "intermediate_size": _scalar(h, f"{a}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": _scalar(h, f"{a}.attention.head_count"),
        "num_key_value_heads": _scalar(h, f"{a}.attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": _scalar(h, f"{a}.context_length", 131072),
        "rms_norm_eps": _scalar(h, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_ROPE_LOCAL_BASE_FREQ},
            "full_attention": full_rope,
        },
        "attention_bias": False,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": _scalar(h, f"{a}.attention.sliding_window", 4096),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **_token_ids(h),
    }


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _gemma_transform(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    # llama.cpp stores Gemma's RMSNorm weights as (1 + w); transformers keeps w.
    return w - 1 if _is_norm(name) else w


# Per-layer tensor names llama.cpp's converters share across families (blk.{i}.<gguf> ->
# model.layers.{i}.<transformers>), for building each family's layer table.
ATTN_PROJ_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GATED_MLP_TENSORS = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    **ATTN_PROJ_TENSORS,
    "ffn_norm": "post_attention_layernorm",
    **GATED_MLP_TENSORS,
}

_GEMMA3_LAYER = {
    "attn_norm": "input_layernorm",
    **ATTN_PROJ_TENSORS,
    **QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **GATED_MLP_TENSORS,
}

# GGUF general.architecture -> how to load it. llama and gemma3 are here; the other families
# register theirs from turnkv/loading/gguf_archs/ (``register``).
SUPPORTED_GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(
        model_type="llama",
        build_config=_llama_config,
        layer_tensors=_LLAMA_LAYER,
        transform=_llama_transform,
        needs_transform=lambda name: ".self_attn.q_proj." in name or ".self_attn.k_proj." in name,
        transform_permutes_rows=True,
    ),
    "gemma3": GGUFArchitecture(
        model_type="gemma3_text",
        build_config=_gemma3_config,
        layer_tensors=_GEMMA3_LAYER,
        transform=_gemma_transform,
        needs_transform=_is_norm,
    ),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def register(name: str, arch: GGUFArchitecture) -> None:
    """Make GGUF files whose ``general.architecture`` is ``name`` loadable."""
    SUPPORTED_GGUF_ARCHITECTURES[name] = arch


def tensor_name_map(h: GGUFHeader, arch: GGUFArchitecture, config: dict) -> dict[str, str]:
    """GGUF tensor name -> transformers name, for every tensor the model needs."""
    if arch.tensor_names is not None:
        names = arch.tensor_names(h, config)
        for g, t in names.items():
            if g not in h.tensors:
                raise ModelLoadError(f"{h.path}: missing tensor '{g}' (transformers name '{t}')")
        return names
    required: dict[str, str] = {}
    optional: dict[str, str] = {}
    for g, t in _GLOBAL_TENSORS.items():
        if g == "output" and config.get("tie_word_embeddings"):
            continue
        required[f"{g}.weight"] = f"{t}.weight"
    for i in range(config["num_hidden_layers"]):
        for g, t in arch.layer_tensors.items():
            required[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{t}.weight"
            optional[f"blk.{i}.{g}.bias"] = f"model.layers.{i}.{t}.bias"
    for g, t in required.items():
        if g not in h.tensors:
            raise ModelLoadError(f"{h.path}: missing tensor '{g}' (transformers name '{t}')")
    return required | {g: t for g, t in optional.items() if g in h.tensors}


def architecture_of(h: GGUFHeader) -> GGUFArchitecture:
    import_module(".gguf_archs", __package__)  # registers the other families

    arch = h.architecture
    spec = SUPPORTED_GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{h.path}: unsupported architecture '{arch}' in this GGUF file (supported: {supported})"
        )
    return spec


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True, desc: str | None = None,
    quantized: dict | None = None,
) -> tuple[GGUFHeader, str, dict, dict[str, torch.Tensor]]:
    """Read a GGUF file: (header, HF model_type, config dict, transformers-named tensors).

    ``quantized``: a dict to fill (``load_checkpoint(..., keep_quantized=True)``). Every 2-D tensor
    stored in a quantized type then goes there, under its transformers name, as a
    ``turnkv.kernels.GGUFWeight`` of its raw blocks (same row transforms: llama's q/k
    un-permute reorders the raw rows) and is left out of the returned float tensors: no float
    copy of it is ever made. Float-stored tensors (F32/F16/BF16), 1-D tensors, quantized types the
    kernels do not take and tensors whose transform is not a row permutation are dequantized as
    without it."""
    from tqdm.auto import tqdm

    path = Path(path)
    buf, size = _open_mmap(path)
    try:
        header = _parse_header(path, buf, size)
        arch = architecture_of(header)
        config = arch.build_config(header)
        names = tensor_name_map(header, arch, config)
        tensors: dict[str, torch.Tensor] = {}
        bar = tqdm(
            names.items(), desc=f"Loading {desc or path.name}", unit="tensor",
            file=sys.stderr, disable=not progress, leave=False,
        )
        for gguf_name, hf_name in bar:
            info = header.tensors[gguf_name]
            if quantized is not None and (q := _keep_quantized(buf, info, hf_name, arch, config)) is not None:
                quantized[hf_name] = q
                continue
            if arch.transform is not None and arch.needs_transform(hf_name):
                w = dequantize(buf, info, torch.float32, path)
                w = arch.transform(hf_name, w, config).to(dtype)
            else:
                w = dequantize(buf, info, dtype, path)
            tensors[hf_name] = w
        bar.close()
        if arch.finish is not None:
            tensors = arch.finish(tensors, config)
    finally:
        try:
            buf.close()
        except BufferError:  # a view is still referenced somewhere; the GC closes it
            pass
    return header, arch.model_type, config, tensors


def _keep_quantized(buf: mmap.mmap, info: TensorInfo, hf_name: str, arch: GGUFArchitecture, config: dict):
    """The tensor as a GGUFWeight of its raw blocks, or None when it stays a float tensor."""
    if len(info.shape) != 2 or info.qtype in FLOAT_TYPES:
        return None
    transform = arch.transform is not None and arch.needs_transform(hf_name)
    if transform and not arch.transform_permutes_rows:
        return None
    from ..kernels import GGUFWeight

    if not gguf_kernel_supports(info.qtype):
        return None
    raw = raw_rows(buf, info)
    if transform:
        raw = arch.transform(hf_name, raw, config)
    return GGUFWeight.from_raw(raw, info.qtype, tuple(info.shape))


def gguf_kernel_supports(qtype: GGMLQuantizationType) -> bool:
    """Whether turnkv.kernels.GGUFWeight runs this quantization type."""
    from .. import kernels

    return qtype in kernels.SUPPORTED
