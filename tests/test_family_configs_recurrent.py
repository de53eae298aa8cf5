"""Configs beyond the tests' defaults, for the families with a recurrent or convolutional mixer
(LFM2, Mamba 2, Granite 4 hybrid, RecurrentGemma, Qwen3-Next, Qwen 3.5, Kimi Linear, Bailing
hybrid): 25 configurations drawn from transformers' own config class per family, each equal to
transformers or refused at load naming the field turnkv does not implement
(tests/config_draws.py). Prompts cross the SSD chunk sizes drawn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, Drawn, check_drawn, common, layer_types, refuse, rope


@st.composite
def lfm2_configs(draw):
    """LFM2: which layers attend (full_attn_idxs, or the layer types transformers 5 writes), the
    conv cache length and bias, the feed-forward width rule, norm eps, RoPE kinds."""
    kw = draw(common(layers=(2, 3, 4), head_dim=None))
    del kw["head_dim"]      # LFM2 has none apart from hidden / heads
    n = kw["num_hidden_layers"]
    attn = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    kw.update(full_attn_idxs=sorted(attn), conv_L_cache=draw(st.sampled_from([2, 3, 4])), conv_bias=draw(st.booleans()),
              block_multiple_of=draw(st.sampled_from([8, 16])), block_auto_adjust_ff_dim=draw(st.booleans()),
              block_ffn_dim_multiplier=draw(st.sampled_from([1.0, 1.5])), norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
              rope_parameters=draw(rope()))
    return Drawn(kw, old_layout=draw(st.booleans()))


@DRAWS
@given(lfm2_configs())
def test_lfm2_configs(drawn):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    check_drawn(lambda **kw: Lfm2ForCausalLM(Lfm2Config(**kw)), drawn)


@st.composite
def mamba2_dims(draw, prefix="", names=("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel",
                                         "chunk_size", "expand")):
    """An SSD mixer's sizes under ``names`` (Mamba 2's, or Granite's mamba_* ones): heads x head
    dim = expand x hidden, groups dividing the heads, chunks shorter than the prompt."""
    hidden = draw(st.sampled_from([32, 64]))
    expand = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([2, 4, 8]))
    values = (heads, expand * hidden // heads, draw(st.sampled_from([8, 16])),
              draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])), draw(st.sampled_from([2, 4])),
              draw(st.sampled_from([4, 8, 16])), expand)
    return dict(hidden_size=hidden, **{prefix + k: v for k, v in zip(names, values)})


@st.composite
def mamba2_configs(draw):
    """Mamba 2: the SSD sizes, biases, the residual in float32, the time-step clamp."""
    kw = dict(vocab_size=128, num_hidden_layers=draw(st.sampled_from([1, 2, 3])), initializer_range=0.1,
              use_bias=draw(st.booleans()), use_conv_bias=draw(st.booleans()),
              residual_in_fp32=draw(st.booleans()), tie_word_embeddings=draw(st.booleans()),
              time_step_limit=draw(st.sampled_from([(0.0, float("inf")), (0.01, 0.1)])), **draw(mamba2_dims()))
    drawn = Drawn(kw)
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(mamba2_configs())
def test_mamba2_configs(drawn):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    check_drawn(lambda **kw: Mamba2ForCausalLM(Mamba2Config(**kw)), drawn)


@st.composite
def granitemoehybrid_configs(draw):
    """Granite 4 hybrid: mamba / attention layer types, the SSD sizes and biases, routed experts
    (none: the shared MLP alone) and top-k, the four muP multipliers, RoPE or NoPE, biases."""
    dims = draw(mamba2_dims("mamba_", ("n_heads", "d_head", "d_state", "n_groups", "d_conv", "chunk_size", "expand")))
    kw = draw(common(layers=(2, 3), intermediate=(16, 32), hidden=(dims["hidden_size"],), head_dim=None))
    del kw["head_dim"]
    kw.update(dims)
    experts = draw(st.sampled_from([0, 2, 4]))
    kw.update(layer_types=layer_types(draw, kw["num_hidden_layers"], ("mamba", "attention")),
              shared_intermediate_size=draw(st.sampled_from([16, 48])), num_local_experts=experts,
              num_experts_per_tok=draw(st.integers(1, max(experts, 1))),
              embedding_multiplier=draw(st.sampled_from([1.0, 6.0])), residual_multiplier=draw(st.sampled_from([1.0, 0.5])),
              attention_multiplier=draw(st.sampled_from([0.125, 0.25])), logits_scaling=draw(st.sampled_from([1.0, 2.0])),
              position_embedding_type=draw(st.sampled_from(["rope", "nope"])), attention_bias=draw(st.booleans()),
              mamba_proj_bias=draw(st.booleans()), mamba_conv_bias=draw(st.booleans()), rope_parameters=draw(rope()))
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(granitemoehybrid_configs())
def test_granitemoehybrid_configs(drawn):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    check_drawn(lambda **kw: GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**kw)), drawn)


@st.composite
def recurrent_gemma_configs(draw):
    """RecurrentGemma: the block pattern, the RG-LRU width, conv width, attention window, logit
    soft-cap, kv heads, partial rotation and theta, biases."""
    kw = draw(common(head_dim=None))
    del kw["head_dim"]
    kw.update(block_types=draw(st.lists(st.sampled_from(["recurrent", "attention"]), min_size=1, max_size=3)),
              lru_width=draw(st.sampled_from([None, 2 * kw["hidden_size"]])), conv1d_width=draw(st.sampled_from([2, 4])),
              attention_window_size=draw(st.sampled_from([4, 8])), logits_soft_cap=draw(st.sampled_from([5.0, 30.0])),
              attention_bias=draw(st.booleans()), attn_implementation="eager",
              rope_parameters={"rope_type": "default", "rope_theta": draw(st.sampled_from([1e4, 5e4])),
                               "partial_rotary_factor": draw(st.sampled_from([0.5, 1.0]))})
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_activation": "gelu"})
    return drawn


@DRAWS
@given(recurrent_gemma_configs())
def test_recurrent_gemma_configs(drawn):
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    check_drawn(lambda **kw: RecurrentGemmaForCausalLM(RecurrentGemmaConfig(**kw)), drawn)
