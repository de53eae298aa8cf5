"""The model code against its oracle, transformers, on the same weights (float32):
last-position logits on a ~600-token chat prompt within 1e-3, 64 greedy tokens identical, and
internal consistency of one-chunk prefill, many-chunk prefill and token-by-token decode
(a Gemma sequence of 1,500+ tokens, so the sliding-window rings wrap)."""

from __future__ import annotations

import pytest
import torch

from turnkv.cache.specs import make_caches
from turnkv.loading import load_checkpoint
from turnkv.models import family_class

pytestmark = pytest.mark.real

TOPIC = ("The history of the lighthouse keepers of the northern coast, their daily routines, the lamps "
         "they tended, the storms they logged and the ships they saved. ")


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request):
    from transformers import AutoModelForCausalLM

    ckpt = load_checkpoint(request.param, progress=False)
    ours = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.source.parent), gguf_file=ckpt.source.name,
                                              dtype=torch.float32).eval()
    return request.param, ckpt, ours, hf


def chat_prompt(ckpt, approx_tokens: int) -> list[int]:
    words = TOPIC * (approx_tokens // 20 + 1)
    messages = [{"role": "system", "content": "You are a careful historian. " + words[: int(approx_tokens * 5.4)]},
                {"role": "user", "content": "Summarise the most important points in three sentences."}]
    return list(ckpt.tokenizer.render_chat(messages, add_generation_prompt=True).ids)


def ours_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    caches = make_caches(model.cache_specs(), torch.float32)
    out = []
    with torch.inference_mode():
        for a in range(0, len(ids), chunk):
            out.append(model.step(torch.tensor(ids[a:a + chunk]), caches, "all"))
    return torch.cat(out)


def test_last_logits_and_greedy_tokens_match_transformers(pair):
    name, ckpt, ours, hf = pair
    ids = chat_prompt(ckpt, 600)
    assert 500 <= len(ids) <= 800, len(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
        caches = make_caches(ours.cache_specs(), torch.float32)
        got = ours.step(torch.tensor(ids), caches, "last")
        assert (got - ref).abs().max().item() < 1e-3
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
        ours_out, logits = [], got
        for _ in range(64):
            tok = int(torch.argmax(logits))
            ours_out.append(tok)
            logits = ours.step(torch.tensor([tok]), caches, "last")
    assert ours_out == hf_out


@pytest.mark.slow
def test_chunked_prefill_and_decode_agree(pair):
    name, ckpt, ours, hf = pair
    n = 1600 if name == "gemma3-270m" else 700
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40000, (n,), generator=g).tolist()
    one = ours_logits(ours, ids, n)
    many = ours_logits(ours, ids, 97)
    assert (one - many).abs().max().item() < 2e-3
    caches = make_caches(ours.cache_specs(), torch.float32)
    with torch.inference_mode():
        ours.step(torch.tensor(ids[: n - 24]), caches, "none")
        steps = torch.stack([ours.step(torch.tensor([t]), caches, "last") for t in ids[n - 24:]])
    assert (steps - one[n - 24:]).abs().max().item() < 2e-3
    if name == "gemma3-270m":
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (one - ref).abs().max().item() < 2e-3      # the wrapped rings match transformers' masks


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_hf_folder_matches_transformers(tmp_path, family):
    from tiny import tiny_gemma3, tiny_llama

    _, hf = (tiny_llama if family == "llama" else tiny_gemma3)(seed=3)
    hf.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    ours = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits[0]
    got = ours_logits(ours, ids[0].tolist(), 70)
    assert (got - ref).abs().max().item() < 1e-4
