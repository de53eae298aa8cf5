"""turnkv/page_arena.py: the tiles' pages faulted in ahead of the load (``serve``, beside
``import torch``) and moved into each weight's own mapping; what the load did not take goes back."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

import native
from turnkv import page_arena
from turnkv.kernels import GGUFWeight, native_available, weight_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_reserve_only_for_a_gguf_file_loaded_as_its_blocks(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    try:
        assert page_arena.reserve(str(tmp_path / "absent.gguf")) is None
        assert page_arena.reserve(str(model), "native") is None
        assert page_arena.reserve("smollm2-135m") is None           # a bundled name: no file to size it by
        assert page_arena._arena is None
    finally:
        page_arena.release()


def test_buffers_get_the_arenas_faulted_pages_and_the_rest_goes_back(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (6 << 20))
    page_arena.reserve(str(model)).join()
    arena = page_arena._arena
    try:
        if arena.filled != arena.end:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        start = arena.start
        t = weight_memory.buffer(1024, 4096)          # 4 MiB: the arena's first two huge pages' worth
        assert arena.taken == start + (4 << 20) and t.data_ptr() % weight_memory.HUGE == 0
        assert int(t.sum()) == 0
        torch.empty(1 << 20, dtype=torch.uint8).fill_(7)     # fill_'s own first-call faults, paid here
        before = _faults()
        t.fill_(7)                                    # its pages are there already: no fault each
        assert _faults() - before < 64 and int(t[1023].sum()) == 7 * 4096
        assert page_arena.held_bytes() == arena.end - arena.taken
        odd = weight_memory.buffer(3, 1 << 20)        # 3 MiB: the next 2 MiB-aligned start, 1 MiB given back
        assert arena.taken == start + (8 << 20) and not _mapped(start + (7 << 20))
        odd.fill_(1)
        assert int(odd.sum()) == 3 << 20
        end = arena.end
    finally:
        page_arena.release()
    assert page_arena._arena is None and not _mapped(end - 1) and page_arena.held_bytes() == 0
    assert int(t[5].sum()) == 7 * 4096       # the weights keep their pages
    assert weight_memory.buffer(2, 1 << 20).data_ptr() % weight_memory.HUGE == 0     # no arena: as before


@native.needs(native_available(), "the native kernels")
def test_a_load_with_the_arena_writes_the_same_tiles():
    from turnkv.engine.engine import Engine
    from turnkv.loading import gguf_path
    from turnkv.models.weights import GGUFPacked

    def tiles(engine) -> list[torch.Tensor]:
        return [p.raw for m in engine.model.modules() if isinstance(m, GGUFPacked) for p in m.parts
                if isinstance(p, GGUFWeight)]

    plain = tiles(Engine.load("smollm2-135m", weights="gguf", progress=False, max_context=256))
    page_arena.reserve(str(gguf_path("smollm2-135m"))).join()
    arena = page_arena._arena
    eng = Engine.load("smollm2-135m", weights="gguf", progress=False, max_context=256)
    assert page_arena._arena is None             # the load gave back what it did not take
    assert arena.taken > arena.start             # its weights took pages from it
    assert [torch.equal(a, b) for a, b in zip(tiles(eng), plain)] == [True] * len(plain)


def test_the_fit_check_counts_the_arenas_pages_as_the_loads_own(monkeypatch):
    """MemAvailable no longer counts the pages serve faulted in for the tiles; the fit check adds
    them back, so a model that fits is not refused for them."""
    from turnkv.loading import ModelLoadError, fit, gguf_path
    from turnkv.loading.gguf import read_header

    path = gguf_path("smollm2-135m")
    need = fit.resident_bytes(read_header(path), True, torch.float32)
    monkeypatch.setattr(fit, "available_bytes", lambda: need // 2)
    with pytest.raises(ModelLoadError, match="MemAvailable"):
        fit.check_fits(path, True, torch.float32)
    page_arena.reserve(str(path)).join()
    try:
        if page_arena.held_bytes() < need - need // 2:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        fit.check_fits(path, True, torch.float32)
    finally:
        page_arena.release()
