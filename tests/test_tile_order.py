"""The load's repack with a row order (llama's q/k un-permute moved by the gather itself): the
same tile bytes as permuting the rows first, which the rest of the suite checks against GGUF's own
rows and dequantization."""

from __future__ import annotations

import native
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from turnkv import kernels as tk
from turnkv.kernels import GGUFWeight, tiles

TYPES = [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.BF16]
needs_gather = native.needs(tk.native_available() and tiles.native_gather is not None, "the native tile gather")


def _rows(qtype, n: int = 67, blocks: int = 3, seed: int = 1) -> torch.Tensor:
    size = GGML_QUANT_SIZES[qtype][1]
    return torch.randint(0, 256, (n, blocks * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@needs_gather
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_ordered_tiles_equal_permuting_first(qtype, monkeypatch):
    rows = _rows(qtype)
    for order in (torch.randperm(67, generator=torch.Generator().manual_seed(2)),
                  torch.arange(64).reshape(8, 4, 2).transpose(1, 2).reshape(-1)):     # llama's q/k un-permute
        picked = rows.index_select(0, order)
        got = tiles.tile_rows(rows, qtype, order=order)
        assert torch.equal(got, tiles.tile_rows(picked, qtype))
        assert torch.equal(tiles.untile_rows(got, qtype, len(order)), picked)
        with monkeypatch.context() as m:      # numpy's gather (no build): permutes, then tiles
            m.setattr(tiles, "native_gather", None)
            assert torch.equal(tiles.tile_rows(rows, qtype, order=order), got)
    block = GGML_QUANT_SIZES[qtype][0]
    order = torch.randperm(67, generator=torch.Generator().manual_seed(3))
    eager = GGUFWeight.from_raw(rows.index_select(0, order), qtype, (67, 3 * block))
    lazy = GGUFWeight.from_raw(rows, qtype, (67, 3 * block), defer=True, order=order)
    other = GGUFWeight.from_raw(rows[:36], qtype, (36, 3 * block), defer=True, order=order[:36] % 36)
    fused = GGUFWeight.cat([other, lazy])      # 36 rows: not whole tiles, so cat joins their rows()
    assert torch.equal(fused.rows(), torch.cat([rows[:36].index_select(0, order[:36] % 36), eager.rows()]))
    assert torch.equal(lazy.raw, eager.raw) and torch.equal(lazy.rows(), eager.rows())
    with pytest.raises(ValueError):
        GGUFWeight.from_raw(rows, qtype, (67, 3 * block), order=order[:5])


@needs_gather
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_threads_share_many_tiles_as_one_thread_does(qtype):
    """The load's gather shares its tiles out over the threads (a handful of tiles, as above, runs
    on one): with two threads and 100 tiles (whole, or a padded last one; with and without a row
    order) every tile comes out as the one-thread gather writes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (8 * 100, 8 * 100 + 3):
            rows = _rows(qtype, n=n, blocks=2, seed=4)
            for order in (None, torch.randperm(n, generator=torch.Generator().manual_seed(5))):
                one = tiles.tile_rows(rows, qtype, order=order, parallel=False)
                assert torch.equal(tiles.tile_rows(rows, qtype, order=order), one)
    finally:
        torch.set_num_threads(threads)


@needs_gather
def test_settle_tiles_every_pending_weight_in_one_gather(monkeypatch):
    """The end of a load (``settle_deferred``) tiles every weight still pending, the fused weights
    ``cat`` made of pending parts included, in one call of the native gather: one parallel region
    over all their bytes (two threads here, ~5 MB cut into pieces of 256 KB that they take in
    turn), which writes every tile as the one-thread gather of each weight alone does."""
    tk.settle_deferred()                 # what other tests left pending
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        made, want = [], []
        for i, (qtype, n) in enumerate([(Q.Q4_K, 1000), (Q.Q6_K, 803), (Q.MXFP4, 517), (Q.Q8_0, 67)]):
            rows = _rows(qtype, n=n, blocks=8, seed=10 + i)
            k, cut = 8 * GGML_QUANT_SIZES[qtype][0], n // 16 * 8
            order = torch.randperm(n, generator=torch.Generator().manual_seed(i))
            parts = [GGUFWeight.from_raw(rows[:cut], qtype, (cut, k), defer=True),
                     GGUFWeight.from_raw(rows, qtype, (n, k), defer=True, order=order)]
            made += [GGUFWeight.cat(parts), GGUFWeight.from_raw(rows[cut:], qtype, (n - cut, k), defer=True)]
            want += [torch.cat([tiles.tile_rows(rows[:cut], qtype, parallel=False),
                                tiles.tile_rows(rows, qtype, order=order, parallel=False)]),
                     tiles.tile_rows(rows[cut:], qtype, parallel=False)]
        del parts                        # as a load drops the file's tensors: only cat read them
        assert all(w._pending is not None for w in made)
        calls, gather = [], tiles.native_gather
        monkeypatch.setattr(tiles, "native_gather", lambda *args: (calls.append(len(args[0])), gather(*args)))
        tk.settle_deferred()
        assert calls == [12]             # 4 x (a fused weight's 2 parts + a weight alone)
        assert all(w._pending is None for w in made)
        for w, t in zip(made, want):
            assert torch.equal(w.raw, t)
    finally:
        torch.set_num_threads(threads)
