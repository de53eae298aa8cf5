"""RWKV-7's quantized GGUFs on turnkv's GGUF kernels (``--weights gguf``), on files llama.cpp's own
tools made (tests/gguf_fixtures/rwkv7_quant/make.py): the converter's Q8_0 of the tiny folder
(Q8_0 low-rank projections among them) and llama-quantize's Q4_K_M of a wider model (Q4_K, a Q6_K
head). Every quantized matrix runs on its blocks; the logits stay within the format's tolerance of
the float model of the same (dequantized) weights; and since every projection is a row-wise kernel
and the recurrence runs token by token, a prompt's logits and states are the same bits in chunks of
64 or 512, batched or alone, restored or cold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_gguf_families import build
from tiny import engine, prompt, request
from turnkv.cache.specs import make_caches
from turnkv.loading import gguf_type_summary
from turnkv.models.batch import Batch
from turnkv.models.gguf_weights import GGUFPacked
from turnkv.models.weights import native_kernels_built

FIXTURES = Path(__file__).resolve().parent / "gguf_fixtures"
FILES = {"q8_0": FIXTURES / "rwkv7" / "rwkv7-q8_0.gguf",
         "q4_k_m": FIXTURES / "rwkv7_quant" / "rwkv7-wide-q4_k_m.gguf"}
TYPES = {"q8_0": {"Q8_0"}, "q4_k_m": {"Q4_K", "Q6_K"}}
# int8 activations (the kernels quantize each 32-value block of a row, as llama.cpp does): relative
# to the largest logit, the format's contract (tests/test_gguf_families.py's Q8_TOL is 0.1)
TOL = 0.05
VOCAB = 320

pytestmark = pytest.mark.skipif(not native_kernels_built(), reason="the native GGUF kernels are not built")


@pytest.fixture(scope="module", params=sorted(FILES))
def pair(request):
    """(name, checkpoint, the model on the GGUF's blocks, the float32 model of the same weights)."""
    ckpt, model = build(FILES[request.param], weights="gguf")
    _, native = build(FILES[request.param])
    return request.param, ckpt, model, native


def fresh(model):
    return make_caches(model.cache_specs())


def run(model, caches, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model.step(tokens[s:s + chunk], caches, "all") for s in range(0, len(tokens), chunk)])


def states(caches) -> list[torch.Tensor]:
    return [t for c in caches for t in c.state.values()]


def test_every_quantized_matrix_runs_on_its_blocks(pair):
    name, ckpt, model, _ = pair
    assert ckpt.quantized and not [n for n in model.weight_notes if "dequantized" in n], model.weight_notes
    packed = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules() if isinstance(m, GGUFPacked)}
    assert {"wr", "wk", "wv", "wo", "lm_head", "embed"} <= set(packed)
    assert TYPES[name] <= {t for m in model.modules() if isinstance(m, GGUFPacked) for t in m.qtypes}
    if name == "q8_0":   # the converter quantized the low-rank down-projections of 64 inputs
        assert {"a1", "g1", "v1"} <= set(packed)
    summary = gguf_type_summary(FILES[name], ckpt.quantized)     # the banner's line
    assert "float32 copies" not in summary, summary


def test_logits_within_the_format_tolerance_of_the_same_weights_in_float(pair):
    _, _, model, native = pair
    tokens = prompt(96, 5, VOCAB)
    got, want = run(model, fresh(model), tokens, 96), run(native, fresh(native), tokens, 96)
    scale = want.abs().max()
    assert ((got - want).abs().max() / scale).item() < TOL
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * scale
    assert clear.sum() > 48 and bool((got.argmax(-1) == want.argmax(-1))[clear].all())


def test_chunks_of_64_equal_one_chunk_of_512_bit_for_bit(pair):
    _, _, model, _ = pair
    tokens = prompt(520, 7, VOCAB)
    a, b = fresh(model), fresh(model)
    assert torch.equal(run(model, a, tokens[:512], 64), run(model, b, tokens[:512], 512))
    assert all(torch.equal(x, y) for x, y in zip(states(a), states(b)))
    # then decode steps against one chunk of the same tokens
    assert torch.equal(run(model, a, tokens[512:], 1), run(model, b, tokens[512:], 8))


def test_batched_equals_alone_bit_for_bit(pair):
    _, _, model, _ = pair
    seqs = [prompt(n, seed, VOCAB) for n, seed in ((70, 1), (33, 2), (1, 3))]
    alone = [run(model, fresh(model), s, len(s)) for s in seqs]
    caches = [fresh(model) for _ in seqs]
    with torch.inference_mode():
        out = model.forward(Batch.build([(s, c, "all") for s, c in zip(seqs, caches)], torch.device("cpu")))
    assert torch.equal(out, torch.cat(alone))


def test_chat_reuse_equals_cold_bit_for_bit(pair):
    _, _, model, _ = pair
    on, off = engine(model), engine(model, budget=0)
    history = [prompt(40, 11, VOCAB).tolist()]
    for turn in range(4):
        history.append(prompt(9, 20 + turn, VOCAB).tolist())
        a, b = on.generate(request(history, 5)), off.generate(request(history, 5))
        assert a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)
        assert b.usage.cached_tokens == 0
        if turn:      # everything the previous turn computed but its last sampled token
            assert a.usage.cached_tokens == sum(map(len, history[:-1])), (turn, a.usage)
        history.append(a.token_ids[:-1])
