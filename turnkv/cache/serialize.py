"""A ModelSnapshot as bytes: one manifest, one payload of the entry's own tensors, and shared KV blocks.

* The **manifest** (JSON) says what the entry is: format version, model fingerprint, family, KV-mode
  table, slack, dtype, the namespace, the token ids, and per layer its kind, mode, signature,
  length, start and block count; whether logits are stored; the payload's checksum.
* The **payload** (safetensors) holds what belongs to this entry alone: the partial tail block of
  every attention layer, every recurrent state, the logits.
* Every full 64-token **KV block** of every attention layer is its own safetensors object, named by
  a chained hash of (namespace, every token up to the block's end) and the layer index. The K/V of
  a position depends only on the tokens up to it, so two snapshots that share a prefix name the
  same blocks, and a tier stores each block once.

Each object is ``MAGIC | version (u16) | sha256(body) | body``: a truncated, corrupt or
foreign-version object is refused with a named reason before anything is parsed or restored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from array import array
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import LayerSnapshot, StoredPart
from .kv import ChunkedSnapshot, KVSnapshot, SlidingSnapshot
from .recurrent import StateSnapshot
from .snapshot import ModelSnapshot

FORMAT_VERSION = 1
MANIFEST_MAGIC, PAYLOAD_MAGIC, BLOCK_MAGIC = b"TKVM", b"TKVP", b"TKVB"
_HEAD = struct.Struct("<4sH32s")      # magic, version, sha256 of the body

# named refusal reasons (counted per tier in the stats)
CORRUPT = "corrupt"                   # bad magic, checksum, JSON or tensors; truncated
VERSION_MISMATCH = "version_mismatch"
MODEL_MISMATCH = "model_mismatch"     # another fingerprint / family than the live model
NAMESPACE_MISMATCH = "namespace_mismatch"
MISSING_BLOCK = "missing_block"       # a block the manifest needs is not in the tier
PAYLOAD_MISMATCH = "payload_mismatch"  # the payload is not the one the manifest was written with


class Refused(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- envelopes ---------------------------------------------------------------------------------

def seal(magic: bytes, body: bytes) -> bytes:
    return _HEAD.pack(magic, FORMAT_VERSION, hashlib.sha256(body).digest()) + body


def unseal(magic: bytes, data: bytes | None) -> bytes:
    if data is None:
        raise Refused(MISSING_BLOCK if magic == BLOCK_MAGIC else CORRUPT, "object missing")
    if len(data) < _HEAD.size:
        raise Refused(CORRUPT, f"truncated header ({len(data)} bytes)")
    got_magic, version, digest = _HEAD.unpack_from(data)
    if got_magic != magic:
        raise Refused(CORRUPT, f"bad magic {got_magic!r}")
    if version != FORMAT_VERSION:
        raise Refused(VERSION_MISMATCH, f"format {version}, this build reads {FORMAT_VERSION}")
    body = memoryview(data)[_HEAD.size:]
    if hashlib.sha256(body).digest() != digest:
        raise Refused(CORRUPT, "checksum mismatch (truncated or altered)")
    return bytes(body)


def _tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()})


def _load_tensors(body: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(body)
    except Exception as err:       # safetensors raises its own error types on a bad header
        raise Refused(CORRUPT, f"unreadable tensors: {err}") from None


# --- names -------------------------------------------------------------------------------------

def namespace_fields(ns) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(ns, f.name), tuple) else v) for f in dataclasses.fields(ns)}


def namespace_key(ns) -> str:
    """A stable name of a namespace (every field: fingerprint, dtype, modes, slack, tenant, ...)."""
    text = json.dumps(namespace_fields(ns), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def chain(ns_key: str, tokens, block_size: int, levels: int) -> list[str]:
    """``levels`` chained hashes: entry ``k`` names (namespace, tokens[:k * block_size])."""
    h = hashlib.blake2b(b"turnkv-chain" + ns_key.encode() + struct.pack("<I", block_size), digest_size=16)
    out = [h.hexdigest()]
    for k in range(1, levels):
        h = hashlib.blake2b(h.digest() + array("q", tokens[(k - 1) * block_size:k * block_size]).tobytes(),
                            digest_size=16)
        out.append(h.hexdigest())
    return out


def entry_id(ns_key: str, tokens, has_logits: bool, min_restore: int) -> str:
    h = hashlib.blake2b(ns_key.encode() + array("q", tokens).tobytes()
                        + struct.pack("<?q", has_logits, min_restore), digest_size=16)
    return h.hexdigest()


def block_key(level_hash: str, layer: int) -> str:
    return f"{level_hash}-{layer}"


# --- the manifest --------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    return x


def _tupled(x):
    if isinstance(x, list):
        return tuple(_tupled(v) for v in x)
    return x


@dataclass
class Manifest:
    data: dict

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.data["tokens"])

    @property
    def ns_key(self) -> str:
        return self.data["ns_key"]

    @property
    def min_restore(self) -> int:
        return int(self.data["min_restore"])

    @property
    def has_logits(self) -> bool:
        return bool(self.data["logits"])

    @property
    def origin(self) -> str:
        return self.data["origin"]

    @property
    def block_size(self) -> int:
        return int(self.data["block_size"])

    def levels(self) -> list[str]:
        """Index keys: the chained hash at every block boundary up to the entry's length."""
        return chain(self.ns_key, self.tokens, self.block_size, len(self.tokens) // self.block_size + 1)

    def block_keys(self) -> list[str]:
        hashes = chain(self.ns_key, self.tokens, self.block_size, len(self.tokens) // self.block_size + 1)
        keys = []
        for i, layer in enumerate(self.data["layers"]):
            first = layer.get("start", 0) // self.block_size
            keys.extend(block_key(hashes[first + j + 1], i) for j in range(layer.get("blocks", 0)))
        return keys

    def to_bytes(self) -> bytes:
        return seal(MANIFEST_MAGIC, json.dumps(self.data, separators=(",", ":")).encode())

    @classmethod
    def from_bytes(cls, data: bytes | None) -> "Manifest":
        body = unseal(MANIFEST_MAGIC, data)
        try:
            m = json.loads(body)
            if m.get("format") != FORMAT_VERSION:
                raise Refused(VERSION_MISMATCH, f"manifest format {m.get('format')}")
            for key in ("id", "tokens", "ns_key", "min_restore", "logits", "layers", "block_size", "fingerprint"):
                m[key]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise Refused(CORRUPT, f"bad manifest: {err}") from None
        return cls(m)


# --- encode ------------------------------------------------------------------------------------

@dataclass
class Encoded:
    """A snapshot ready for a tier: manifest and payload bytes, and its blocks (serialized on demand,
    so a tier that already holds a block never pays for its bytes)."""

    manifest: Manifest
    manifest_bytes: bytes
    payload: bytes
    blocks: dict[str, StoredPart]       # block key -> part

    def block_bytes(self, key: str) -> bytes:
        return seal(BLOCK_MAGIC, _tensors_bytes(self.blocks[key].tensors))


def encode(ns, tokens, snap: ModelSnapshot, origin: str, slack: int) -> Encoded:
    tokens = [int(t) for t in tokens]
    if snap.length != len(tokens):
        raise ValueError(f"snapshot holds {snap.length} tokens, key has {len(tokens)}")
    ns_key = namespace_key(ns)
    sizes = {layer.block_size for layer in snap.layers if isinstance(layer, KVSnapshot)}
    if len(sizes) > 1:
        raise ValueError(f"layers use different KV block sizes {sorted(sizes)}")
    B = sizes.pop() if sizes else 64
    hashes = chain(ns_key, tokens, B, len(tokens) // B + 1)
    own: dict[str, torch.Tensor] = {}
    blocks: dict[str, StoredPart] = {}
    layers = []
    for i, layer in enumerate(snap.layers):
        d = {"kind": layer.kind, "mode": layer.mode, "signature": _jsonable(layer.signature), "length": layer.length}
        if isinstance(layer, KVSnapshot):
            d.update(start=layer.start, blocks=len(layer.blocks), tail=layer.tail is not None)
            if isinstance(layer, SlidingSnapshot):
                d["window"] = layer.window
            if isinstance(layer, ChunkedSnapshot):
                d["chunk"] = layer.chunk
            for j, part in enumerate(layer.blocks):
                blocks[block_key(hashes[layer.start // B + j + 1], i)] = part
            if layer.tail is not None:
                own.update({f"{i}.tail.{k}": t for k, t in layer.tail.tensors.items()})
        elif isinstance(layer, StateSnapshot):
            d["state"] = layer.state is not None
            if layer.state is not None:
                own.update({f"{i}.state.{k}": t for k, t in layer.state.tensors.items()})
        else:
            raise ValueError(f"cannot serialize a {type(layer).__name__}")
        layers.append(d)
    if snap.logits is not None:
        own["logits"] = snap.logits
    payload = seal(PAYLOAD_MAGIC, _tensors_bytes(own))
    lo = snap.min_restore()
    data = {
        "format": FORMAT_VERSION,
        "id": entry_id(ns_key, tokens, snap.logits is not None, lo),
        "fingerprint": snap.fingerprint, "family": snap.family, "modes": list(snap.modes),
        "slack": slack, "namespace": namespace_fields(ns), "ns_key": ns_key,
        "tokens": tokens, "origin": origin, "min_restore": lo, "logits": snap.logits is not None,
        "block_size": B, "layers": layers,
        "payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_bytes": len(payload),
    }
    m = Manifest(data)
    return Encoded(m, m.to_bytes(), payload, blocks)


# --- decode ------------------------------------------------------------------------------------

def check_identity(m: Manifest, ns, family: str | None = None) -> None:
    """Refuse a manifest written for another model or namespace than ``ns``."""
    if m.data["fingerprint"] != ns.fingerprint or (family is not None and m.data["family"] != family):
        raise Refused(MODEL_MISMATCH, f"entry of {m.data['family']}/{m.data['fingerprint']}")
    if m.ns_key != namespace_key(ns) or m.data["namespace"] != namespace_fields(ns):
        raise Refused(NAMESPACE_MISMATCH)


def decode(m: Manifest, payload: bytes | None, blocks: dict[str, bytes | None], device="cpu") -> ModelSnapshot:
    """Rebuild the snapshot; ``blocks`` maps every key of ``m.block_keys()`` to its stored bytes."""
    if payload is None:
        raise Refused(CORRUPT, "payload missing")
    if hashlib.sha256(payload).hexdigest() != m.data["payload_sha256"]:
        raise Refused(PAYLOAD_MISMATCH if len(payload) == m.data["payload_bytes"] else CORRUPT,
                      "payload does not match its manifest")
    own = _load_tensors(unseal(PAYLOAD_MAGIC, payload))
    dev = torch.device(device)
    B = m.block_size
    hashes = chain(m.ns_key, m.tokens, B, len(m.tokens) // B + 1)
    layers: list[LayerSnapshot] = []
    try:
        for i, d in enumerate(m.data["layers"]):
            common = dict(length=int(d["length"]), mode=d["mode"], signature=_tupled(d["signature"]))
            if d["kind"] in ("full", "sliding", "chunked"):
                parts = []
                for j in range(d["blocks"]):
                    key = block_key(hashes[d["start"] // B + j + 1], i)
                    tensors = _load_tensors(unseal(BLOCK_MAGIC, blocks.get(key)))
                    if not tensors or any(t.dim() < 2 or t.shape[1] != B for t in tensors.values()):
                        raise Refused(CORRUPT, f"block {key} does not hold {B} positions")
                    parts.append(StoredPart({k: t.to(dev) for k, t in tensors.items()}))
                tail = None
                if d["tail"]:
                    prefix = f"{i}.tail."
                    tail = StoredPart({k[len(prefix):]: t.to(dev) for k, t in own.items() if k.startswith(prefix)})
                    n = int(d["length"]) - int(d["start"]) - B * int(d["blocks"])
                    if not tail.tensors or any(t.dim() < 2 or t.shape[1] != n for t in tail.tensors.values()):
                        raise Refused(CORRUPT, f"layer {i} tail does not hold {n} positions")
                extra = {"window": d["window"]} if d["kind"] == "sliding" else (
                    {"chunk": d["chunk"]} if d["kind"] == "chunked" else {})
                cls = {"full": KVSnapshot, "sliding": SlidingSnapshot, "chunked": ChunkedSnapshot}[d["kind"]]
                layers.append(cls(**common, start=int(d["start"]), block_size=B, blocks=tuple(parts), tail=tail,
                                  **extra))
            elif d["kind"] == "recurrent":
                prefix = f"{i}.state."
                state = StoredPart({k[len(prefix):]: t.to(dev) for k, t in own.items() if k.startswith(prefix)}) \
                    if d["state"] else None
                want = {name: tuple(shape) for name, shape in common["signature"][1]}
                if state is not None and {k: tuple(t.shape) for k, t in state.tensors.items()} != want:
                    raise Refused(CORRUPT, f"layer {i} state does not match its signature")
                layers.append(StateSnapshot(**common, state=state))
            else:
                raise Refused(CORRUPT, f"unknown layer kind {d['kind']!r}")
    except (KeyError, TypeError, ValueError) as err:
        raise Refused(CORRUPT, f"bad layer record: {err}") from None
    logits = own.get("logits") if m.has_logits else None
    if m.has_logits and logits is None:
        raise Refused(CORRUPT, "logits missing")
    logits = None if logits is None else logits.to(dev)
    snap = ModelSnapshot(family=m.data["family"], fingerprint=m.data["fingerprint"], modes=tuple(m.data["modes"]),
                         length=len(m.tokens), layers=tuple(layers), logits=logits)
    if snap.min_restore() != m.min_restore or any(layer.length != snap.length for layer in layers):
        raise Refused(CORRUPT, "layers disagree with the manifest")
    return snap
