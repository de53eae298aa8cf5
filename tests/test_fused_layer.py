"""The fused layer calls (models/fused.py, kernels/csrc/fused_layer.inc) on the bundled GGUFs:
they are on under the gguf weights at float32, and every logit they give is the same bits as the
unfused Python path's: a whole prompt, the prompt in 64-token chunks, decode steps, and several
sequences in one batch. Off for every other weight format and dtype, and with TURNKV_FUSED=0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import native
import tiny
from turnkv import kernels
from turnkv.cache.specs import default_modes, make_caches
from turnkv.cache.write import KeptWrites
from turnkv.loading import load_checkpoint
from turnkv.models import family_class
from turnkv.models.batch import Batch
from turnkv.models.fused import fused_available
from turnkv.models.weights import load_model

# the fused layer also stays off in a build from before it, under TURNKV_FUSED=0 or TURNKV_NORM=reference
pytestmark = [pytest.mark.real, native.needs(kernels.native_available(), "the native kernels"),
              pytest.mark.skipif(not fused_available(), reason="the fused layer is off here")]

MODELS = ["smollm2-135m", "gemma3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    q = load_checkpoint(request.param, dtype=torch.float32, progress=False, keep_quantized=True)
    return load_model(family_class(q.architecture), q.config, q.tensors, torch.float32, "gguf", quantized=q.quantized)


def fused_blocks(model):
    return [m for m in model.modules() if getattr(m, "fused", None) is not None]


class Switch:
    """Turns a model's fused blocks off and on again (the same objects, so the same weights)."""

    def __init__(self, model):
        self.blocks = fused_blocks(model)
        assert self.blocks, "no block runs fused: the comparisons below would compare nothing"
        self.fused = [b.fused for b in self.blocks]
        self.model, self.head = model, getattr(model, "norm_head", None)

    def __call__(self, on: bool):
        for b, f in zip(self.blocks, self.fused):
            b.fused = f if on else None
        if self.head is not None:       # the final norm and head's one call (models/fused.py NormHead)
            self.model.norm_head = self.head if on else None


def caches(model, kv="fp16"):
    specs = model.cache_specs()
    return make_caches(specs, dtype=torch.float32, modes=default_modes(specs, kv))


