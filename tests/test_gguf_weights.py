"""The ``gguf`` weight format (turnkv/models/weights.py): the GGUF's own quantized blocks, run by
turnkv.kernels' native GGUF matmul, with no float32 copy of what stays quantized.

- the loader's raw blocks (``load_checkpoint(..., keep_quantized=True)``) dequantize to exactly the
  float tensors of the float loader (llama's q/k un-permute applied to the raw rows);
- the fused weights (q/k/v, gate/up) hold the same parts in the family's order (dequantized, they
  equal the native model's fused parameters bit for bit);
- on both bundled models the logits are close to float32 native (int8 activations: the error is
  the kernel's activation rounding; see TOLERANCE) with the same top-1, and 16 greedy tokens equal;
- the model holds under a third of float32's bytes; HF folders give a clear error.

The bundled-model tests need the native kernels (``python -m turnkv.kernels.build``, run by the
install): the PyTorch reference computes the same numbers but too slowly for a 262k-row head.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import native
from tiny import tiny_gemma3, tiny_llama
from turnkv.cache.specs import make_caches
from turnkv.models.weights import GGUFPacked, PackedWeight, load_model, model_nbytes

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
PROMPT = "What is the capital of France? Answer in one sentence."
# max |logit - float32 native logit| on the prompt's last token, relative to max |native logit|:
# the int8 activation quantization of every matmul input (per block of 32 or 256 values).
# Measured: 0.055 on Gemma 3 (max |dlogit| ~1.3 of ~24), less on SmolLM2; the tiny models' is
# below 0.05.
TOLERANCE = 0.1
# A greedy step whose float32 native top-2 logits are closer than this is a near-tie: the int8
# activations (max |dlogit| 0.6-1.7 over the vocabulary) may pick the runner-up there. Measured on
# the 16-token chat below: SmolLM2's first token (gap 0.08, "The" vs "L") and Gemma 3's 8th
# (gap 0.47); every other step's gap is >= 1.1 and gguf picks native's token.
NEAR_TIE = 0.75


def kernels_native() -> bool:
    try:
        from turnkv import kernels
    except Exception:  # noqa: BLE001
        return False
    return kernels.native_available()


needs_native = native.needs(kernels_native(), "the native GGUF kernels")


# ------------------------------------------------------------------ tiny models, no GGUF file


def quantize_raw(w: torch.Tensor, qtype: Q):
    from turnkv.kernels import GGUFWeight

    raw = gguf.quants.quantize(w.float().numpy(), qtype)
    return GGUFWeight.from_raw(torch.from_numpy(np.ascontiguousarray(raw)), qtype, tuple(w.shape))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_fused_parts_keep_the_family_order(family):
    """q/k/v with a different type for v (as Gemma's Q4_K_M mixes Q5_0 and Q8_0): the fused weight
    is split by type, and its parts dequantized equal the native model built from the same values."""
    _, hf = tiny_llama() if family == "llama" else tiny_gemma3()
    config, state = hf.config.to_dict(), hf.state_dict()
    quantized, tensors = {}, {}
    for name, t in state.items():
        if t.ndim == 2 and "proj" in name:
            quantized[name] = quantize_raw(t, Q.Q8_0 if "v_proj" in name or "down" in name else Q.Q4_1)
        else:
            tensors[name] = t
    exact = {**tensors, **{n: q.dequantize() for n, q in quantized.items()}}
    native = load_model(type(_), config, exact, torch.float32, "native")
    model = load_model(type(_), config, tensors, torch.float32, "gguf", quantized=quantized)
    assert not any(p.is_meta for p in model.parameters())
    for blk_n, blk_g in zip(native.layers, model.layers):
        for attr, owner in (("wqkv", "attn"), ("wo", "attn"), ("wgu", "mlp"), ("wdown", "mlp")):
            g = getattr(getattr(blk_g, owner), attr)
            assert isinstance(g, GGUFPacked)
            deq = torch.cat([p.dequantize() for p in g.parts])
            assert torch.equal(deq, getattr(getattr(blk_n, owner), attr))
        assert [len(blk_g.attn.wqkv.parts), len(blk_g.mlp.wgu.parts)] == [2, 1]   # Q4_1 q+k | Q8_0 v
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = native.step(ids, make_caches(native.cache_specs(), torch.float32), "all")
        got = model.step(ids, make_caches(model.cache_specs(), torch.float32), "all")
    assert (got - ref).abs().max() < TOLERANCE * ref.abs().max()


@needs_native
def test_the_build_tiles_the_kept_weights_in_one_gather(monkeypatch):
    """A GGUF load's weights come pending (the file's rows, ``defer=True``), fused ones made of
    pending parts: the build tiles every weight the model keeps in one call of the native gather
    (one parallel region for the load's repack) before the fused calls take their tiles, and
    their values are the parts'."""
    from turnkv.kernels import GGUFWeight, tiles

    _, hf = tiny_llama()
    config, state = hf.config.to_dict(), hf.state_dict()
    quantized, tensors = {}, {}
    for name, t in state.items():
        if t.ndim == 2 and "proj" in name:
            raw = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(t.float().numpy(), Q.Q8_0)))
            quantized[name] = GGUFWeight.from_raw(raw, Q.Q8_0, tuple(t.shape), defer=True)
        else:
            tensors[name] = t
    calls, gather = [], tiles.native_gather
    monkeypatch.setattr(tiles, "native_gather", lambda *args: (calls.append(len(args[0])), gather(*args)))
    model = load_model(type(_), config, tensors, torch.float32, "gguf", quantized=quantized)
    parts = [p for m in model.modules() if isinstance(m, GGUFPacked) for p in m.parts]
    assert len(calls) == 1 and parts and all(p._pending is None for p in parts)
    blk = model.layers[0].attn.wqkv.parts[0]
    names = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert torch.equal(blk.dequantize(), torch.cat([quantized[n].dequantize() for n in names]))


