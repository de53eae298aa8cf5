"""An MLP's activation gives a row the same bits whatever rows share the call and however many
threads run it. ATen splits an elementwise call of more than 32768 values (GeLU: 16384) across
threads; where
a split falls inside a row, the values before it end in ATen's scalar tail, whose exp / tanh
differ from the vector ones in the last bit for a few percent of inputs. ``act_rows`` (Python)
and the native layers' ``act_rows`` (kernels/csrc/fused_layer.inc) call the activation on blocks
of whole rows of at most 16384 values instead."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import native
from test_gguf_experts import random_blocks
from turnkv import kernels
from turnkv.kernels import GGUFStack
from turnkv.models.decoder import act_rows, gelu_tanh_, silu_
from turnkv.models.experts import RoutedExperts

needs_native = native.needs(kernels.native_available(), "the native GGUF kernels")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def gate_up(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2 * cols, generator=g) * 3


@pytest.mark.parametrize("act", [silu_, gelu_tanh_], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("cols", [1376, 1000, 40000])
def test_a_row_in_a_chunk_is_the_row_alone(act, cols, threads):
    """Gate columns of a [47, 2 cols] gate|up (the strided view GatedMLP activates), at 2 and 3
    threads: every row equals that row activated alone; 40000 columns: pieces of one row."""
    for n in (2, 3):
        threads(n)
        gu = gate_up(47, cols, cols + n)
        chunk = gu.clone()
        act_rows(act, chunk[:, :cols])
        assert torch.equal(chunk[:, cols:], gu[:, cols:])      # the up half untouched
        for r in range(47):
            alone = gu[r:r + 1].clone()
            act_rows(act, alone[:, :cols])
            assert torch.equal(alone, chunk[r:r + 1]), (n, r)


def test_an_out_of_place_activation_is_written_back():
    gu = gate_up(47, 1376, 0)
    chunk = gu.clone()
    g = act_rows(torch.sigmoid, chunk[:, :1376])
    assert g.data_ptr() == chunk.data_ptr() and torch.equal(g, torch.cat([torch.sigmoid(r) for r in gu[:, :1376]]).view(47, -1))


@needs_native
def test_native_experts_row_in_a_chunk_is_the_row_alone(threads):
    """The native experts' call on 47 rows that all chose one expert of 1376 intermediate columns
    (65k gate values: the grouped path's activation past ATen's grain) gives every row the bits
    it gets alone, at 2 and 3 threads."""
    E, hidden, inter = 2, 256, 1376
    gu = GGUFStack.from_raw(random_blocks(Q.Q8_0, E * 2 * inter, hidden, 7), Q.Q8_0, (E, 2 * inter, hidden))
    down = GGUFStack.from_raw(random_blocks(Q.Q8_0, E * hidden, inter, 8), Q.Q8_0, (E, hidden, inter))
    experts = RoutedExperts.gated(gu, down, torch.float32)
    assert experts.fuse()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(47, hidden, generator=g) * 4
    chosen = torch.zeros(47, 1, dtype=torch.long)
    weights = torch.ones(47, 1)
    for n in (2, 3):
        threads(n)
        got = experts.forward(x, weights, chosen)
        for r in range(47):
            assert torch.equal(experts.forward(x[r:r + 1], weights[r:r + 1], chosen[r:r + 1])[0], got[r]), (n, r)
