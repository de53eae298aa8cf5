"""GGUF header reader: a file's metadata and tensor table, without touching tensor data.

The header is parsed here rather than with `gguf.GGUFReader`: the reader walks
every metadata array element through numpy memmap slicing, which takes ~13 s
for Gemma 3's 262k-token vocabulary on these machines.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata arrays longer than this stay unparsed (tokenizer vocabularies):
# only their length is needed here; the tokenizer converter reads them itself.
_LAZY_ARRAY_MIN = 1024
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


def open_mmap(path: Path) -> tuple[mmap.mmap, int]:
    """The file mapped copy-on-write, and its size; ModelLoadError when it cannot be read."""
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


def release(buf: mmap.mmap) -> None:
    """Close a file's mmap unless a tensor still views it (then the GC closes it)."""
    try:
        buf.close()
    except BufferError:
        pass


def parse_header(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    """The header of the GGUF file ``path`` mapped as ``buf`` (``size`` bytes)."""
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        cur = _Cursor(buf, size)
        cur.pos = 4
        version = _read_version(cur, path)
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        if n_tensors > size or n_kv > size:
            raise _Corrupt(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
        metadata = _read_metadata(cur, n_kv)
        infos = _read_tensor_table(cur, n_tensors)
        data_offset = _data_offset(cur, metadata)
    except _Corrupt as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header: {e}") from None
    tensors = _tensor_infos(path, infos, data_offset, size)
    return GGUFHeader(path, size, version, metadata, tensors, data_offset)


def _read_version(cur: _Cursor, path: Path) -> int:
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    return version


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.scalar("<I")
        metadata[key] = cur.value(vtype)
    return metadata


def _read_tensor_table(cur: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, torch-order shape, raw ggml type, offset from the data start) per tensor."""
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
    return infos


def _data_offset(cur: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"invalid general.alignment {alignment!r}")
    return -(-cur.pos // alignment) * alignment


def _tensor_infos(path: Path, infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int,
                  size: int) -> dict[str, TensorInfo]:
    """Checks every tensor's type, shape and extent against the file."""
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
    return tensors


_scope = threading.local()


@contextmanager
def one_parse_per_file():
    """Within it (one model load, on this thread), ``read_header`` and ``parse_header_once`` parse
    each file once: a load reads its file's header in several places (its kind, the fit check,
    the kernel summary, the load itself), 0.02-0.04 s each for Llama 3's 128k-token vocabulary
    and merges. Outside it every call parses the file again, so a file changed between two loads
    is read anew."""
    outer = getattr(_scope, "headers", None)
    if outer is None:
        _scope.headers = {}
    try:
        yield
    finally:
        if outer is None:
            _scope.headers = None


def parse_header_once(path: Path, parse) -> GGUFHeader:
    """``parse()`` (the header of ``path``), or the header already parsed within ``one_parse_per_file``."""
    headers = getattr(_scope, "headers", None)
    if headers is None:
        return parse()
    key = os.path.realpath(path)
    header = headers.get(key)
    if header is None:
        header = headers[key] = parse()
    return header


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF header (metadata + tensor table) without touching tensor data."""
    path = Path(path)

    def parse() -> GGUFHeader:
        buf, size = open_mmap(path)
        try:
            return parse_header(path, buf, size)
        finally:
            buf.close()

    return parse_header_once(path, parse)


def fingerprint(path: str | os.PathLike) -> str:
    """Cheap stable id of a GGUF file: its resolved path, size and mtime."""
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"gguf|{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
