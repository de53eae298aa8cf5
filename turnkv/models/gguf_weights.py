"""The ``gguf`` weight format: a GGUF's quantized blocks as the model's weights (models/weights.py
says what the format promises). ``GGUFPacked`` wraps ``turnkv.kernels.GGUFWeight`` parts; the GGUF
types the kernels run are ``turnkv.kernels.SUPPORTED``."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import tile_pending
from .packed import PackedWeight

log = logging.getLogger("turnkv.weights")


class GGUFPacked(PackedWeight):
    """A weight held as the GGUF's quantized blocks (``turnkv.kernels.GGUFWeight``): one, or
    several concatenated along the output rows (a fused weight whose parts have different
    quantization types; each part runs its own kernel into its slice of the output).
    ``float_out``: the lm_head, whose logits are float32 whatever the compute dtype."""

    def __init__(self, parts: list, float_out: bool = False):
        super().__init__()
        self.source_ids = {id(p) for p in parts}    # of the checkpoint's GGUFWeights it was made of (notes)
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


# --- the gguf format: the family built on the GGUF's blocks -----------------------------------------

def load_gguf_model(cls, config: dict, tensors: dict, quantized: dict, dtype: torch.dtype):
    """The ``gguf`` format (models/weights.py): the family built with the quantized tensors as
    ``GGUFWeight``s; its ``fused_weight`` calls keep them as ``GGUFPacked``, any other use
    dequantizes them. ``model.weight_notes`` lists what did not stay one GGUF matmul (also
    logged)."""
    model = cls.from_checkpoint(config, {**tensors, **quantized}, dtype)
    packed = _check_packed(model, cls)
    # every weight the model keeps tiled at once (one parallel region for the load's repack),
    # before the fused calls below take their tiles one weight at a time
    tile_pending([p for m in packed for p in m.parts])
    kept = set().union(*(m.source_ids for m in packed))
    notes = [f"{n}: dequantized (not a declared matmul weight)" for n, q in quantized.items() if not _kept(q, kept)]
    split: dict[str, int] = {}
    for m in packed:
        if len(m.parts) > 1:
            qt = "+".join(m.qtypes)
            split[qt] = split.get(qt, 0) + 1
    notes += [f"{n} fused weight(s) with parts {qt}: one GGUF kernel per part" for qt, n in sorted(split.items())]
    if dtype == torch.float32:
        fused = model.enable_fused()
        if fused:
            notes.append(f"{fused} block(s) run as fused native calls (models/fused.py)")
    for note in notes:
        log.info("gguf weights: %s", note)
    model.weight_notes = notes
    return model


def _kept(q, kept: set[int]) -> bool:
    """Whether ``q`` (a GGUFWeight, or a GGUFStack: through its experts' views) is in a GGUFPacked."""
    views = q.views() if hasattr(q, "views") else [q]
    return bool(views) and all(id(v) in kept for v in views)


def _check_packed(model: nn.Module, cls) -> list[GGUFPacked]:
    """Every GGUFPacked of ``model`` (once each), after checking that each sits under a name the
    family declares; the lm_head's logits are float32 whatever the compute dtype."""
    roles = set(cls.packable_weights) | set(cls.gguf_only_weights) | set(cls.head_weights) | set(cls.embedding_weights)
    found: dict[int, GGUFPacked] = {}
    for mname, module in model.named_modules():
        for name, child in module._modules.items():     # a tied head: both names (named_children skips one)
            if not isinstance(child, GGUFPacked):
                continue
            if name not in roles:
                raise ValueError(f"gguf weights: {mname}.{name} holds GGUF blocks but {cls.__name__} "
                                 f"does not declare {name!r} a matmul weight")
            if name in cls.head_weights:
                child.float_out = True
            found[id(child)] = child
    return list(found.values())
