"""llama.cpp's vision files: an ``mmproj`` GGUF (``general.architecture`` clip, what
``convert_hf_to_gguf.py --mmproj`` writes) holds a vision tower and its projector (``v.blk.N.*``,
``mm.*``) and the image preprocessing (``clip.vision.*``), beside the text model's own GGUF.

``load_mmproj`` reads one against the text GGUF it pairs with and gives what joins them into the
vision family's checkpoint, as transformers names it for the folder the files were converted from:
the joined config, the vision tensors (the converter's changes undone), the text tensors' new
names and the image processor settings (``models/vision_settings.VisionSettings``). One module per
projector type (``clip.projector_type``); ``find_sibling`` is llama.cpp's discovery of an
``mmproj*.gguf`` next to the text file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ModelLoadError
from ..dequant import dequantize
from ..reader import GGUFHeader, fingerprint, open_mmap, parse_header, read_header, release
from . import gemma3, idefics3, lfm2, qwen3vl
from .layout import MmprojLayout

LAYOUTS: dict[str, MmprojLayout] = {**idefics3.LAYOUTS, **gemma3.LAYOUTS, **lfm2.LAYOUTS, **qwen3vl.LAYOUTS}


@dataclass
class Mmproj:
    path: Path
    layout: MmprojLayout
    config: dict                       # the joined checkpoint's config
    tensors: dict[str, torch.Tensor]   # the vision tower and projector, transformers names
    settings: object                   # models.vision_settings.VisionSettings
    fingerprint: str

    def join(self, text_tensors: dict) -> dict:
        """The text GGUF's tensors (or its kept quantized blocks) under the joined checkpoint's names."""
        return {self.layout.text_name(name): w for name, w in text_tensors.items()}


def find_sibling(text_path: Path) -> Path | None:
    """The ``mmproj*.gguf`` next to a text GGUF, as llama.cpp's tools find it; None when there is
    none. Several are ambiguous: the caller must name one."""
    found = sorted(p for p in Path(text_path).parent.glob("mmproj*.gguf") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{text_path}: several vision projectors lie beside it ({names}); "
                             f"choose one with --mmproj FILE (or --no-mmproj)")
    return found[0] if found else None


def _header(path: Path) -> GGUFHeader:
    h = read_header(path)
    if h.architecture != "clip" or not h.get("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{path}: not a vision projector (mmproj) GGUF: general.architecture is "
                             f"'{h.architecture}', and an mmproj file is 'clip' with a vision encoder")
    return h


def layout_of(path: str | Path, text_type: str | None = None) -> MmprojLayout:
    """The projector's layout, checked against the text GGUF's model type when given."""
    h = _header(Path(path))
    kind = h.get("clip.vision.projector_type", None) or h.get("clip.projector_type")
    layout = LAYOUTS.get(kind)
    if layout is None:
        raise ModelLoadError(f"{path}: unsupported vision projector type '{kind}' (supported: "
                             f"{', '.join(f'{k} ({v.family})' for k, v in sorted(LAYOUTS.items()))})")
    if text_type is not None and text_type not in layout.text_types:
        raise ModelLoadError(f"{path}: a {layout.family} projector ('{kind}') pairs with a text GGUF of "
                             f"{', '.join(layout.text_types)}, not '{text_type}'")
    return layout


def load_mmproj(path: str | Path, text: GGUFHeader, text_type: str, text_config: dict,
                dtype: torch.dtype = torch.float32, progress: bool = True) -> Mmproj:
    """Read ``path`` for the text GGUF ``text`` (its model type and config as loaded)."""
    from tqdm.auto import tqdm

    from ....models.vision_settings import VisionSettings

    path = Path(path)
    layout = layout_of(path, text_type)
    buf, size = open_mmap(path)
    try:
        h = parse_header(path, buf, size)
        config = layout.build_config(h, text, text_config)
        names = layout.tensor_names(h, config)
        missing = sorted(g for g in names if g not in h.tensors)
        unread = sorted(g for g in h.tensors if g not in names)
        if missing or unread:
            raise ModelLoadError(f"{path}: the {layout.family} projector layout does not match this file "
                                 f"(missing: {', '.join(missing) or '-'}; not read: {', '.join(unread) or '-'})")
        tensors = {}
        for g, t in tqdm(names.items(), desc=f"Loading {path.name}", unit="tensor", file=sys.stderr,
                         disable=not progress, leave=False):
            tensors[t] = layout.transform(t, dequantize(buf, h.tensors[g], torch.float32, path)).to(dtype)
        tensors = layout.finish(tensors)
        settings = VisionSettings(layout.image_settings(h, config), {}, f"{path.name} clip.vision.*")
    finally:
        release(buf)
    return Mmproj(path, layout, config, tensors, settings, fingerprint(path))
