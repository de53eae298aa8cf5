"""A model ready to serve from a bundled name, a .gguf file or an HF folder: the checkpoint read
(loading/), the family built in the chosen weight format (models/), and the fingerprint that
names its prompt-cache entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gguf_path, gguf_runs_quantized, gguf_type_summary, load_checkpoint, source_kind
from .fit import check_fits


@dataclass
class LoadedModel:
    net: torch.nn.Module
    tokenizer: object
    fingerprint: str
    name: str
    weights: str          # the weight format (models/weights.py)
    max_context: int      # the checkpoint's max_position_embeddings (8192 when it names none)


def load_model(model: str, dtype: torch.dtype = torch.float32, weights: str | None = "native",
               progress: bool = True, mmproj=None) -> LoadedModel:
    """``weights``: a weight format of models/weights.py (packed formats quantize from the float32
    checkpoint tensors, whatever the compute dtype; ``gguf`` keeps the GGUF's own quantized
    blocks), or None for the default: ``gguf`` for a GGUF model (stored quantized) of a family with
    packable weights when the native kernels are built, else ``native``. ``mmproj``: the vision
    projector joined to a text GGUF (``load_checkpoint``: None finds a sibling, False none)."""
    from ..page_arena import release
    from .gguf.reader import one_parse_per_file

    try:
        with one_parse_per_file():      # its kind, the fit check and the load read one header
            return _load_model(model, dtype, weights, progress, mmproj)
    finally:
        release()       # what serve's page arena held beyond the weights' tiles goes back


def _load_model(model: str, dtype: torch.dtype, weights: str | None, progress: bool, mmproj) -> LoadedModel:
    from ..kernels import settle_deferred
    from ..kernels.attention import numerics_tag
    from ..libc import trim_heap
    from ..models import family_class
    from ..models.weights import GGUF_FORMAT, check_format, default_format
    from ..models.weights import load_model as build
    from ..page_arena import release as release_arena

    if weights is None:
        kind, arch = source_kind(model, mmproj)
        weights = "native"
        if kind == "gguf" and gguf_runs_quantized(model):     # a float-stored GGUF runs native
            weights = default_format(kind, family_class(arch))
    check_format(weights)    # before the load; the build checks the family can hold it
    if weights != GGUF_FORMAT:
        release_arena()      # no tile will take the pages serve faulted in: they go back first
    load_dtype = dtype if weights == "native" else torch.float32
    if source_kind(model, mmproj)[0] == "gguf":   # a model that cannot fit fails before the load
        check_fits(gguf_path(model), keep_quantized=weights == GGUF_FORMAT, dtype=load_dtype)
    ckpt = load_checkpoint(model, dtype=load_dtype, progress=progress,
                           keep_quantized=weights == GGUF_FORMAT, mmproj=mmproj)
    net = build(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, dtype, weights,
                progress=progress, quantized=ckpt.quantized)
    net.eval()
    if weights == GGUF_FORMAT:      # the banner's per-type kernel line (launch.py)
        net.gguf_types = gguf_type_summary(model, ckpt.quantized)
    if hasattr(net, "load_processor"):     # vision families: the folder's (or mmproj's) image preprocessing
        net.load_processor(ckpt.image_settings or ckpt.source)
    if ckpt.image_settings is not None:      # the banner names the vision projector GGUF
        net.image_source = ckpt.image_settings.source
    # packed weights compute different (close) logits: their snapshots are another namespace,
    # and another build's or CPU kind's kernels compute other bits: their tier entries are other names
    fingerprint = ckpt.fingerprint if weights == "native" else f"{ckpt.fingerprint}+w:{weights}"
    fingerprint = f"{fingerprint}+k:{numerics_tag()}"
    loaded = LoadedModel(net, ckpt.tokenizer, fingerprint, ckpt.name, weights,
                         int(ckpt.config.get("max_position_embeddings") or 8192))
    del ckpt           # with it the parts the fused weights were made from (their rows: file views)
    settle_deferred()  # the file's mapping closes once no weight views it
    trim_heap()        # the load's temporaries leave the resident set
    return loaded
