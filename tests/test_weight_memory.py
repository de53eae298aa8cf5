"""GGUF weights' tiles in mappings of their own (kernels/weight_memory.py): 2 MiB aligned, written
on small pages at load, moved to transparent huge pages afterwards without changing a bit."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import native
from turnkv.kernels import GGUFWeight, native_available, weight_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_buffer_is_aligned_writable_and_unmapped_with_its_tensors():
    t = weight_memory.buffer(1024, 4096)
    start = t.data_ptr()
    assert t.shape == (1024, 4096) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % weight_memory.HUGE == 0
    t.fill_(3)
    assert int(t[1000].sum()) == 3 * 4096
    view = t[8:16]
    del t
    gc.collect()
    assert int(view.sum()) == 3 * 8 * 4096     # a view keeps the mapping
    del view
    gc.collect()
    assert start not in [r[0] for r in weight_memory._regions.values()]


@native.needs(native_available(), "the native kernels")
def test_a_loaded_model_runs_the_same_bits_after_its_weights_move_to_huge_pages():
    from turnkv.engine.engine import Engine
    from turnkv.models.weights import GGUFPacked

    eng = Engine.load("smollm2-135m", weights="gguf", progress=False, max_context=256)
    parts = [p for m in eng.model.modules() if isinstance(m, GGUFPacked) for p in m.parts]
    big = [p for p in parts if isinstance(p, GGUFWeight) and p.raw.numel() >= 2 * weight_memory.HUGE]
    assert big and all(p.raw.data_ptr() % weight_memory.HUGE == 0 for p in big)
    x = torch.randn(3, big[0].shape[1], generator=torch.Generator().manual_seed(0))
    before = [p.matmul(x) for p in big]
    huge_before = _anon_huge_kib()
    moved = weight_memory.collapse()
    assert [torch.equal(p.matmul(x), b) for p, b in zip(big, before)] == [True] * len(big)
    if moved == 0:
        pytest.skip("this kernel moves no pages (MADV_COLLAPSE needs Linux 6.1+ and THP not 'never')")
    assert _anon_huge_kib() >= huge_before + moved // 1024 // 2
