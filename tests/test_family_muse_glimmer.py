"""Muse Glimmer against transformers' MuseGlimmerForConditionalGeneration (its text path: there is
no text-only CausalLM) on a tiny random config: sliding RoPE layers and a full NoPE layer, the
weightless QK-norm with the query multiplier, the sigmoid output gate, Gemma 2's (1 + w) pre/post
norms, the normed embeddings and the scaled, soft-capped logits. (The 8-turn chat with reuse ==
cold, edits, regenerate and three conversations at once: tests/test_family_reuse.py; batched ==
alone: tests/test_batching.py.)
The contract every family keeps (parity, greedy, restore rule, KV modes, weight formats):
tests/test_family_contract.py; here, what is this family's own."""

from functools import partial

import torch
from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

from ssm_family_checks import check_parity, fresh, hf_logits, perturb_vectors, save_and_load
from tiny import prompt as random_tokens
from turnkv.cache.specs import FULL, SLIDING

VOCAB = 256
WINDOW = 16
IMAGE_TOKEN = 250
prompt = partial(random_tokens, vocab=IMAGE_TOKEN)


def build(text=None, **outer):
    """The tiny Muse Glimmer (a one-layer vision tower it never runs), every vector nudged
    (shared with tests/test_family_reuse.py and tests/test_batching.py)."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(text or {})
    vision = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=48, num_attention_heads=2)
    cfg = MuseGlimmerConfig(text_config=kw, vision_config=vision, out_hidden_size=128, projector_hidden_size=64,
                            image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, **outer)
    hf = MuseGlimmerForConditionalGeneration(cfg).eval()
    perturb_vectors(hf)
    return hf


def tiny(tmp_path, seed=0, outer=None, **text):
    torch.manual_seed(seed)
    hf = build(text, **(outer or {}))
    return save_and_load(hf, tmp_path), hf


def test_cache_specs_sliding_rope_full_nope(pair):
    model, hf = pair
    assert hf.config.text_config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    specs = model.cache_specs()
    assert [s.kind for s in specs] == [SLIDING, SLIDING, SLIDING, FULL]
    assert specs[0].window == WINDOW and (specs[0].heads, specs[0].head_dim) == (2, 16)
    assert [layer.attn.rotate for layer in model.layers] == [True, True, True, False]


def test_image_placeholder_without_image_embeds_as_token_0(pair):
    # the text path of transformers' model embeds image / video placeholders as token 0
    model, hf = pair
    tokens = prompt(40, seed=6)
    tokens[[5, 17]] = torch.tensor([IMAGE_TOKEN, IMAGE_TOKEN + 1])
    with torch.no_grad():
        ours = model.step(tokens, fresh(model), logits="all")
    assert (ours - hf_logits(hf, tokens)).abs().max().item() < 1e-4


def test_variant_rotated_full_layer_biases_gelu_tied(tmp_path):
    # layer_rope_theta decides RoPE (here the full layer rotates and a sliding one does not),
    # biased q/k/v/o, the tanh GELU, another multiplier and cap, and embeddings tied by the outer
    # config's flag (transformers ignores text_config's, which says the opposite here)
    model, hf = tiny(tmp_path, seed=1, outer=dict(tie_word_embeddings=True),
                     layer_rope_theta=[10000.0, 0, 10000.0, 10000.0], attention_bias=True,
                     hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False, qk_scale_factor=2.0,
                     output_multiplier=0.5, final_logit_softcapping=10.0)
    assert [layer.attn.rotate for layer in model.layers] == [True, False, True, True]
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    assert model.lm_head is model.embed
    check_parity(model, hf, prompt(60, seed=9), chunk=13, decode=6)


def test_text_config_tie_flag_alone_does_not_tie(tmp_path):
    model, hf = tiny(tmp_path, seed=2, tie_word_embeddings=True)
    assert hf.lm_head.weight is not hf.model.language_model.embed_tokens.weight
    assert model.lm_head is not model.embed
    check_parity(model, hf, prompt(60, seed=9), chunk=13, decode=6)


def calm(tmp_path):
    # At the family's qk_scale_factor 3.87 (unit-normed q and k, so scores up to ~15 at head dim 16)
    # the random tiny model's attention is so sharp that transformers' own bfloat16 run is 11% of
    # the logit scale off its float32 run; at 1.0 (init 0.05) it is 2.3%, and the formats are held
    # to the usual tolerances.
    return tiny(tmp_path, qk_scale_factor=1.0, initializer_range=0.05)


