"""Configs beyond the tests' defaults, for the families with sliding-window / per-layer-type
attention (Gemma 3 and 4, Ministral 3, Llama 4, AFMoE, Muse Glimmer): 25 configurations drawn from
transformers' own config class per family, each equal to transformers or refused at load naming
the field turnkv does not implement (tests/config_draws.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, Drawn, check_drawn, common, layer_types, refuse, rope

SLIDING, FULL = "sliding_attention", "full_attention"


@st.composite
def gemma3_configs(draw):
    """Gemma 3: query_pre_attn_scalar, the window and the layer types (any, or every n-th layer
    global: the transformers 4 layout then has only sliding_window_pattern), soft-caps, a RoPE per
    layer type (scaled on the global layers only, as the released 4B-27B are)."""
    kw = draw(common())
    layers = kw["num_hidden_layers"]
    pattern = draw(st.sampled_from([None, 2, 3]))     # None: any layer types
    types = (layer_types(draw, layers) if pattern is None else
             [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)])
    kw.update(query_pre_attn_scalar=draw(st.sampled_from([kw["head_dim"], 24, 256])),
              sliding_window=draw(st.sampled_from([4, 8])), layer_types=types,
              final_logit_softcapping=draw(st.sampled_from([None, 3.0])),
              attn_logit_softcapping=draw(st.sampled_from([None, 2.0])))
    kw["rope_parameters"] = {FULL: draw(rope()),
                             SLIDING: {"rope_type": "default", "rope_theta": draw(st.sampled_from([1e4, 5e4]))}}
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"attention_bias": True, "hidden_activation": "gelu", "use_bidirectional_attention": True})
    return drawn


@DRAWS
@given(gemma3_configs())
def test_gemma3_configs(drawn):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    check_drawn(lambda **kw: Gemma3ForCausalLM(Gemma3TextConfig(**kw)), drawn)


@st.composite
def ministral3_configs(draw):
    """Ministral 3 (a transformers 5 model type): one window on every layer or none, any RoPE kind
    with Llama 4's query scaling by position over a short original context (transformers reads
    both fields on every config; a 0 beta scales by 1)."""
    kw = draw(common(sliding_window=draw(st.sampled_from([None, 4, 8]))))
    params = draw(rope())
    params.setdefault("original_max_position_embeddings", draw(st.sampled_from([8, 16])))
    params["llama_4_scaling_beta"] = draw(st.sampled_from([0.0, 0.1, 0.5]))
    kw["rope_parameters"] = params
    drawn = Drawn(kw)
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(ministral3_configs())
def test_ministral3_configs(drawn):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    check_drawn(lambda **kw: Ministral3ForCausalLM(Ministral3Config(**kw)), drawn)


@st.composite
def llama4_configs(draw):
    """Llama 4: experts and top-k, which layers are MoE and which are NoPE (by interval or as
    explicit lists), the chunk, QK-norm, attention temperature tuning (a small floor so it changes
    within the prompt), biases."""
    kw = draw(common(intermediate=(16, 32), head_dim=None))
    kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    experts = draw(st.sampled_from([2, 4]))
    kw.update(intermediate_size_mlp=draw(st.sampled_from([32, 64])), num_local_experts=experts,
              num_experts_per_tok=draw(st.integers(1, experts)),
              interleave_moe_layer_step=draw(st.sampled_from([1, 2])),
              no_rope_layer_interval=draw(st.sampled_from([2, 4])), attention_chunk_size=draw(st.sampled_from([4, 8])),
              use_qk_norm=draw(st.booleans()), attn_temperature_tuning=draw(st.booleans()),
              floor_scale=draw(st.sampled_from([4, 8])), attn_scale=draw(st.sampled_from([0.1, 0.5])),
              attention_bias=draw(st.booleans()), rope_parameters=draw(rope(("default", "llama3"))))
    n = kw["num_hidden_layers"]
    if draw(st.booleans()):
        kw["moe_layers"] = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    if draw(st.booleans()):     # 1 = the layer rotates
        kw["no_rope_layers"] = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(llama4_configs())
def test_llama4_configs(drawn):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    check_drawn(lambda **kw: Llama4ForCausalLM(Llama4TextConfig(**kw)), drawn)


@st.composite
def afmoe_configs(draw):
    """AFMoE: dense layers first, experts / top-k / shared experts / route scale, the window and
    the global-layer interval or explicit layer types, muP embedding scale, biases."""
    kw = draw(common(layers=(2, 3, 4)))
    experts = draw(st.sampled_from([4, 8]))
    kw.update(moe_intermediate_size=draw(st.sampled_from([16, 32])),
              num_dense_layers=draw(st.sampled_from([0, 1])), num_experts=experts,
              num_experts_per_tok=draw(st.integers(1, 4)), num_shared_experts=draw(st.sampled_from([0, 1, 2])),
              route_scale=draw(st.sampled_from([1.0, 2.5])), sliding_window=draw(st.sampled_from([4, 8])),
              global_attn_every_n_layers=draw(st.sampled_from([2, 3])), mup_enabled=draw(st.booleans()),
              attention_bias=draw(st.booleans()), rope_parameters=draw(rope()))
    if draw(st.booleans()):
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"])
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


def afmoe_hf(**kw):
    import torch
    from transformers import AfmoeConfig, AfmoeForCausalLM

    hf = AfmoeForCausalLM(AfmoeConfig(**kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # transformers zero-inits the router: give it values
        for layer in hf.model.layers[kw["num_dense_layers"]:]:
            layer.mlp.router.gate.weight.normal_(0.0, 0.3, generator=g)
    return hf


@DRAWS
@given(afmoe_configs())
def test_afmoe_configs(drawn):
    check_drawn(afmoe_hf, drawn)


@st.composite
def gemma4_configs(draw):
    """Gemma 4: layer types (the last forced global), window, the global layers' head dim and
    k = v with their own kv heads, KV sharing and the double-wide MLP of the sharing layers,
    per-layer inputs, the MoE block, the soft-cap, a RoPE per layer type (proportional partial
    rotation on the global layers as released, or another kind)."""
    kw = draw(common(layers=(2, 3, 4)))
    n = kw["num_hidden_layers"]
    types = layer_types(draw, n)
    shared = draw(st.integers(0, n - 1))
    if shared and not all(t in types[:n - shared] for t in types[n - shared:-1] + [FULL]):
        shared = 0    # a sharing layer needs an earlier owner of its type
    kw.update(layer_types=types, sliding_window=draw(st.sampled_from([4, 8])),
              global_head_dim=draw(st.sampled_from([kw["head_dim"], 32])), num_kv_shared_layers=shared,
              use_double_wide_mlp=draw(st.booleans()), vocab_size_per_layer_input=kw["vocab_size"],
              hidden_size_per_layer_input=draw(st.sampled_from([0, 8])),
              final_logit_softcapping=draw(st.sampled_from([None, 3.0])), attention_bias=draw(st.booleans()))
    if draw(st.booleans()):
        kw.update(attention_k_eq_v=True, num_global_key_value_heads=draw(st.sampled_from([1, 2])))
    if draw(st.booleans()):
        kw.update(enable_moe_block=True, num_experts=4, top_k_experts=draw(st.integers(1, 4)),
                  moe_intermediate_size=16)
    full = draw(st.sampled_from(["proportional", "default", "linear"]))
    full = ({"rope_type": "proportional", "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5])),
             "rope_theta": 1e6} if full == "proportional" else draw(rope((full,))))
    kw["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    kw["use_bidirectional_attention"] = draw(st.sampled_from([None, "vision"]))     # images only: text stays causal
    drawn = Drawn(kw)
    refuse(draw, drawn, {"hidden_activation": "gelu", "use_bidirectional_attention": "all"})
    return drawn


def gemma4_hf(**kw):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    hf = Gemma4ForCausalLM(Gemma4TextConfig(**kw))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # the layer scalars start at 1
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return hf


@DRAWS
@given(gemma4_configs())
def test_gemma4_configs(drawn):
    check_drawn(gemma4_hf, drawn)


@st.composite
def muse_glimmer_configs(draw):
    """Muse Glimmer's text decoder (in its vision-language folder): window and layer types, which
    layers rotate (layer_rope_theta, 0 = NoPE), biases, the activation, the q/k scale, output
    multiplier and soft-cap, the post-norm eps, and ties by the outer config's flag."""
    text = draw(common(layers=(2, 3, 4)))
    n = text["num_hidden_layers"]
    text.update(sliding_window=draw(st.sampled_from([4, 8])), attention_bias=draw(st.booleans()),
                hidden_activation=draw(st.sampled_from(["silu", "gelu_pytorch_tanh"])),
                qk_scale_factor=draw(st.sampled_from([1.0, 2.0])), output_multiplier=draw(st.sampled_from([0.2, 0.5])),
                final_logit_softcapping=draw(st.sampled_from([5.0, 20.0])),
                post_norm_eps=draw(st.sampled_from([1e-8, 1e-5])), rope_parameters=draw(rope()))
    if draw(st.booleans()):
        text["layer_types"] = layer_types(draw, n)
    if draw(st.booleans()):
        theta = text["rope_parameters"]["rope_theta"]
        text["layer_rope_theta"] = draw(st.lists(st.sampled_from([0, theta]), min_size=n, max_size=n))
    drawn = Drawn(dict(text=text, tie_word_embeddings=draw(st.booleans())))

    def gelu(kw):
        kw["text"]["hidden_activation"] = "gelu"
    refuse(draw, drawn, {"hidden_activation": gelu})
    return drawn


def muse_glimmer_hf(text, tie_word_embeddings):
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    vocab = text["vocab_size"]
    vision = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=48, num_attention_heads=2)
    return MuseGlimmerForConditionalGeneration(MuseGlimmerConfig(
        text_config=text, vision_config=vision, out_hidden_size=64, projector_hidden_size=32,
        image_token_id=vocab + 2, video_token_id=vocab + 3, tie_word_embeddings=tie_word_embeddings))


@DRAWS
@given(muse_glimmer_configs())
def test_muse_glimmer_configs(drawn):
    check_drawn(muse_glimmer_hf, drawn)