def prompt(n: int, seed: int, vocab: int = 32000) -> torch.Tensor:
    return tiny.prompt(n, seed, vocab, low=min(100, vocab // 4))   # no special or byte tokens


def run(model, ids, chunk: int | None, steps: int, kv: str = "fp16") -> torch.Tensor:
    """Last-token logits of the prompt, then of ``steps`` greedy decode steps, stacked."""
    c = caches(model, kv)
    chunk = chunk or len(ids)
    for i in range(0, len(ids), chunk):
        out = model.step(ids[i:i + chunk], c, logits="last")
    outs = [out]
    for _ in range(steps):
        outs.append(model.step(torch.tensor([int(outs[-1].argmax())]), c, logits="last"))
    return torch.stack(outs)


def test_on_for_every_block(model):
    assert len(fused_blocks(model)) == model.args.num_hidden_layers
    assert any("fused native calls" in n for n in model.weight_notes)


def test_switch_reaches_the_stack(model, monkeypatch):
    """Turning the blocks' fused calls off (``Switch``) takes the model off the one-call stack at
    the next step and on again after (``stack_for`` follows ``FusedSlot.generation``), so the
    comparisons below compare the fused path with the unfused one, not the stack with itself."""
    from turnkv import kernels

    calls = []
    real = kernels._ext.fused_layers
    monkeypatch.setattr(kernels._ext, "fused_layers", lambda *a: calls.append(1) or real(*a))
    switch = Switch(model)
    with torch.inference_mode():
        run(model, prompt(20, 0), None, 1)
        assert calls
        calls.clear()
        switch(False)
        try:
            run(model, prompt(20, 0), None, 1)
            assert not calls
        finally:
            switch(True)
        run(model, prompt(20, 0), None, 1)
        assert calls


def test_norm_head_same_bits_as_the_norm_op_and_the_heads_matmul(model, monkeypatch):
    """Llama's final norm and lm_head run as one native call (``NormHead``), the bits of the norm
    op then the head's GGUF matmul, and of the pure-PyTorch matmul on the same normalized rows;
    a decode run goes through it (so the comparisons with the unfused path include it)."""
    from turnkv.kernels import reference
    from turnkv.models.base import Model, linear, rms_norm

    if model.family != "llama":
        assert getattr(model, "norm_head", None) is None     # Gemma 3's head is its own (a soft cap)
        return
    assert model.norm_head is not None
    x = torch.randn(41, model.args.hidden_size, generator=torch.Generator().manual_seed(9))
    h = rms_norm(x, model.norm, model.args.rms_norm_eps)
    want = linear(h, model.lm_head)
    w = model.lm_head.parts[0]
    pure = reference.matmul(h, w.rows(), w.qtype, *w.shape)
    for rows in (slice(0, 1), slice(3, 11), slice(0, 41), slice(40, 41)):
        got = model.norm_head(x[rows])
        assert torch.equal(got, want[rows]) and torch.equal(got, pure[rows]), rows
        assert torch.equal(model.head(x[rows]), got) and torch.equal(Model.head(model, x[rows]), got)
    calls = []
    real = kernels._ext.norm_head
    monkeypatch.setattr(kernels._ext, "norm_head", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        run(model, prompt(20, 0), None, 2)
    assert len(calls) == 3


@pytest.mark.parametrize("kv", ["fp16", "native"])
def test_same_bits_as_unfused(model, kv):
    switch = Switch(model)
    ids = prompt(300, 0)
    with torch.inference_mode():
        fused = run(model, ids, None, 6, kv)
        chunked = run(model, ids, 64, 6, kv)
        switch(False)
        try:
            plain = run(model, ids, None, 6, kv)
            plain_chunked = run(model, ids, 64, 6, kv)
        finally:
            switch(True)
    assert torch.equal(fused, plain)
    assert torch.equal(chunked, plain_chunked)
    assert torch.equal(fused, chunked)     # chunk-invariant, as the unfused path


def test_batch_same_bits_as_alone_unfused(model):
    """Three sequences in one batch (a prefill chunk beside two decode rows) through the fused
    calls equal each sequence run alone through the unfused path."""
    switch = Switch(model)
    prompts = [prompt(n, s) for n, s in ((40, 1), (75, 2), (130, 3))]
    with torch.inference_mode():
        cs = [caches(model) for _ in prompts]
        # the first two read their prompts alone, then all three step together
        firsts = [model.step(p, c, logits="last") for p, c in zip(prompts[:2], cs[:2])]
        parts = [(torch.tensor([int(f.argmax())]), c, "last") for f, c in zip(firsts, cs[:2])]
        parts.append((prompts[2], cs[2], "last"))
        together = model.forward(Batch.build(parts))
        switch(False)
        try:
            want = []
            for j, p in enumerate(prompts):
                c = caches(model)
                first = model.step(p, c, logits="last")
                want.append(first if j == 2 else model.step(torch.tensor([int(first.argmax())]), c, logits="last"))
        finally:
            switch(True)
    for j in range(3):
        assert torch.equal(together[j], want[j]), j


def mixed_runs(model, kv: str, seed: int):
    """A 150-token prompt in 64-token chunks and 4 decode steps (``run``), then one forward of a
    90-token prefill beside two decode rows: (single's logits, the batch's logits, the three
    batch sequences' layer-0 offsets after it)."""
    ids = prompt(150, seed)
    single = run(model, ids, 64, 4, kv)
    cs = [caches(model, kv) for _ in range(3)]
    firsts = [model.step(p, c, logits="last") for p, c in zip((ids[:40], ids[:70]), cs[:2])]
    parts = [(torch.tensor([int(f.argmax())]), c, "last") for f, c in zip(firsts, cs[:2])]
    parts.append((ids[:90], cs[2], "last"))
    return single, model.forward(Batch.build(parts)), [c[0].offset for c in cs]


def on_and_off(monkeypatch, model, kv, seed: int, switch: tuple, counted: str):
    """``mixed_runs`` with ``switch`` (class, attribute) True, then False, counting the calls of
    ``kernels._ext.<counted>``: (runs on, runs off, calls while on, calls in all)."""
    from turnkv import kernels

    calls = []
    real = getattr(kernels._ext, counted)
    monkeypatch.setattr(kernels._ext, counted, lambda *a, **k: calls.append(1) or real(*a, **k))
    owner, attr = switch
    with torch.inference_mode():
        monkeypatch.setattr(owner, attr, True)
        on = mixed_runs(model, kv, seed)
        used = len(calls)
        monkeypatch.setattr(owner, attr, False)
        off = mixed_runs(model, kv, seed)
    return on, off, used, len(calls)


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
def test_one_call_layer_same_bits_as_three_calls(model, kv, monkeypatch):
    """``FusedBlock.layer`` as one native call (fused_qkv, write_attend, fused_out_mlp in C++)
    against the same three calls from Python: a chunked prompt, decode steps, and a batch of a
    prefill chunk beside two decode rows give the same bits. int4 caches are not written by the
    kernel: there the layer must take the three calls (and nothing is reserved twice). The
    layers run one by one here (FusedStack off: the next test compares the stack with this)."""
    from turnkv.models.fused import FusedBlock, FusedStack

    monkeypatch.setattr(FusedStack, "enabled", False)
    (one, one_batch, _), (three, three_batch, _), used, total = on_and_off(
        monkeypatch, model, kv, 5, (FusedBlock, "one_call"), "fused_layer")
    assert total == used
    layers = model.args.num_hidden_layers
    assert used == (0 if kv == "int4" else layers * (3 + 4 + 2 + 1)), used
    assert torch.equal(one, three)
    assert torch.equal(one_batch, three_batch)


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
def test_stack_same_bits_as_one_call_per_layer(model, kv, monkeypatch):
    """``FusedStack``: every layer of a step in one native call (``fused_layers``, the layers'
    cache plans reserved in one pass first) against one ``fused_layer`` call per layer from
    Python: a chunked prompt, decode steps, and a batch of a prefill chunk beside two decode rows
    give the same bits, with one call per forward. int4 caches are not written by the kernel:
    there the stack does nothing (nothing reserved) and the layers run one by one."""
    from turnkv.models.fused import FusedStack

    (stack, stack_batch, stack_offsets), (layers, layers_batch, layer_offsets), used, total = on_and_off(
        monkeypatch, model, kv, 6, (FusedStack, "enabled"), "fused_layers")
    assert total == used
    assert used == (0 if kv == "int4" else 3 + 4 + 2 + 1), used
    assert torch.equal(stack, layers)
    assert torch.equal(stack_batch, layers_batch)
    assert stack_offsets == layer_offsets == [41, 71, 90]


def last_rows_runs(model, ids):
    """A prompt in two 64-token chunks that ask for no logits (the engine's chunks before the
    last), its last 22 tokens, 3 decode steps; a 100-token prompt asking for every row and for its
    last; a batch of spans asking for none, the last and every row, then a decode step of each."""
    c = caches(model)
    for i in range(0, 128, 64):
        assert model.step(ids[i:i + 64], c, logits="none") is None
    out = [model.step(ids[128:], c, logits="last")]
    for _ in range(3):
        out.append(model.step(torch.tensor([int(out[-1].argmax())]), c, logits="last"))
    every = model.step(ids[:100], caches(model), logits="all")
    last = model.step(ids[:100], caches(model), logits="last")
    cs = [caches(model) for _ in range(3)]
    batch = model.forward(Batch.build([(ids[:30], cs[0], "none"), (ids[:50], cs[1], "last"), (ids[:20], cs[2], "all")]))
    after = [model.step(torch.tensor([int(ids[7])]), c, logits="last") for c in cs]
    return torch.stack(out), every, last, batch, torch.stack(after)


def test_last_layer_finishes_only_the_logit_rows(model, monkeypatch):
    """``FusedStack``'s last layer writes every row's K/V but runs the attention and the rest only
    for the rows whose logits were asked for (none in a prompt's earlier chunks, a prompt's last,
    every row of an "all" span): the same logits as the layers one by one, which finish every row,
    and the same caches (the decode steps after)."""
    from turnkv.models.fused import FusedStack

    kept = []
    real = kernels._ext.fused_layers
    monkeypatch.setattr(kernels._ext, "fused_layers", lambda *a: kept.append(a[-1]) or real(*a))
    ids = prompt(150, 7)
    with torch.inference_mode():
        trimmed = last_rows_runs(model, ids)
        monkeypatch.setattr(FusedStack, "enabled", False)
        full = last_rows_runs(model, ids)
    assert kept[:3] == [[0], [0], [1]] and [0, 1, 20] in kept, kept
    for a, b in zip(trimmed, full):
        assert torch.equal(a, b)
    assert torch.equal(trimmed[1][-1], trimmed[2])      # an "all" span's last row == its "last" run


FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
FIXTURE_FAMILIES = ["llama", "llama3", "ministral"]    # Llama-shaped blocks (models/fused.fuse_llama_block)


@pytest.mark.parametrize("family", FIXTURE_FAMILIES)
def test_fixture_families_same_bits_as_unfused(family):
    """The Q8_0 GGUFs llama.cpp's converter wrote for the Llama-shaped families (Ministral 3: its
    position-scaled queries between the two calls): fused on, and the same bits as unfused."""
    q = load_checkpoint(str(FIXTURES / family / f"{family}-q8_0.gguf"), dtype=torch.float32, progress=False,
                        keep_quantized=True)
    m = load_model(family_class(q.architecture), q.config, q.tensors, torch.float32, "gguf", quantized=q.quantized)
    assert len(fused_blocks(m)) == m.args.num_hidden_layers
    switch = Switch(m)
    ids = prompt(150, 4, m.vocab_size)
    with torch.inference_mode():
        fused, chunked = run(m, ids, None, 5), run(m, ids, 32, 5)
        switch(False)
        try:
            plain = run(m, ids, None, 5)
        finally:
            switch(True)
    assert torch.equal(fused, plain)
    assert torch.equal(chunked, plain)


def test_off_for_other_formats_and_when_disabled(monkeypatch):
    q = load_checkpoint("smollm2-135m", dtype=torch.float32, progress=False, keep_quantized=True)
    cls = family_class(q.architecture)
    native = load_model(cls, q.config, q.tensors, torch.float32, "native", quantized=q.quantized)
    assert fused_blocks(native) == []
    bf16 = load_model(cls, q.config, q.tensors, torch.bfloat16, "gguf", quantized=q.quantized)
    assert fused_blocks(bf16) == []
    monkeypatch.setenv("TURNKV_FUSED", "0")
    assert not fused_available()
    off = load_model(cls, q.config, q.tensors, torch.float32, "gguf", quantized=q.quantized)
    assert fused_blocks(off) == []


def count_plans(monkeypatch):
    """The native stack plans built (a list that grows by one a ``StackPlan``), and a
    ``KeptWrites.plan`` that drops its kept plan first: the run whose plan is built every step."""
    real_plan = KeptWrites.plan

    def built_every_step(self, seqs, lens, layers):
        self._kept = None
        return real_plan(self, seqs, lens, layers)

    made = []
    real_sp = kernels._ext.StackPlan
    monkeypatch.setattr(kernels._ext, "StackPlan", lambda plans: made.append(1) or real_sp(plans))
    return made, built_every_step


def test_kept_plan_same_bits_as_a_plan_built_every_step(model, monkeypatch):
    """``FusedStack`` keeps its native plan from step to step (cache/write.py ``KeptWrites``): when a
    step's spans are the last step's caches and each only moved on inside blocks it owns, the
    plan's query positions move on and nothing else is built or converted. Three sequences on one
    pool per layer decode across block boundaries; between steps a sequence gets a snapshot
    restored, one is truncated and decodes over the cut, a step leaves one out, one takes a
    prefill chunk beside the decode rows, every pool grows (new buffers) between two steps, and a
    fourth sequence joins with a prompt longer than Gemma 3's window, so its sliding layers' first
    key positions move on at every step and, past the window and the slack, a block leaves them.
    Every logit equals the run whose plan is built at every step; on both models most steps advance
    the kept plan, and its query and first key positions end equal to what the caches reserved.
    (Each of ``_Kept``'s three checks, dropped alone, fails this test.)"""
    made, built_every_step = count_plans(monkeypatch)

    def drive() -> tuple[list[torch.Tensor], int, int]:
        made.clear()
        calls = []
        cs = [caches(model)]
        pools = [getattr(c, "pool", None) for c in cs[0]]
        specs = model.cache_specs()
        cs += [make_caches(specs, dtype=torch.float32, modes=default_modes(specs, "fp16"), pools=pools)
               for _ in range(2)]
        outs = [model.step(p, c, logits="last") for p, c in zip((prompt(50, 1), prompt(60, 2), prompt(126, 3)), cs)]
        logits = []

        def step(which, rows=None):
            rows = rows or {}
            parts = [(rows.get(j, torch.tensor([int(outs[j].argmax())])), cs[j], "last") for j in which]
            calls.append(1)
            for j, o in zip(which, model.forward(Batch.build(parts))):
                outs[j] = o
                logits.append(o)

        for _ in range(12):                        # the third crosses its block boundary at 128
            step([0, 1, 2])
        snap = [c.snapshot() for c in cs[0]]
        for _ in range(6):
            step([0, 1, 2])
        for c, s in zip(cs[0], snap):               # back 6 tokens, onto blocks shared with the snapshot
            c.restore(s)
        outs[0] = logits[-3 * 7 + 0]
        for _ in range(4):
            step([0, 1, 2])
        for c in cs[1]:
            c.truncate(c.offset - 3)
        outs[1] = logits[-3 * 4 + 1]
        for _ in range(4):
            step([0, 1, 2])
        step([0, 2])
        step([0, 1, 2], rows={2: prompt(10, 4)})
        step([0, 1, 2])
        grow = make_caches(specs, dtype=torch.float32, modes=default_modes(specs, "fp16"), pools=pools)
        for c in grow:                              # between two steps: every pool grows (new buffers)
            c.reserve(1200)
        step([0, 1, 2])
        del grow
        cs.append(make_caches(specs, dtype=torch.float32, modes=default_modes(specs, "fp16"), pools=pools))
        # past Gemma 3's 512-token window; its sliding caches release a block past 512 + 256 + 64
        outs.append(model.step(prompt(800, 5), cs[3], logits="last"))
        for _ in range(70):                          # every sequence crosses a boundary
            step([0, 1, 2, 3])
        stack = model.__dict__["_fused_stack"][1]
        # the last step's plan, kept: per layer, its query and first key positions are what each
        # span's cache reserved for its last token
        native = stack._writes._kept.native
        for i, (q, k) in enumerate(zip(native.query_positions(), native.key_positions())):
            assert q == [c[i].offset - 1 for c in cs]
            assert k == [max(c[i].floor, c[i].needed_from(c[i].offset - 1)) for c in cs]
            if model.family == "gemma3" and cs[3][i].kind == "sliding":
                assert k[3] == cs[3][i].offset - cs[3][i].window > 0 and cs[3][i].floor > 0
        return logits, len(made), len(calls)

    with torch.inference_mode():
        kept, built_kept, steps = drive()
        monkeypatch.setattr(KeptWrites, "plan", built_every_step)
        fresh, built_fresh, _ = drive()
    assert len(kept) == len(fresh)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    assert built_fresh == steps + 4         # and the four prompts' steps
    assert built_kept < steps // 4, (built_kept, steps)


def test_plans_kept_by_length_over_verified_drafts(model, monkeypatch):
    """A speculating sequence's steps (docs/speculative.md): one-row decode steps, now and then a
    verified draft of 2, 4 or 8 rows cut back after it to the tokens taken, over a block boundary
    and, on Gemma 3, past its sliding window. The one-row plan is built once and brought up to date
    by its own ``advance`` calls after each draft (cache/write.py ``KeptWrites``; a draft's plan
    is built again unless its span moved on by whole drafts); every logit equals the run whose
    plan is built at every step."""
    made, built_every_step = count_plans(monkeypatch)
    # (draft rows, tokens kept) per step: 0 rows is a plain one-row step
    pattern = [(0, 1), (0, 1), (4, 2), (0, 1), (2, 1), (0, 1), (0, 1), (8, 8), (0, 1), (4, 1), (2, 2), (0, 1)]

    def drive() -> tuple[list[torch.Tensor], int, int]:
        made.clear()
        c = caches(model)
        last = model.step(prompt(500, 7), c, logits="last")
        logits, one_row = [], 0
        for rows, keep in pattern * 6:
            ids = torch.tensor([int(last.argmax())] + prompt(max(rows - 1, 0), len(logits)).tolist())
            before = len(made)
            out = model.step(ids, c, logits="all")
            one_row += len(made) - before if not rows else 0
            logits.append(out)
            if rows:
                for layer in c:
                    layer.truncate(layer.offset - rows + keep)
            last = out[keep - 1]
        return logits, len(made), one_row

    with torch.inference_mode():
        kept, built_kept, one_row_kept = drive()
        monkeypatch.setattr(KeptWrites, "plan", built_every_step)
        fresh, built_fresh, one_row_fresh = drive()
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    assert built_fresh == len(pattern) * 6 + 1 and one_row_fresh == 7 * 6
    # the first one-row step's, and one where a block boundary or a sliding window's block moved
    # the caches (a few over these 72 steps)
    assert one_row_kept <= 5 and built_kept < built_fresh - 35, (one_row_kept, built_kept)
