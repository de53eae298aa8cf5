"""gpt-oss against transformers' GptOssForCausalLM on a tiny random config: alternating sliding /
full attention with attention sinks, YaRN RoPE, top-k MoE with clamped SwiGLU experts; the sink
attention itself against transformers' eager attention; MXFP4 expert weights (the released
checkpoints' layout) dequantized as transformers does. (The 8-turn chat with reuse == cold, edits,
regenerate and three conversations at once: tests/test_family_reuse.py; batched == alone:
tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import native
from ssm_family_checks import check_parity, perturb_vectors, save_and_load
from tiny import prompt, random_mxfp4_experts
from turnkv.cache.kv import KVCache
from turnkv.cache.sliding import SlidingWindowCache
from turnkv.cache.specs import FULL, SLIDING
from turnkv.models.base import attention
from turnkv.models.gpt_oss import GptOssModel, dequantize_mxfp4

VOCAB = 256
WINDOW = 16


def config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return GptOssConfig(**kw)


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(config(**overrides)).eval()
    perturb_vectors(hf, scale=0.5)   # sinks and router biases too: the sinks must matter
    return save_and_load(hf, tmp_path), hf


def test_cache_specs_alternate_sliding_and_full(pair):
    model, hf = pair
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [SLIDING, FULL, SLIDING, FULL]
    assert specs[0].window == WINDOW and (specs[0].heads, specs[0].head_dim) == (2, 16)
    # YaRN: the same frequencies and attention factor as transformers
    assert torch.equal(model.rope.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model.rope.scaling == hf.model.rotary_emb.attention_scaling != 1.0


# ------------------------------------------------------------------------ the sink attention


class _Sinks(torch.nn.Module):   # what transformers' eager attention reads off the module
    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks, self.num_key_value_groups, self.training = sinks, groups, False


def _bf16(view):
    return dataclasses.replace(view, _keys=view.keys.bfloat16(), _values=view.values.bfloat16(), stored=None,
                               _mask=None)


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("path", ["native", "fallback", "float64"])
def test_sink_attention_matches_transformers_eager(kind, path, monkeypatch):
    """models/base.py ``attention(..., sinks=)`` over a cache holding more keys than the window and
    queries at an offset, against transformers' gpt-oss eager attention: the native kernel (float32
    on CPU), the fallback's explicit masked softmax with the sink column (float32 with the kernel
    turned off, as without a build; float64 and bfloat16, which the kernel never takes)."""
    from turnkv.kernels import attention as kernel
    from turnkv.models import base

    if path == "native" and not kernel.native_sinks_available():
        native.missing("the native attention kernel with sinks")
    if path == "fallback":
        monkeypatch.setattr(base, "native_attention_ok", lambda *a: False)
    dtype = torch.float64 if path == "float64" else torch.float32
    g = torch.Generator().manual_seed(0)
    Hq, Hk, D, past, T = 4, 2, 16, 40, 9
    cache = (SlidingWindowCache(Hk, D, WINDOW, 8, dtype) if kind == "sliding" else KVCache(Hk, D, dtype))
    k_all, v_all = (torch.randn(Hk, past + T, D, generator=g, dtype=dtype) for _ in range(2))
    cache.update_and_fetch(k_all[:, :past], v_all[:, :past])
    view = cache.update_and_fetch(k_all[:, past:], v_all[:, past:])
    q = torch.randn(Hq, T, D, generator=g, dtype=dtype)
    sinks = 2.0 * torch.randn(Hq, generator=g, dtype=dtype)
    ours = attention(q, view, D ** -0.5, sinks=sinks)
    assert (view._mask is None) == (path == "native")    # the kernel never builds the mask

    S = view.keys.shape[1]
    add = torch.zeros(T, S, dtype=dtype).masked_fill(~view.mask, float("-inf"))
    ref, _ = eager_attention_forward(_Sinks(sinks, Hq // Hk), q[None], view.keys[None], view.values[None],
                                     add[None, None], D ** -0.5)
    ref = ref[0].reshape(T, Hq * D)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert ours.dtype == dtype and (ours - ref).abs().max().item() < tol
    # bfloat16 (the scores rounded, the softmax in float32) stays near the exact result
    half = attention(q.bfloat16(), _bf16(view), D ** -0.5, sinks=sinks.bfloat16())
    assert half.dtype == torch.bfloat16 and (half.double() - ref.double()).abs().max().item() < 3e-2
    # the sinks matter: without them the rows are a plain softmax, and a very negative sink is one
    plain = attention(q, view, D ** -0.5)
    assert (plain - ours).abs().max().item() > 1e-2
    assert torch.allclose(attention(q, view, D ** -0.5, sinks=torch.full((Hq,), -1e4, dtype=dtype)), plain,
                          atol=1e-5)
    # one decode row (no mask) through the same path
    step = cache.update_and_fetch(k_all[:, -1:].clone(), v_all[:, -1:].clone())
    one = attention(q[:, -1:], step, D ** -0.5, sinks=sinks)
    add1 = torch.zeros(1, step.keys.shape[1], dtype=dtype)
    ref1, _ = eager_attention_forward(_Sinks(sinks, Hq // Hk), q[None, :, -1:], step.keys[None],
                                      step.values[None], add1[None, None], D ** -0.5)
    assert (one - ref1[0].reshape(1, Hq * D)).abs().max().item() < tol


# ------------------------------------------------------------------------- model vs transformers


# -------------------------------------------------------------------------------------- MXFP4


def test_mxfp4_dequantization_matches_transformers():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 10, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == ref.shape == (3, 64, 10)
    assert torch.equal(ours, ref)


def test_mxfp4_checkpoint_loads_like_its_float_weights(tmp_path):
    """A folder whose experts are stored as MXFP4 blocks + scales (no float expert tensors), as the
    released gpt-oss checkpoints are: turnkv dequantizes them and matches transformers running the
    same dequantized weights."""
    torch.manual_seed(1)
    hf = GptOssForCausalLM(config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])).eval()
    perturb_vectors(hf, scale=0.5)
    packed = random_mxfp4_experts(hf, torch.Generator().manual_seed(2))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]:
        del tensors[key]
    tensors.update(packed)
    save_file(tensors, path, metadata={"format": "pt"})
    from turnkv.loading import load_checkpoint
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in ckpt.tensors
    model = GptOssModel.from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
    check_parity(model, hf, prompt(60, seed=13), chunk=11, decode=5)


def dense_routed(tmp_path):
    # every token through all 4 experts: the routing weights are continuous in the hidden state.
    # With top-2 of 4 a weight format's rounding flips which experts some tokens take on this tiny
    # random model (measured 0.14 of the logits' scale for bfloat16, 0.23 for int8), which says
    # nothing about the format.
    return tiny(tmp_path, seed=2, num_experts_per_tok=4)


def test_released_config_spelling_rope_scaling_and_rope_theta(pair):
    """The released config.json says ``rope_scaling`` + top-level ``rope_theta`` (transformers 4.x),
    not ``rope_parameters``: the same YaRN tables either way."""
    model, hf = pair
    config = hf.config.to_dict()
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    again = GptOssModel.from_checkpoint(config, hf.state_dict(), torch.float32)
    assert torch.equal(again.rope.inv_freq, model.rope.inv_freq) and again.rope.scaling == model.rope.scaling
