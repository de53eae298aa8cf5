"""The ``gguf`` weight format: a GGUF's quantized blocks as the model's weights (models/weights.py
says what the format promises). ``GGUFPacked`` wraps ``turnkv.kernels.GGUFWeight`` parts; the GGUF
types the kernels run are ``turnkv.kernels.SUPPORTED``."""

from __future__ import annotations

import logging

import torch
from torch import nn

from .packed import PackedWeight

log = logging.getLogger("turnkv.weights")


class GGUFPacked(PackedWeight):
    """A weight held as the GGUF's quantized blocks (``turnkv.kernels.GGUFWeight``): one, or
    several concatenated along the output rows (a fused weight whose parts have different
    quantization types; each part runs its own kernel into its slice of the output).
    ``float_out``: the lm_head, whose logits are float32 whatever the compute dtype."""

    def __init__(self, parts: list, float_out: bool = False):
        super().__init__()
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("GGUFPacked needs parts with one common K")
        self.parts = list(parts)
        self.float_out = float_out
        self.out_features = sum(int(p.shape[0]) for p in self.parts)
        self.in_features = int(self.parts[0].shape[1])

    @property
    def qtypes(self) -> list[str]:
        return [getattr(p.qtype, "name", str(p.qtype)) for p in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def extra_repr(self) -> str:
        return f"{self.out_features}x{self.in_features}, {'+'.join(self.qtypes)}"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_out and x.dtype != torch.float32:
            x = x.float()
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if len(self.parts) == 1:
            out = self.parts[0].matmul(flat)
        else:
            out = torch.cat([p.matmul(flat) for p in self.parts], dim=-1)
        return out.view(*x.shape[:-1], self.out_features)

    ROW_CACHE_BYTES = 16 << 20   # dequantized embedding rows kept for decode steps (per table)
    ROW_CACHE_TOKENS = 8         # lookups of at most this many tokens go through them

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embedding rows, dequantized exactly. A decode step's few rows come from a small cache of
        rows already dequantized (the same values): a lookup's dozen small ops cost ~0.1 ms in a
        decode step, where the layers before it have evicted what they touch, about 3% of a
        one-sequence SmolLM2 step."""
        if len(self.parts) != 1:
            raise TypeError("a row lookup needs a single GGUF table")
        flat = tokens.reshape(-1)
        if flat.numel() > self.ROW_CACHE_TOKENS or flat.device.type != "cpu":
            return self.parts[0].lookup(flat, dtype).view(*tokens.shape, self.in_features)
        rows = self.__dict__.setdefault("_rows", {})
        ids = flat.tolist()
        have = {i: rows.get((i, dtype)) for i in dict.fromkeys(ids)}
        miss = [i for i, r in have.items() if r is None]
        if miss:
            cap = max(self.ROW_CACHE_TOKENS, self.ROW_CACHE_BYTES // (self.in_features * dtype.itemsize))
            if len(rows) + len(miss) > cap:
                rows.clear()
            for i, r in zip(miss, self.parts[0].lookup(torch.tensor(miss, dtype=torch.long), dtype)):
                have[i] = rows[i, dtype] = r
        # a fresh tensor: the families add into the embeddings in place
        return torch.stack([have[i] for i in ids]).view(*tokens.shape, self.in_features)



# --- the gguf format: build around placeholders, then wrap the GGUF blocks ----------------------

_COPY_OPS = {"to", "contiguous", "float", "bfloat16", "half", "detach", "clone", "requires_grad_"}
_CAT_OPS = {"cat", "concat", "concatenate"}


class _Untraceable(Exception):
    def __init__(self, names: list[str], why: str):
        super().__init__(f"{', '.join(names)}: {why}")
        self.names = names


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FusionTracer(torch.overrides.TorchFunctionMode):
    """Follows meta placeholders of quantized checkpoint tensors through a family's constructor.
    ``sources[storage key]`` is the ordered list of parts a meta tensor is made of: checkpoint
    names (quantized) or float tensors (a fused weight with a float-stored part). Only row
    concatenation (``torch.cat`` along dim 0) and dtype/contiguity copies are followed; any other
    op on a placeholder raises ``_Untraceable`` (the builder then dequantizes those tensors).
    ``nn.Parameter`` aliases its tensor's storage, so a parameter is found by its storage."""

    def __init__(self, placeholders: dict[str, torch.Tensor]):
        super().__init__()
        self.sources: dict[int, list] = {}
        self.alive: list[torch.Tensor] = []   # meta tensors kept alive: storage keys stay unique
        for name, t in placeholders.items():
            self._record(t, [name])

    def _record(self, t: torch.Tensor, parts: list) -> None:
        self.sources[_storage_key(t)] = parts
        self.alive.append(t)

    def parts_of(self, t: torch.Tensor) -> list | None:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        return self.sources.get(_storage_key(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tracked = [t for t in leaves if self.parts_of(t) is not None]
        if not tracked:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        names = [n for t in tracked for n in self.parts_of(t) if isinstance(n, str)]
        if name in _CAT_OPS:
            seq = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if any(not isinstance(t, torch.Tensor) or t.dim() != 2 for t in seq) or dim not in (0, -2):
                raise _Untraceable(names, f"{name} other than 2-D rows")
            parts = []
            for t in seq:
                own = self.parts_of(t)
                parts += own if own is not None else [t]
            dtype = seq[0].dtype
            for t in seq[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
            out = torch.empty(sum(t.shape[0] for t in seq), seq[0].shape[1], dtype=dtype, device="meta")
            self._record(out, parts)
            return out
        try:
            out = func(*args, **kwargs)
        except Exception as e:   # noqa: BLE001 - e.g. .to(device) of a meta tensor
            raise _Untraceable(names, f"{name} failed on a placeholder ({e})") from None
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return out           # metadata: .shape, .dtype, .dim() ...
        if name in _COPY_OPS and len(tracked) == 1 and len(outs) == 1 and outs[0].is_meta \
                and outs[0].shape == tracked[0].shape:
            if self.parts_of(outs[0]) is None:
                self._record(outs[0], self.parts_of(tracked[0]))
            return out
        raise _Untraceable(names, f"the family applies {name} to it")


def _build_with_placeholders(cls, config: dict, tensors: dict, quantized: dict, dtype: torch.dtype):
    """Build the family with meta placeholders for the quantized tensors. A tensor the family
    uses in a way that cannot stay quantized (anything but cat-rows / dtype copies) is dequantized
    and the build retried. Returns (model, tracer, names dequantized)."""
    floated: dict[str, torch.Tensor] = {}
    while True:
        keep = {n: q for n, q in quantized.items() if n not in floated}
        placeholders = {n: torch.empty(tuple(q.shape), dtype=torch.float32, device="meta") for n, q in keep.items()}
        tracer = _FusionTracer(placeholders)
        try:
            with tracer:
                model = cls.from_checkpoint(config, {**tensors, **floated, **placeholders}, dtype)
            return model, tracer, sorted(floated)
        except _Untraceable as e:
            new = [n for n in e.names if n not in floated]
            if not new:
                raise
            log.info("gguf weights: %s; dequantized", e)
            for n in new:
                floated[n] = quantized[n].dequantize()


def _materialize(parts: list, quantized: dict, dtype: torch.dtype) -> torch.Tensor:
    rows = [quantized[p].dequantize() if isinstance(p, str) else p.float() for p in parts]
    return (torch.cat(rows) if len(rows) > 1 else rows[0]).to(dtype).contiguous()


def _gguf_parts(names: list[str], quantized: dict) -> list:
    """The GGUFWeights of ``names`` concatenated (GGUFWeight.cat) where neighbours share a
    quantization type: one kernel per run of equal types."""
    from ..kernels import GGUFWeight

    runs: list[list] = []
    for n in names:
        q = quantized[n]
        if runs and runs[-1][0].qtype == q.qtype:
            runs[-1].append(q)
        else:
            runs.append([q])
    return [r[0] if len(r) == 1 else GGUFWeight.cat(r) for r in runs]


def load_gguf_model(cls, config: dict, tensors: dict, quantized: dict, dtype: torch.dtype):
    """The ``gguf`` format (module docstring): the family built around placeholders, each declared
    weight made of quantized parts becomes a ``GGUFPacked``; every other placeholder-built
    tensor is dequantized into the compute dtype. ``model.weight_notes`` lists what did not stay
    one GGUF matmul (also logged)."""
    model, tracer, floated = _build_with_placeholders(cls, config, tensors, quantized, dtype)
    roles = set(cls.packable_weights) | set(cls.head_weights) | set(cls.embedding_weights)
    notes: list[str] = [f"{n}: dequantized (used other than as a matmul weight)" for n in floated]
    done: dict[int, torch.Tensor | PackedWeight] = {}
    split: dict[str, int] = {}
    for mname, module in model.named_modules():
        for name in list(module._parameters) + list(module._buffers):
            t = module._parameters.get(name, module._buffers.get(name))
            parts = tracer.parts_of(t) if t is not None else None
            if parts is None:
                continue
            key = id(t)
            if key not in done:
                quant = all(isinstance(p, str) for p in parts)
                if name in roles and quant:
                    done[key] = GGUFPacked(_gguf_parts(parts, quantized))
                    qt = "+".join(done[key].qtypes)
                    if len(done[key].parts) > 1:
                        split[qt] = split.get(qt, 0) + 1
                else:
                    if name in roles:
                        notes.append(f"{mname}.{name}: float-stored and quantized parts mixed; native")
                    elif any(isinstance(p, str) for p in parts):
                        notes.append(f"{mname}.{name}: not a declared matmul weight; dequantized")
                    done[key] = _materialize(parts, quantized, t.dtype)
            value = done[key]
            is_param = name in module._parameters
            if is_param:
                del module._parameters[name]
            else:
                del module._buffers[name]
            if isinstance(value, PackedWeight):
                if name in cls.head_weights:
                    value.float_out = True
                setattr(module, name, value)
            elif is_param:
                setattr(module, name, nn.Parameter(value, requires_grad=False))
            else:
                module.register_buffer(name, value, persistent=False)
    # a tensor kept on an attribute but not registered (or anything missed) must not stay meta
    leftovers = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftovers:
        raise ValueError(f"gguf weights: could not place {', '.join(leftovers[:5])}")
    for qt, n in sorted(split.items()):
        notes.append(f"{n} fused weight(s) with parts {qt}: one GGUF kernel per part")
    if dtype == torch.float32:
        fused = model.enable_fused()
        if fused:
            notes.append(f"{fused} block(s) run as fused native calls (models/fused.py)")
    for note in notes:
        log.info("gguf weights: %s", note)
    model.weight_notes = notes
    return model

