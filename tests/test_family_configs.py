"""Configs beyond the tests' defaults: for each family, Hypothesis draws 25 valid configurations
from transformers' own config class (the fields real checkpoints vary) and turnkv must equal
transformers on each (a short prompt in one chunk, in chunks and decoded), or refuse at load a
config that sets a field it does not implement, naming the field. Draws are derandomized
(the same on every run); the strategies and the check: tests/config_draws.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, VOCAB, Drawn, check_drawn, heads, rope
from ssm_family_checks import perturb_vectors

# a field turnkv's Llama does not implement, set to a value that changes the computation
LLAMA_REFUSED = {"hidden_act": "gelu", "rope_type": "dynamic"}


@st.composite
def llama_configs(draw):
    kw = dict(vocab_size=VOCAB, num_hidden_layers=draw(st.sampled_from([2, 3])),
              intermediate_size=draw(st.sampled_from([32, 48, 96])), max_position_embeddings=256,
              attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
              tie_word_embeddings=draw(st.booleans()), rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
              initializer_range=0.1, **draw(heads()))
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse = draw(st.sampled_from([None] * 4 + sorted(LLAMA_REFUSED)))
    if refuse == "rope_type":
        kw["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0}
    elif refuse is not None:
        kw[refuse] = LLAMA_REFUSED[refuse]
    drawn.refused = refuse
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
    kw = dict(vocab_size=VOCAB, num_hidden_layers=draw(st.sampled_from([2, 3])), intermediate_size=48,
              moe_intermediate_size=draw(st.sampled_from([16, 32])), n_routed_experts=experts, n_group=groups,
              topk_group=kept, num_experts_per_tok=top_k,
              n_shared_experts=draw(st.sampled_from([1, 2])), first_k_dense_replace=draw(st.sampled_from([0, 1])),
              norm_topk_prob=draw(st.booleans()), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
              use_qk_norm=draw(st.booleans()), attention_bias=draw(st.booleans()),
              tie_word_embeddings=draw(st.booleans()), max_position_embeddings=256, initializer_range=0.1,
              **draw(heads()))
    params = draw(rope())
    params["partial_rotary_factor"] = draw(st.sampled_from([0.5, 1.0]))
    kw["rope_parameters"] = params
    drawn = Drawn(kw)
    if draw(st.integers(0, 5)) == 0:
        kw["hidden_act"], drawn.refused = "gelu", "hidden_act"
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
    layers = draw(st.sampled_from([2, 3]))
    window = draw(st.sampled_from([4, 8, 16]))    # transformers' Ministral always builds a window mask
    kw = dict(vocab_size=VOCAB, num_hidden_layers=layers, intermediate_size=draw(st.sampled_from([32, 64])),
              sliding_window=window, tie_word_embeddings=draw(st.booleans()), max_position_embeddings=256,
              initializer_range=0.1, **draw(heads()))
    if draw(st.booleans()):
        kw["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                          min_size=layers, max_size=layers))
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    if draw(st.integers(0, 5)) == 0:
        kw["hidden_act"], drawn.refused = "gelu", "hidden_act"
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
    layers = draw(st.sampled_from([2, 3]))
    window = draw(st.sampled_from([4, 8]))
    kw = dict(vocab_size=VOCAB, num_hidden_layers=layers, intermediate_size=draw(st.sampled_from([32, 64])),
              sliding_window=window, sliding_window_pattern=draw(st.sampled_from([2, 3])),
              tie_word_embeddings=draw(st.booleans()), max_position_embeddings=256, initializer_range=0.1,
              **draw(heads()))
    if draw(st.booleans()):
        kw["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                          min_size=layers, max_size=layers))
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    if draw(st.integers(0, 5)) == 0:
        kw["hidden_act"], drawn.refused = "gelu", "hidden_act"
    return drawn


@DRAWS
@given(exaone4_configs())
def test_exaone4_configs(drawn):
    from transformers import Exaone4Config, Exaone4ForCausalLM

    check_drawn(lambda **kw: Exaone4ForCausalLM(Exaone4Config(**kw)), drawn)


@st.composite
def gpt_oss_configs(draw):
    """gpt-oss: experts and top-k, the window and layer types, the SwiGLU clamp, sinks (perturbed)."""
    layers = draw(st.sampled_from([2, 3]))
    experts = draw(st.sampled_from([2, 4, 8]))
    kw = dict(vocab_size=VOCAB, num_hidden_layers=layers, intermediate_size=draw(st.sampled_from([32, 64])),
              num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, min(4, experts))),
              sliding_window=draw(st.sampled_from([4, 8, 16])), swiglu_limit=draw(st.sampled_from([7.0, 0.5])),
              tie_word_embeddings=draw(st.booleans()), max_position_embeddings=256, initializer_range=0.1,
              **draw(heads()))
    if draw(st.booleans()):
        kw["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                          min_size=layers, max_size=layers))
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


@st.composite
def qwen_configs(draw):
    """Qwen 2 (q/k/v biases) and Qwen 3 (q/k norms) on the Llama family; a window they switch on
    (use_sliding_window) is refused."""
    kind = draw(st.sampled_from(["qwen2", "qwen3"]))
    kw = dict(vocab_size=VOCAB, num_hidden_layers=draw(st.sampled_from([2, 3])),
              intermediate_size=draw(st.sampled_from([32, 64])), tie_word_embeddings=draw(st.booleans()),
              max_position_embeddings=256, initializer_range=0.1, **draw(heads()))
    if kind == "qwen2":
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]    # Qwen 2 has no head_dim apart
    else:
        kw["attention_bias"] = draw(st.booleans())
    kw["rope_parameters"] = draw(rope())
    drawn = Drawn(dict(kw, kind=kind), old_layout=draw(st.booleans()))
    if draw(st.integers(0, 5)) == 0:
        drawn.kwargs.update(use_sliding_window=True, sliding_window=8)
        drawn.refused = "use_sliding_window"
    return drawn


def qwen_hf(kind, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    return model(config(**kw))


@DRAWS
@given(qwen_configs())
def test_qwen_configs(drawn):
    check_drawn(qwen_hf, drawn)
