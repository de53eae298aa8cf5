"""Each family's GGUF loader against the layout llama.cpp writes.

The fixtures under tests/gguf_fixtures/<family>/ were made by llama.cpp's own
`convert_hf_to_gguf.py` from a tiny random transformers model, which sits beside them as an HF
folder (tests/gguf_fixtures/convert.py says how; CI does not need llama.cpp). For every family:

- the float32 GGUF gives the same config-derived model as the HF folder: logits on a 300-token
  prompt within 1e-5 of the HF-loaded model's (both loaded by turnkv; the HF path is held to
  transformers by tests/test_family_<family>.py), and 16 greedy tokens equal;
- the Q8_0 GGUF, run on its own blocks (`--weights gguf`), stays close and agrees on the top token
  (int8 weights and activations);
- the tokenizer converted from the GGUF encodes a text as the folder's tokenizer does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny import prompt
from turnkv.cache.specs import make_caches
from turnkv.loading import load_checkpoint
from turnkv.models import family_class
from turnkv.models.weights import load_model

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
# a vision pair (a text GGUF and its mmproj) is held to its folder by tests/test_gguf_vision.py
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "hf").is_dir() and (p / f"{p.name}-f32.gguf").is_file()
                  and not any(p.glob("mmproj*.gguf")))
F32_TOL = 1e-5
Q8_TOL = 0.1  # relative to max |logit|: int8 weights and int8 activations
# HF's top-2 logits closer than this (relative to max |logit|) are a near-tie that the Q8_0 weights
# may flip: gpt_oss's checked position has a gap of 0.4%, and the float model of the file's exact
# Q8_0 weights already picks the runner-up there
NEAR_TIE = 0.01
TEXT = "the quick brown fox restores what it computed before"


def build(spec, weights="native"):
    ckpt = load_checkpoint(spec, dtype=torch.float32, progress=False, keep_quantized=weights == "gguf")
    cls = family_class(ckpt.architecture)
    model = load_model(cls, ckpt.config, ckpt.tensors, torch.float32, weights=weights, quantized=ckpt.quantized)
    return ckpt, model.eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.step(tokens, make_caches(model.cache_specs()), logits="all").float()


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    caches = make_caches(model.cache_specs())
    out, x = [], prompt
    with torch.no_grad():
        for _ in range(n):
            t = int(model.step(x, caches, logits="last").float().reshape(-1).argmax())
            out.append(t)
            x = torch.tensor([t])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    name = request.param
    hf_ckpt, hf_model = build(FIXTURES / name / "hf")
    return name, hf_ckpt, hf_model


def test_fixtures_present():
    assert "llama" in FAMILIES


def test_f32_gguf_equals_hf_folder(family):
    name, hf_ckpt, hf_model = family
    ckpt, model = build(FIXTURES / name / f"{name}-f32.gguf")
    assert ckpt.kind == "gguf" and ckpt.architecture == hf_ckpt.architecture
    tokens = prompt(300, 5, hf_ckpt.config.get("vocab_size") or hf_ckpt.config["text_config"]["vocab_size"])
    want, got = logits(hf_model, tokens), logits(model, tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= F32_TOL
    assert greedy(model, tokens[:40], 16) == greedy(hf_model, tokens[:40], 16)


def test_q8_gguf_on_its_own_blocks(family):
    name, hf_ckpt, hf_model = family
    path = FIXTURES / name / f"{name}-q8_0.gguf"
    if not path.is_file():
        pytest.skip(f"no Q8_0 fixture for {name}")
    ckpt, model = build(path, weights="gguf")
    assert ckpt.quantized, "the Q8_0 file's matrices should stay quantized"
    tokens = prompt(64, 5, hf_ckpt.config.get("vocab_size") or hf_ckpt.config["text_config"]["vocab_size"])
    want, got = logits(hf_model, tokens)[-1], logits(model, tokens)[-1]
    assert (got - want).abs().max().item() <= Q8_TOL * want.abs().max().item()
    top = want.topk(2)
    if top.values[0] - top.values[1] > NEAR_TIE * want.abs().max():
        assert int(got.argmax()) == int(want.argmax())
    else:   # a near-tie the Q8_0 weights decide: got's top token is one of the two
        assert int(got.argmax()) in top.indices.tolist()


def test_gguf_tokenizer_matches_folder(family, tmp_path, monkeypatch):
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path))
    name, hf_ckpt, _ = family
    ckpt = load_checkpoint(FIXTURES / name / f"{name}-f32.gguf", progress=False)
    assert ckpt.tokenizer is not None
    assert ckpt.tokenizer.encode(TEXT) == hf_ckpt.tokenizer.encode(TEXT)


def test_default_weight_format_follows_how_the_file_is_stored(tmp_path, monkeypatch):
    """A GGUF stored quantized runs on its own blocks by default (when the kernels are built); one
    stored in float32 has none to run on and loads native instead of failing. The default KV mode
    follows: float16 on the gguf weights, native otherwise."""
    from turnkv.engine.engine import Engine
    from turnkv.loading import gguf_runs_quantized
    from turnkv.models.weights import native_kernels_built

    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path))
    f32, q8 = FIXTURES / "llama" / "llama-f32.gguf", FIXTURES / "llama" / "llama-q8_0.gguf"
    assert not gguf_runs_quantized(f32) and gguf_runs_quantized(q8)
    assert not gguf_runs_quantized(FIXTURES / "llama" / "hf")
    assert Engine.load(str(f32), weights=None, progress=False).weights == "native"
    assert Engine.load(str(q8), weights=None, progress=False).weights == (
        "gguf" if native_kernels_built() else "native")
    # --kv-cache-mode auto: fp16 KV under the gguf weights at float32, the compute dtype otherwise
    auto = Engine.load(str(q8), weights=None, progress=False, kv_mode="auto")
    assert auto.kv_mode == ("fp16" if native_kernels_built() else "native")
    assert set(auto.modes) == {auto.kv_mode}
    assert Engine.load(str(f32), weights=None, progress=False, kv_mode="auto").kv_mode == "native"
    assert Engine.load(str(q8), weights="native", progress=False, kv_mode="auto").kv_mode == "native"
