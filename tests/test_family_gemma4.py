"""Gemma 4 (text) against transformers' Gemma4ForCausalLM on a tiny random config: sliding / full
layers with their own head dims, KV sharing (the last layers read an earlier layer's K/V),
per-layer embeddings, plain-weight q/k/v norms, proportional partial RoPE on the full layers,
layer scalars, final soft-cap; a variant with the MoE block and k = v on the full layers. (The
8-turn chat with reuse == cold, edits, regenerate and three conversations at once:
tests/test_family_reuse.py; batched == alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from ssm_family_checks import check_parity, fresh, perturb_vectors, run_chunks, save_and_load
from tiny import prompt
from turnkv.cache.snapshot import restore_snapshot, take_snapshot
from turnkv.cache.specs import FULL, SLIDING
from turnkv.models import ARCHITECTURES
from turnkv.models.gemma4 import Gemma4Model

VOCAB = 256
WINDOW = 16
TYPES = [SLIDING + "_attention", SLIDING + "_attention", FULL + "_attention"] * 2


def config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW, layer_types=TYPES,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
              final_logit_softcapping=30.0, max_position_embeddings=4096, initializer_range=0.1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Gemma4TextConfig(**kw)


def build(**overrides):
    """The tiny Gemma 4 with every vector nudged and the layer scalars off 1 (shared with
    tests/test_family_reuse.py and tests/test_batching.py)."""
    hf = Gemma4ForCausalLM(config(**overrides)).eval()
    perturb_vectors(hf)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return hf


def tiny(tmp_path, seed=0, **overrides):
    torch.manual_seed(seed)
    hf = build(**overrides)
    return save_and_load(hf, tmp_path), hf


def test_cache_specs_one_per_owning_layer(pair):
    model, hf = pair
    assert hf.config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    specs = model.cache_specs()
    # layers 4 (sliding) and 5 (full) read layers 3 and 2: four caches for six layers
    assert [s.kind for s in specs] == [SLIDING, SLIDING, FULL, SLIDING]
    assert (specs[0].heads, specs[0].head_dim, specs[0].window) == (2, 16, WINDOW)
    assert (specs[2].heads, specs[2].head_dim) == (2, 32)
    assert model.cache_of == [0, 1, 2, 3, 3, 2]


def test_shared_kv_snapshotted_restored_and_counted_once(pair):
    """The shared layers own no cache: a model snapshot holds four layer snapshots, its bytes are
    those of the four owning caches, and restoring it (once per owning cache) continues exactly
    like the cold run, through the shared layers too."""
    model, _ = pair
    tokens = prompt(80, seed=13)
    caches = fresh(model)
    run_chunks(model, caches, tokens[:50], 17)
    snap = take_snapshot(caches, "gemma4", "fp", ["native"] * len(caches))
    assert len(snap.layers) == 4
    assert snap.nbytes == sum(layer.nbytes for layer in snap.layers)
    # the full owning cache holds 50 positions in one 64-position pool block (a block is the unit
    # of memory and of the budget) x 2 heads x 32 dims x (k, v) float32, once
    assert snap.layers[2].nbytes == 64 * 2 * 32 * 2 * 4
    cold = run_chunks(model, caches, tokens[50:], 9)
    warm_caches = fresh(model)
    restore_snapshot(warm_caches, snap, 50, "gemma4", "fp", ["native"] * 4)
    warm = run_chunks(model, warm_caches, tokens[50:], 9)
    assert (warm - cold).abs().max().item() <= 1e-5


def test_prefill_without_logits_skips_the_shared_layers(pair):
    # a chunk that wants no logits returns None, and leaves the owning caches as a full run does
    model, _ = pair
    tokens = prompt(40, seed=17)
    a, b = fresh(model), fresh(model)
    with torch.no_grad():
        assert model.step(tokens[:30], a, "none") is None
        model.step(tokens[:30], b, "all")
        assert torch.allclose(model.step(tokens[30:], a, "last"), model.step(tokens[30:], b, "last"), atol=1e-6)


def test_variant_moe_k_eq_v_no_sharing_no_ple(tmp_path):
    # the 26B-A4B / 31B shape: MoE block beside the MLP, full layers with k = v and their own kv heads
    model, hf = tiny(tmp_path, seed=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                     num_kv_shared_layers=0, hidden_size_per_layer_input=0, final_logit_softcapping=None)
    specs = model.cache_specs()
    assert len(specs) == 6 and (specs[2].heads, specs[2].head_dim) == (1, 32)
    check_parity(model, hf, prompt(70, seed=9), chunk=11, decode=6)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_weight_formats_pack_and_run(pair, weights):
    """Not check_weight_format's tolerances: transformers' own bfloat16 run of this tiny model is
    already 15-26% of the logit scale off its float32 run (Gemma 4's unscaled normed q.k; measured
    with and without init 0.02, PLE, sharing, soft-cap), so only a coarse bound tells a packing bug
    (O(1)) from bfloat16 here. Every declared projection is packed (the 8-wide PLE projection
    included: torch's int8 kernel takes 16-multiples only) and prefill, chunked prefill and decode
    stay within that bound."""
    from turnkv.models.weights import PackedWeight, load_model
    from turnkv.cache.specs import make_caches

    model, hf = pair
    packed = load_model(Gemma4Model, hf.config.to_dict(), hf.state_dict(), torch.float32, weights)
    held = [getattr(m, n) for m in packed.modules() for n in Gemma4Model.packable_weights if hasattr(m, n)]
    assert held and all(isinstance(w, PackedWeight) for w in held)
    ids = prompt(40, seed=1)
    ref = run_chunks(model, fresh(model), ids, 40)
    for chunk in (40, 7, 1):
        got = run_chunks(packed, make_caches(packed.cache_specs()), ids, chunk)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 0.5 * ref.abs().max().item()


def test_conditional_generation_folder_loads_its_text_decoder(tmp_path):
    # the released checkpoints are Gemma4ForConditionalGeneration folders (model_type "gemma4",
    # weights under model.language_model.): turnkv serves their text decoder
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    assert ARCHITECTURES["gemma4"] == "gemma4:Gemma4Model"
    torch.manual_seed(4)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=config().to_dict(), vision_config=None,
                                                     audio_config=None)).eval()
    perturb_vectors(hf)
    model = save_and_load(hf, tmp_path)
    assert isinstance(model, Gemma4Model) and len(model.cache_specs()) == 4
    tokens = prompt(60, seed=19)
    with torch.no_grad():
        ref = hf(input_ids=tokens[None]).logits[0].float()
    got = run_chunks(model, fresh(model), tokens, 13)
    assert (got - ref).abs().max().item() < 1e-4


def test_per_layer_head_dims_as_transformers_resolves_them():
    # 12 layers: transformers writes per_layer_config keys zero-padded ("05"); older configs give
    # global_head_dim / num_global_key_value_heads instead (k_eq_v gates the kv-head override)
    from turnkv.models.gemma4 import ModelArgs

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    for kw in ({}, {"attention_k_eq_v": True, "num_global_key_value_heads": 1}):
        cfg = config(num_hidden_layers=12, layer_types=types, num_kv_shared_layers=4, **kw)
        saved = cfg.to_dict()
        assert "05" in saved["per_layer_config"]
        legacy = {k: v for k, v in saved.items() if k != "per_layer_config"} | {"global_head_dim": 32, **kw}
        for d in (saved, legacy):
            args = ModelArgs.from_dict(d)
            assert args.head_dims == [cfg.per_layer_config[i].head_dim for i in range(12)]
            assert args.kv_heads == [cfg.per_layer_config[i].num_key_value_heads for i in range(12)]
            assert args.producer[8:] == [7, 7, 7, 5]   # layers 8-10 read layer 7's K/V, layer 11 layer 5's
