"""Configs beyond the tests' defaults: for each family, Hypothesis draws 25 valid configurations
from transformers' own config class (the fields real checkpoints vary) and turnkv must equal
transformers on each (a short prompt in one chunk, in chunks and decoded), or refuse at load a
config that sets a field it does not implement, naming the field. Draws are derandomized
(the same on every run); the strategies and the check: tests/config_draws.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, Drawn, check_drawn, common, layer_types, refuse, rope
from ssm_family_checks import perturb_vectors


def dynamic_rope(kw):
    kw["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0}
    return "rope_type"


@st.composite
def llama_configs(draw):
    kw = draw(common(intermediate=(32, 48, 96)))
    kw.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
              rope_parameters=draw(rope()))
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    # a field turnkv's Llama does not implement, set to a value that changes the computation
    refuse(draw, drawn, {"hidden_act": "gelu", "rope_type": dynamic_rope}, odds=3)
    return drawn


@DRAWS
@given(llama_configs())
def test_llama_configs(drawn):
    from transformers import LlamaConfig, LlamaForCausalLM

    check_drawn(lambda **kw: LlamaForCausalLM(LlamaConfig(**kw)), drawn)


@st.composite
def glm4_moe_configs(draw):
    experts = draw(st.sampled_from([4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2]))
    kept = draw(st.integers(1, groups))         # topk_group: the routing picks within these groups
    top_k = draw(st.integers(1, min(4, experts // groups * kept)))
    kw = draw(common(intermediate=(48,)))
    kw.update(moe_intermediate_size=draw(st.sampled_from([16, 32])), n_routed_experts=experts, n_group=groups,
              topk_group=kept, num_experts_per_tok=top_k,
              n_shared_experts=draw(st.sampled_from([1, 2])), first_k_dense_replace=draw(st.sampled_from([0, 1])),
              norm_topk_prob=draw(st.booleans()), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
              use_qk_norm=draw(st.booleans()), attention_bias=draw(st.booleans()))
    params = draw(rope())
    params["partial_rotary_factor"] = draw(st.sampled_from([0.5, 1.0]))
    kw["rope_parameters"] = params
    drawn = Drawn(kw)
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


def glm4_moe_hf(**kw):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    hf = Glm4MoeForCausalLM(Glm4MoeConfig(**kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # a buffer perturb_vectors does not reach: the routing depends on it
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(kw["n_routed_experts"], generator=g))
    return hf


@DRAWS
@given(glm4_moe_configs())
def test_glm4_moe_configs(drawn):
    check_drawn(glm4_moe_hf, drawn)


@st.composite
def ministral_configs(draw):
    """Ministral: a window on the layers ``layer_types`` picks (every layer by default), short
    enough for the prompt to cross it."""
    # transformers' Ministral always builds a window mask
    kw = draw(common(intermediate=(32, 64), sliding_window=draw(st.sampled_from([4, 8, 16]))))
    if draw(st.booleans()):
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"])
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(ministral_configs())
def test_ministral_configs(drawn):
    from transformers import MinistralConfig, MinistralForCausalLM

    check_drawn(lambda **kw: MinistralForCausalLM(MinistralConfig(**kw)), drawn)


@st.composite
def exaone4_configs(draw):
    """EXAONE 4: the window and its pattern or explicit layer types (transformers 5's config class
    builds no layer types for a "LLG" string pattern or without a window)."""
    kw = draw(common(intermediate=(32, 64), sliding_window=draw(st.sampled_from([4, 8])),
                     sliding_window_pattern=draw(st.sampled_from([2, 3]))))
    if draw(st.booleans()):
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"])
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(exaone4_configs())
def test_exaone4_configs(drawn):
    from transformers import Exaone4Config, Exaone4ForCausalLM

    check_drawn(lambda **kw: Exaone4ForCausalLM(Exaone4Config(**kw)), drawn)


@st.composite
def gpt_oss_configs(draw):
    """gpt-oss: experts and top-k, the window and layer types, the SwiGLU clamp and alpha, attention
    biases, sinks (perturbed)."""
    experts = draw(st.sampled_from([2, 4, 8]))
    kw = draw(common(intermediate=(32, 64)))
    kw.update(num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, min(4, experts))),
              sliding_window=draw(st.sampled_from([4, 8, 16])), swiglu_limit=draw(st.sampled_from([7.0, 0.5])),
              swiglu_alpha=draw(st.sampled_from([1.702, 1.0])), attention_bias=draw(st.booleans()))
    if draw(st.booleans()):
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"])
    kw["rope_parameters"] = draw(rope(("default", "yarn")))
    return Drawn(kw)


def gpt_oss_hf(**kw):
    from transformers import GptOssConfig, GptOssForCausalLM

    hf = GptOssForCausalLM(GptOssConfig(**kw))
    perturb_vectors(hf, seed=2, scale=0.5)   # sinks and router biases: the sinks must matter
    return hf


@DRAWS
@given(gpt_oss_configs())
def test_gpt_oss_configs(drawn):
    check_drawn(gpt_oss_hf, drawn)


def qwen_window(draw, kw: dict) -> None:
    """Qwen's window: off (a window size the switch leaves unused, as the released configs have)
    or on (use_sliding_window), short enough for the prompt to cross it."""
    on = draw(st.booleans())
    kw.update(use_sliding_window=on, sliding_window=draw(st.sampled_from([4, 8])) if on else 4096)


@st.composite
def qwen_configs(draw):
    """Qwen 2 (q/k/v biases) and Qwen 3 (q/k norms) on the Llama family, with the window on the
    layers from max_window_layers on, or on the layers explicit layer types name."""
    kind = draw(st.sampled_from(["qwen2", "qwen3"]))
    kw = draw(common(intermediate=(32, 64)))
    if kind == "qwen2":
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]    # Qwen 2 has no head_dim apart
    else:
        kw["attention_bias"] = draw(st.booleans())
    kw["rope_parameters"] = draw(rope())
    qwen_window(draw, kw)
    kw["max_window_layers"] = draw(st.integers(0, kw["num_hidden_layers"]))
    if kw["use_sliding_window"] and draw(st.booleans()):   # (sliding types without it fail in transformers)
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"])
    return Drawn(dict(kw, kind=kind), old_layout=draw(st.booleans()))


def qwen_hf(kind, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    return model(config(**kw))


@DRAWS
@given(qwen_configs())
def test_qwen_configs(drawn):
    check_drawn(qwen_hf, drawn)


@st.composite
def qwen3_moe_configs(draw):
    """Qwen 3 MoE: experts and top-k, renormalized or not, dense layers among them
    (decoder_sparse_step, mlp_only_layers), Qwen 3's attention options, the window (on every
    layer); the transformers 4 layout names the expert count num_experts."""
    kw = draw(common(intermediate=(32, 48)))
    experts = draw(st.sampled_from([2, 4, 8]))
    kw.update(num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(4, experts))),
              moe_intermediate_size=draw(st.sampled_from([16, 32])), norm_topk_prob=draw(st.booleans()),
              decoder_sparse_step=draw(st.sampled_from([1, 2])), attention_bias=draw(st.booleans()),
              mlp_only_layers=draw(st.lists(st.integers(0, kw["num_hidden_layers"] - 1), unique=True, max_size=1)),
              rope_parameters=draw(rope()))
    qwen_window(draw, kw)
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


def qwen3_moe_hf(**kw):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # transformers zero-inits the routers
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.3, generator=g)
    return hf


@DRAWS
@given(qwen3_moe_configs())
def test_qwen3_moe_configs(drawn):
    check_drawn(qwen3_moe_hf, drawn)
