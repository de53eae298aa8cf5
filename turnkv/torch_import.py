"""``import torch`` without its Python meta kernels (``turnkv serve``'s start-up), and the real
module imported afterwards (``complete``), which leaves the process as a plain ``import torch``.

``torch/__init__.py`` ends with ``from torch import _meta_registrations``: Python shape functions
for the meta device, registered together with torch's decompositions and references
(``torch._decomp``, ``torch._refs``, ``torch._prims``), which tracing needs (FakeTensor,
``torch.compile``, ``torch.export``, meta tensors of ops without a C++ meta kernel). turnkv runs
none of it, and it is ~0.3 s of the ~1.2 s CPU of ``import torch`` on a 2-core Zen 2, all of it
holding the GIL on the start's critical path (docs/measurements/2026-12-07-s23-startup.md).

``import_lean`` puts an empty module in ``sys.modules["torch._meta_registrations"]`` for the
length of ``import torch`` only: torch's own import then finds it and skips the real one. It is
taken out (and off the ``torch`` module) as soon as ``import torch`` returns. ``complete``
imports the real module; ``serve`` calls it on a thread once the server answers (it then holds
the GIL for ~0.3 s beside the first requests, as the grammar warm-up does). Until then, a first
import of one of the modules a plain ``import torch`` imports only through it (``THROUGH_META``:
FakeTensor, ``torch.compile`` and ``torch.export``'s tracing import them) imports the real module
first (``_MetaFirst``): some of them import each other in a circle that only torch's own order,
the meta kernels first, resolves (``import torch._decomp`` first fails). What no import reaches is
a meta tensor of an op whose only meta kernel is a Python one: that needs ``complete``.

Not covered: a thread importing those modules while ``complete`` runs on another (the two would
wait on each other's module locks); ``serve``'s threads import none of them.

Only for a process that has not imported torch yet: otherwise ``import_lean`` does nothing."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

META = "torch._meta_registrations"
# what a plain ``import torch`` (2.13) imports only through META, as the roots of their packages
# (tests/test_torch_import.py compares a plain import's modules with a lean one's)
THROUGH_META = ("torch._decomp", "torch._refs", "torch._prims", "torch._prims_common.wrappers",
                "torch.utils._content_store", "torch.testing._internal.common_dtype")
_lean = False       # this process's torch was imported by ``import_lean``, without META


class _MetaFirst(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Installed by ``import_lean`` until META is in: an import of a module of ``THROUGH_META``
    gets a placeholder that imports META (which imports that module in torch's own order) and
    leaves the real module in its place in ``sys.modules``, which the import system returns."""

    def find_spec(self, name, path=None, target=None):
        if name in THROUGH_META and META not in sys.modules:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        name = module.__name__
        del sys.modules[name]        # the placeholder: META's own import of the name loads the module
        complete()
        importlib.import_module(name)


_meta_first = _MetaFirst()


def import_lean() -> bool:
    """``import torch`` with torch's Python meta kernels left out (see the module); True where
    this call imported torch that way, False where torch (or META) was imported already."""
    global _lean
    if "torch" in sys.modules or META in sys.modules:
        return False
    stub = types.ModuleType(META, "an empty stand-in while torch imports (turnkv/torch_import.py)")
    sys.modules[META] = stub
    try:
        import torch  # noqa: F401
    finally:
        if sys.modules.get(META) is stub:
            del sys.modules[META]
        torch_module = sys.modules.get("torch")
        if getattr(torch_module, "_meta_registrations", None) is stub:
            delattr(torch_module, "_meta_registrations")
    _lean = True
    sys.meta_path.insert(0, _meta_first)
    return True


def imported_lean() -> bool:
    """Whether this process's torch came in through ``import_lean``."""
    return _lean


def deferred() -> bool:
    """Whether this process's torch came in through ``import_lean`` and the real META has not
    been imported since."""
    return _lean and META not in sys.modules


def complete() -> None:
    """Import the real META (nothing where it is in already): the meta kernels, decompositions
    and references a plain ``import torch`` registers."""
    importlib.import_module(META)
    try:
        sys.meta_path.remove(_meta_first)
    except ValueError:
        pass        # not installed, or another thread's call took it out
