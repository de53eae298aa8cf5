"""A vision folder's image processor settings, read from every layout transformers writes and
reads, with its precedence (docs/images.md):

- ``processor_config.json``'s ``"image_processor"`` (what ``processor.save_pretrained`` writes in
  transformers 5), else ``preprocessor_config.json`` (older saves and the image processor's own
  ``save_pretrained``): transformers' ``ImageProcessingMixin.get_image_processor_dict`` order;
- the processor's own fields (``image_seq_len``, ``image_seq_length``, ...): the other top-level
  keys of ``processor_config.json``.

A family honours a setting or refuses the folder with a ModelLoadError naming it: a setting that
turnkv cannot honour would otherwise be a silent default whose prompts and replies differ from
transformers'. ``salt`` hashes the settings that shape the pixels into an image's identity
(images.content_digest), so two settings never share an encoder cache or prompt cache entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..loading.errors import ModelLoadError

PROCESSOR_FILE, IMAGE_PROCESSOR_FILE = "processor_config.json", "preprocessor_config.json"
# keys of processor_config.json that are sub-processors or bookkeeping, not the processor's fields
_NOT_FIELDS = {"image_processor", "video_processor", "feature_extractor", "tokenizer", "audio_tokenizer",
               "chat_template", "processor_class", "auto_map"}


@dataclass(frozen=True)
class VisionSettings:
    image: dict = field(default_factory=dict)        # the image processor's settings ({} = none saved)
    processor: dict = field(default_factory=dict)    # the processor's own fields
    source: str = ""                                 # the file the image settings came from

    def refuse(self, family: str, key: str, value, why: str) -> ModelLoadError:
        where = f" ({self.source})" if self.source else ""
        return ModelLoadError(f"{family}: the image processor setting {key}={value!r}{where} is not supported: "
                              f"{why}")


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return raw


def read_settings(folder) -> VisionSettings:
    """The folder's settings in transformers' precedence; empty when the folder has none. Settings
    already read (a vision projector GGUF's, loading/gguf/mmproj/) are returned as they are."""
    if isinstance(folder, VisionSettings):
        return folder
    if folder is None or not Path(folder).is_dir():
        return VisionSettings()
    folder = Path(folder)
    proc = _read_json(folder / PROCESSOR_FILE) if (folder / PROCESSOR_FILE).is_file() else {}
    fields = {k: v for k, v in proc.items() if k not in _NOT_FIELDS}
    nested = proc.get("image_processor")
    if isinstance(nested, dict):
        return VisionSettings(dict(nested), fields, f"{PROCESSOR_FILE} image_processor")
    if (folder / IMAGE_PROCESSOR_FILE).is_file():
        return VisionSettings(_read_json(folder / IMAGE_PROCESSOR_FILE), fields, IMAGE_PROCESSOR_FILE)
    return VisionSettings({}, fields, PROCESSOR_FILE if proc else "")


def transformers_processor(cls, settings: VisionSettings, defaults: dict):
    """``cls`` (a transformers Pillow image processor) built from the saved settings as
    transformers' ``from_dict`` builds it, or from ``defaults`` when the folder saved none."""
    if not settings.image:
        return cls(**defaults)
    try:
        return cls.from_dict(settings.image)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{cls.__name__}: the saved settings ({settings.source}) do not load: {err}") from None


def expect(settings: VisionSettings, family: str, key: str, actual, want, why: str) -> None:
    """Refuse the folder when a setting's value ``actual`` is not ``want`` (what turnkv computes)."""
    if actual is not None and actual != want:
        raise settings.refuse(family, key, actual, f"{why} (this model needs {want!r})")


def salt(family: str, resolved: dict) -> bytes:
    """An identity for the settings that shape an image's pixels and rows."""
    text = json.dumps(resolved, sort_keys=True, default=repr)
    return hashlib.blake2b(f"{family}|{text}".encode(), digest_size=16).digest()