def test_gguf_format_needs_quantized_tensors():
    model, hf = tiny_llama()
    with pytest.raises(ValueError, match="gguf"):
        load_model(type(model), hf.config.to_dict(), hf.state_dict(), torch.float32, "gguf")


def test_hf_folder_is_a_clear_error(tmp_path):
    from turnkv.engine.engine import Engine
    from turnkv.loading import ModelLoadError, source_kind
    from turnkv.models.llama import LlamaModel
    from turnkv.models.weights import default_format

    _, hf = tiny_llama()
    hf.save_pretrained(tmp_path / "tiny")
    with pytest.raises(ModelLoadError, match="--weights gguf.*Hugging Face folder"):
        Engine.load(str(tmp_path / "tiny"), weights="gguf", progress=False)
    assert source_kind(tmp_path / "tiny") == ("hf", None)
    assert default_format("hf", LlamaModel) == "native"     # the default on an HF folder: native


# ------------------------------------------------------------------ bundled models


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(name, float32 checkpoint, float32 native engine, gguf engine) of a bundled model."""
    from turnkv.engine.engine import Engine
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class

    name = request.param
    try:
        ckpt = load_checkpoint(name, progress=False)
    except Exception as e:  # noqa: BLE001 - the model package is not installed
        pytest.skip(f"{name}: {e}")
    net = load_model(family_class(ckpt.architecture), ckpt.config, ckpt.tensors, torch.float32, "native").eval()
    native = Engine(net, ckpt.tokenizer, fingerprint=ckpt.fingerprint, name=name, weights="native",
                    max_context=4096)
    gguf_engine = Engine.load(name, weights="gguf", progress=False) if kernels_native() else None
    return name, ckpt, native, gguf_engine


@pytest.mark.real
def test_loader_blocks_dequantize_to_the_float_loader(pair):
    from turnkv.loading import load_checkpoint
    from turnkv.loading.gguf import dequantize_rows

    name, ref, _, _ = pair
    got = load_checkpoint(name, progress=False, keep_quantized=True)
    assert got.quantized and set(got.quantized).isdisjoint(got.tensors)
    assert set(got.quantized) | set(got.tensors) == set(ref.tensors)
    for n, t in got.tensors.items():
        assert torch.equal(t, ref.tensors[n]), n
    last = f"model.layers.{ref.config['num_hidden_layers'] - 1}."
    for n, q in got.quantized.items():
        assert tuple(q.shape) == tuple(ref.tensors[n].shape), n
        # the raw rows, dequantized by the float loader's own routine: same bytes, same row order
        # (q/k: the un-permute applied to the raw rows); every q/k, all of the first and last layer
        if "q_proj" in n or "k_proj" in n or n.startswith(("model.layers.0.", last)) or "layers" not in n:
            assert torch.equal(dequantize_rows(q.rows().numpy(), q.qtype), ref.tensors[n]), n
    # GGUFWeight's own dequantize / lookup agree (one layer, and embedding rows at both ends)
    for n, q in got.quantized.items():
        if n.startswith("model.layers.0."):
            assert torch.equal(q.dequantize(), ref.tensors[n]), n
    emb = got.quantized["model.embed_tokens.weight"]
    rows = torch.cat([torch.arange(512), torch.arange(emb.shape[0] - 512, emb.shape[0])])
    assert torch.equal(emb.lookup(rows, torch.float32), ref.tensors["model.embed_tokens.weight"][rows])


@pytest.mark.real
@needs_native
def test_fused_weights_equal_native_parameters(pair):
    _, _, native, eng = pair
    for blk_n, blk_g in zip(native.model.layers, eng.model.layers):
        for owner, attr in (("attn", "wqkv"), ("attn", "wo"), ("mlp", "wgu"), ("mlp", "wdown")):
            g = getattr(getattr(blk_g, owner), attr)
            assert isinstance(g, GGUFPacked), (owner, attr)
            assert torch.equal(torch.cat([p.dequantize() for p in g.parts]), getattr(getattr(blk_n, owner), attr))
    assert isinstance(eng.model.lm_head, GGUFPacked) and eng.model.lm_head.float_out


@pytest.mark.real
@needs_native
def test_decode_embedding_rows_from_the_row_cache_are_exact_and_fresh(pair, monkeypatch):
    """A decode step's few embedding rows come from a small cache of dequantized rows: they equal
    the float checkpoint's rows on a miss and on a hit, in any shape, each lookup returns a fresh
    tensor (the families add into it in place), and the cache stays within its bound."""
    _, _, native, eng = pair
    emb, want = eng.model.embed, native.model.embed
    assert isinstance(emb, GGUFPacked)
    monkeypatch.setattr(GGUFPacked, "ROW_CACHE_BYTES", 6 * want.shape[1] * 4)     # 6 float32 rows
    emb.__dict__.pop("_rows", None)
    vocab = want.shape[0]
    for ids in ([5], [vocab - 1, 5, 5], [[7, 8], [9, 5]], [1, 2, 3, 4], [5], list(range(100, 108))):
        t = torch.tensor(ids)
        got = emb.lookup(t, torch.float32)
        assert got.shape == (*t.shape, want.shape[1])
        assert torch.equal(got, want[t]), ids
        got.add_(1.0)                                        # in place, as the decoder does
        assert torch.equal(emb.lookup(t, torch.float32), want[t]), ids
        assert len(emb.__dict__["_rows"]) <= 8               # bounded (cleared when full)
    long = torch.arange(0, 40)                               # a prefill chunk: not through the cache
    assert torch.equal(emb.lookup(long, torch.float32), want[long])


@pytest.mark.real
@needs_native
def test_logits_close_to_float32_native_same_top1(pair):
    _, _, native, eng = pair
    ids = torch.tensor(native.tokenizer.encode(PROMPT))
    with torch.inference_mode():
        ref = native.model.step(ids, make_caches(native.model.cache_specs(), torch.float32), "all")
        got = eng.model.step(ids, make_caches(eng.model.cache_specs(), torch.float32), "all")
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = ((got[-1] - ref[-1]).abs().max() / ref[-1].abs().max()).item()
    assert err < TOLERANCE, err
    assert int(got[-1].argmax()) == int(ref[-1].argmax())
    # top-1 at every position of the prompt where native's top-2 gap is not a near-tie
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
    assert bool((got.argmax(-1) == ref.argmax(-1))[clear].all())


@pytest.mark.real
@needs_native
def test_greedy_16_tokens_equal_native_but_near_ties(pair):
    """16 greedy tokens of a chat: gguf's argmax equals float32 native's at every step where
    native's top-2 gap is >= NEAR_TIE (teacher-forced on native's tokens), and the free-running
    gguf generation equals native's up to the first such near-tie."""
    from turnkv.engine.sampling import SamplingParams

    _, _, native, eng = pair
    torch.set_num_threads(1)   # 32 decode steps: robust to a busy 2-core machine (conftest restores)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    req = native.chat_request(msgs, params)
    prompt = list(req.prompt_ids)
    a = native.generate(req)
    b = eng.generate(eng.chat_request(msgs, params))
    ids = torch.tensor(prompt + a.token_ids[:-1])
    P = len(prompt)
    with torch.inference_mode():
        ref = native.model.step(ids, make_caches(native.model.cache_specs(), torch.float32), "all")[P - 1:]
        got = eng.model.step(ids, make_caches(eng.model.cache_specs(), torch.float32), "all")[P - 1:]
    top2 = ref.topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) < NEAR_TIE
    assert torch.equal(ref.argmax(-1), torch.tensor(a.token_ids))
    assert bool(((got.argmax(-1) == ref.argmax(-1)) | tie).all()), (a.text, b.text)
    first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    assert first is None or bool(tie[first]), (first, a.text, b.text)


