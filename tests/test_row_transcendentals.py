"""An elementwise transcendental gives a row the bits it gets alone, whatever rows share the call
and however many threads run it (``models/base.py`` ``each_row``; the MLP's in-place twin is
tests/test_activation_rows.py).

ATen splits an elementwise call of more than 32768 values (GeLU: 16384) across threads wherever
the split falls, and runs the values short of a whole unrolled vector step one at a time (its
scalar tail). For sigmoid, silu, softplus and gelu the scalar formula rounds otherwise than the
vector one for a few percent of inputs, so a gate's bits depended on the rows beside it: at 3 or
5 threads once a call passes the grain (a batch of ~1100 rows on the tiny fixtures, a few rows on
a real model's widths), and at any thread count for a width that is not whole vector steps (a
gate of 4 heads a row). Before ``each_row``, the RWKV-7 fixture's batch of 1105 rows differed from
the same sequences alone in 14 rows at 3 and at 5 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import native
from test_gguf_families import FIXTURES, build
from tiny import prompt
from turnkv.cache.specs import make_caches
from turnkv.models import base
from turnkv.models.base import each_row, gelu_tanh
from turnkv.models.batch import Batch
from turnkv.models.weights import native_kernels_built

FNS = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "gelu_tanh": gelu_tanh}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def shapes(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Row layouts the families hand over: 1105 rows (past the grain for all but the narrow one)."""
    wide = torch.randn(1105, 384, generator=g) * 4
    return {"contiguous_200": wide[:, :200].contiguous(), "strided_200": wide[:, :200],
            "heads_4": wide[:, :4].contiguous(), "token_major_192": wide[:, :192].t().contiguous().t(),
            "three_d": wide[:, :320].contiguous().view(1105, 5, 64)}


def rows_differing(got: torch.Tensor, x: torch.Tensor, fn) -> int:
    flat, src = got.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])
    return sum(not torch.equal(flat[r], fn(src[r:r + 1].contiguous())[0]) for r in range(src.shape[0]))


@pytest.mark.parametrize("name", sorted(FNS))
def test_each_row_is_the_row_alone(name, threads):
    """Every row of every layout equals that row computed alone, at 3 and 5 threads; the plain
    call on the same tensors does not (the check can fail)."""
    fn, g = FNS[name], torch.Generator().manual_seed(0)
    plain = 0
    for n in (3, 5):
        threads(n)
        for layout, x in shapes(g).items():
            got = each_row(fn, x)
            assert got.shape == x.shape and torch.allclose(got, fn(x), atol=1e-6)
            assert rows_differing(got, x, fn) == 0, (n, layout)
            plain += rows_differing(fn(x), x, fn)
    assert plain > 0


def test_a_row_longer_than_the_grain_is_cut_the_same_alone(threads):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40000, generator=g) * 4
    for n in (3, 5):
        threads(n)
        for fn in FNS.values():
            got = each_row(fn, x)
            assert all(torch.equal(got[r], each_row(fn, x[r:r + 1])[0]) for r in range(3))


@native.needs(base._native_each_row is not None, "the native each_row op")
def test_the_native_blocks_are_the_python_blocks(threads, monkeypatch):
    """The native op runs each_row's blocks on the threads: the bits of the Python blocks, at 1,
    3 and 5 threads, every layout, a long row, every op it runs."""
    g = torch.Generator().manual_seed(4)
    cases = {**shapes(g), "long": torch.randn(3, 40000, generator=g) * 4}
    for n in (1, 3, 5):
        threads(n)
        for fn in base._ROW_OPS:
            native_bits = {k: each_row(fn, x) for k, x in cases.items()}
            with monkeypatch.context() as m:
                m.setattr(base, "_native_each_row", None)
                assert all(torch.equal(each_row(fn, x), native_bits[k]) for k, x in cases.items()), (n, fn)


def test_exp_tanh_log_round_the_same_in_the_scalar_tail():
    """exp, tanh and log stay one ATen call where the tensor is large (attention scores, logit
    softcaps, the delta-nets' decays): their scalar tail gives the vector loop's bits, so no split
    changes a value. A PyTorch whose tail rounds otherwise fails here (then route them through
    each_row); sigmoid is the control that does differ."""
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(400_000, generator=g) * 6
    for fn, src in ((torch.exp, buf), (torch.tanh, buf), (torch.log, buf.abs() + 1e-3)):
        tail = src[::2]                                # a strided input never takes the vector loop
        assert torch.equal(fn(tail), fn(tail.contiguous()))
    assert not torch.equal(torch.sigmoid(buf[::2]), torch.sigmoid(buf[::2].contiguous()))


def test_softmax_over_the_last_dim_is_row_by_row(threads):
    """The routers' and the attention's softmax stays one call: ATen runs it a whole row per
    thread, each row's exp and sum in vector steps with a partial last vector, at any row count."""
    g = torch.Generator().manual_seed(3)
    threads(3)
    for width in (4, 37, 200):
        x = torch.randn(30000 // width, width, generator=g) * 4
        full = torch.softmax(x, dim=-1)
        assert all(torch.equal(full[r], torch.softmax(x[r:r + 1], dim=-1)[0]) for r in range(x.shape[0]))


# the GGUF fixtures whose forward is batch-invariant at one thread, each with a gate through each_row
FAMILIES = ["afmoe", "gpt_oss", "kimi_linear", "muse_glimmer", "qwen3_5", "qwen3_5_moe", "rwkv7"]
LENGTHS = ((500, 1), (333, 2), (271, 4), (1, 3))     # 1105 rows in the batch


def run(model, caches, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.step(tokens, caches, "all")


def states(caches) -> list[torch.Tensor]:
    return [t for c in caches for t in getattr(c, "state", {}).values()]


@pytest.mark.skipif(not native_kernels_built(), reason="the native GGUF kernels are not built")
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_bit_for_bit_at_3_and_5_threads(family, threads):
    _, model = build(FIXTURES / family / f"{family}-q8_0.gguf", weights="gguf")
    seqs = [prompt(n, seed, 320) for n, seed in LENGTHS]
    for n in (3, 5):
        threads(n)
        alone_caches = [make_caches(model.cache_specs()) for _ in seqs]
        alone = torch.cat([run(model, c, s) for s, c in zip(seqs, alone_caches)])
        caches = [make_caches(model.cache_specs()) for _ in seqs]
        with torch.inference_mode():
            out = model.forward(Batch.build([(s, c, "all") for s, c in zip(seqs, caches)], torch.device("cpu")))
        assert torch.equal(out, alone), (n, (out != alone).any(-1).nonzero().flatten().tolist())
        for a, b in zip(alone_caches, caches):
            assert all(torch.equal(x, y) for x, y in zip(states(a), states(b))), n