@pytest.mark.real
@needs_native
def test_no_float32_copy_and_own_cache_namespace(pair):
    _, _, native, eng = pair
    from turnkv.kernels.attention import numerics_tag

    assert eng.weights == "gguf" and eng.fingerprint != native.fingerprint
    assert eng.fingerprint.endswith(f"+w:gguf+k:{numerics_tag()}")   # the kernels' numerics name it too
    # every declared projection and the head are GGUF blocks; nothing float32 of their shape remains
    assert not any(p.is_meta for p in eng.model.parameters())
    proj = [m for m in eng.model.modules() if isinstance(m, PackedWeight)]
    assert all(isinstance(m, GGUFPacked) for m in proj) and len(proj) >= 4 * len(eng.model.layers) + 1
    big = {tuple(p.shape) for p in native.model.parameters() if p.ndim == 2}
    assert not [p for p in eng.model.parameters() if p.ndim == 2 and tuple(p.shape) in big]
    assert model_nbytes(eng.model) < model_nbytes(native.model) / 3


@pytest.mark.real
@needs_native
def test_the_loaded_model_keeps_no_view_of_its_file(pair):
    """The load reads each weight's rows from the file's mapping once, into the weight's tiles,
    and closes the mapping: no pending weight is left and the file is not mapped any more."""
    from turnkv.kernels import GGUFWeight
    from turnkv.loading.bundled import locate_bundled

    name, _, _, eng = pair
    path = os.path.realpath(locate_bundled(name))
    weights = [p for m in eng.model.modules() if isinstance(m, GGUFPacked) for p in m.parts]
    assert weights and all(isinstance(w, GGUFWeight) and w._pending is None for w in weights)
    with open("/proc/self/maps") as f:
        assert path not in f.read()


@pytest.mark.real
@needs_native
def test_default_is_gguf_and_the_banner_says_so(pair, capsys):
    from turnkv.cli import print_banner
    from turnkv.kernels import kernel_info
    from turnkv.loading import source_kind
    from turnkv.models import family_class
    from turnkv.models.weights import default_format

    name, _, _, eng = pair
    kind, arch = source_kind(name)
    assert kind == "gguf" and default_format(kind, family_class(arch)) == "gguf"
    print_banner(eng, 2048, True)
    err = capsys.readouterr().err
    assert "weights gguf" in err and kernel_info() in err
