"""Configs beyond the tests' defaults, for the families with a recurrent or convolutional mixer
(LFM2, Mamba 2, Granite 4 hybrid, RecurrentGemma, Qwen3-Next, Qwen 3.5, Kimi Linear, Bailing
hybrid): 25 configurations drawn from transformers' own config class per family, each equal to
transformers or refused at load naming the field turnkv does not implement
(tests/config_draws.py). Prompts cross the SSD chunk sizes drawn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, EPS, Drawn, check_drawn, common, layer_types, refuse, rope


@st.composite
def lfm2_configs(draw):
    """LFM2: which layers attend (full_attn_idxs, or the layer types transformers 5 writes), the
    conv cache length and bias, the feed-forward width rule, norm eps, RoPE kinds."""
    kw = draw(common(layers=(2, 3, 4), head_dim=None))
    del kw["head_dim"], kw["rms_norm_eps"]     # LFM2 has no head_dim apart from hidden / heads
    n = kw["num_hidden_layers"]
    attn = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    kw.update(full_attn_idxs=sorted(attn), conv_L_cache=draw(st.sampled_from([2, 3, 4])), conv_bias=draw(st.booleans()),
              block_multiple_of=draw(st.sampled_from([8, 16])), block_auto_adjust_ff_dim=draw(st.booleans()),
              block_ffn_dim_multiplier=draw(st.sampled_from([1.0, 1.5])), norm_eps=draw(st.sampled_from(EPS)),
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
    """Mamba 2: the SSD sizes, biases, the residual in float32, the time-step clamp, norm eps."""
    kw = dict(vocab_size=128, num_hidden_layers=draw(st.sampled_from([1, 2, 3])), initializer_range=0.1,
              use_bias=draw(st.booleans()), use_conv_bias=draw(st.booleans()),
              residual_in_fp32=draw(st.booleans()), tie_word_embeddings=draw(st.booleans()),
              layer_norm_epsilon=draw(st.sampled_from(EPS)),
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
    (none: the shared MLP alone) and top-k, the four muP multipliers, RoPE or NoPE, biases, the
    time-step clamp."""
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
              mamba_proj_bias=draw(st.booleans()), mamba_conv_bias=draw(st.booleans()), rope_parameters=draw(rope()),
              time_step_limit=draw(st.sampled_from([(0.0, float("inf")), (0.01, 0.1)])))
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


@st.composite
def delta_net(draw, layers=(2, 3)):
    """The attention sizes (head_dim apart from hidden / heads) and a gated delta-net's (key heads,
    value heads a multiple of them, head dims, conv kernel), the linear / full layer types, the
    partial rotation: what Qwen3-Next and Qwen 3.5 share."""
    kw = draw(common(layers=layers))
    kw.update(linear_num_key_heads=draw(st.sampled_from([1, 2])), linear_key_head_dim=draw(st.sampled_from([8, 16])),
              linear_value_head_dim=draw(st.sampled_from([8, 16])), linear_conv_kernel_dim=draw(st.sampled_from([2, 4])),
              attention_bias=draw(st.booleans()),
              layer_types=layer_types(draw, kw["num_hidden_layers"], ("linear_attention", "full_attention")))
    kw["linear_num_value_heads"] = kw["linear_num_key_heads"] * draw(st.sampled_from([1, 2]))
    params = draw(rope())
    params["partial_rotary_factor"] = draw(st.sampled_from([0.25, 0.5, 1.0]))
    kw["rope_parameters"] = params
    return kw


def experts(draw, kw: dict, names=("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "shared_expert_intermediate_size")) -> None:
    """Routed experts, top-k, their width and the shared expert's, into ``kw``."""
    n = draw(st.sampled_from([2, 4, 6]))
    kw.update(zip(names, (n, draw(st.integers(1, n)), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 48])))))


@st.composite
def qwen3_next_configs(draw):
    """Qwen3-Next: the delta-net and attention sizes, experts with dense layers among them
    (mlp_only_layers, decoder_sparse_step) and top-k renormalized or not."""
    kw = draw(delta_net())
    experts(draw, kw)
    kw.update(norm_topk_prob=draw(st.booleans()), decoder_sparse_step=draw(st.sampled_from([1, 2])),
              mlp_only_layers=draw(st.lists(st.integers(0, kw["num_hidden_layers"] - 1), unique=True, max_size=1)),
              attn_implementation="eager")
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(qwen3_next_configs())
def test_qwen3_next_configs(drawn):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    check_drawn(lambda **kw: Qwen3NextForCausalLM(Qwen3NextConfig(**kw)), drawn)


@st.composite
def qwen3_5_configs(draw):
    """Qwen 3.5, dense and MoE (transformers 5 model types): the delta-net and attention sizes,
    the experts."""
    kw = draw(delta_net())
    moe = draw(st.booleans())
    if moe:
        del kw["intermediate_size"]
        experts(draw, kw)
    drawn = Drawn(dict(kw, moe=moe))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


def qwen3_5_hf(moe, **kw):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw)) if moe else Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw))


@DRAWS
@given(qwen3_5_configs())
def test_qwen3_5_configs(drawn):
    check_drawn(qwen3_5_hf, drawn)


@st.composite
def latent_moe(draw, layers=(2, 3, 4)):
    """What Kimi Linear and Bailing hybrid share: MLA's latent sizes (an odd latent width, the q
    LoRA path or not, v wider than q/k), the sigmoid-routed MoE with a score-correction bias
    (experts, groups kept, top-k, shared experts, renormalization, scaling), the dense layers
    first or an explicit MLP type list, the RMSNorm eps (not the latent norms')."""
    kw = draw(common(layers=layers, head_dim=None))
    del kw["head_dim"]
    kw.update(num_key_value_heads=kw["num_attention_heads"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    n, experts = kw["num_hidden_layers"], draw(st.sampled_from([4, 8]))
    groups = draw(st.sampled_from([1, 2]))
    kept = draw(st.integers(1, groups))
    kw.update(moe_intermediate_size=draw(st.sampled_from([16, 32])), kv_lora_rank=draw(st.sampled_from([16, 23])),
              q_lora_rank=draw(st.sampled_from([None, 20])), qk_rope_head_dim=8,
              qk_nope_head_dim=draw(st.sampled_from([8, 16])), v_head_dim=draw(st.sampled_from([12, 32])),
              num_local_experts=experts, n_group=groups, topk_group=kept,
              num_experts_per_tok=draw(st.integers(1, min(4, experts // groups * kept))),
              n_shared_experts=draw(st.sampled_from([1, 2])), norm_topk_prob=draw(st.booleans()),
              routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), attention_bias=draw(st.booleans()))
    if draw(st.booleans()):
        kw["mlp_layer_types"] = draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=n, max_size=n))
    else:
        kw["first_k_dense_replace"] = draw(st.integers(0, n - 1))
    return kw


def routed(model_class, config_class):
    """A maker of ``model_class(config_class(**kw))`` with its score-correction biases set."""
    def make(**kw):
        from ssm_family_checks import nudge_score_biases

        hf = model_class(config_class(**kw))
        nudge_score_biases(hf)
        return hf
    return make


@st.composite
def kimi_linear_configs(draw):
    """Kimi Linear: the latent attention and MoE, the KDA heads, head dim and conv kernel, which
    layers are KDA; the released layout (linear_attn_config) or transformers 5's."""
    kw = draw(latent_moe())
    kw.update(linear_head_dim=draw(st.sampled_from([8, 16])), linear_num_heads=draw(st.sampled_from([2, 4])),
              linear_conv_kernel_dim=draw(st.sampled_from([2, 4])),
              layer_types=layer_types(draw, kw["num_hidden_layers"], ("linear_attention", "full_attention")))
    drawn = Drawn(kw, old_layout=draw(st.booleans()))
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(kimi_linear_configs())
def test_kimi_linear_configs(drawn):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    check_drawn(routed(KimiLinearForCausalLM, KimiLinearConfig), drawn)


@st.composite
def bailing_hybrid_configs(draw):
    """Bailing hybrid (Ling 3): the latent attention and MoE, the KDA head dim and conv kernel,
    the layer group size or explicit layer types, the forget gate's bound, RoPE theta, the
    routed and shared experts' SwiGLU clip per layer (0: none)."""
    kw = draw(latent_moe())
    for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if draw(st.booleans()):
            n = kw["num_hidden_layers"]
            kw[name] = draw(st.lists(st.sampled_from([0, 0.1, 0.5]), min_size=n, max_size=n))
    kw.update(head_dim=draw(st.sampled_from([8, 16])), short_conv_kernel_size=draw(st.sampled_from([2, 4])),
              layer_group_size=draw(st.sampled_from([2, 3])), kda_safe_gate=draw(st.booleans()),
              kda_lower_bound=draw(st.sampled_from([-1.0, -5.0])), rope_theta=draw(st.sampled_from([1e4, 6e6])))
    if draw(st.booleans()):
        kw["layer_types"] = layer_types(draw, kw["num_hidden_layers"], ("linear_attention", "full_attention"))
    drawn = Drawn(kw)
    refuse(draw, drawn, {"hidden_act": "gelu"})
    return drawn


@DRAWS
@given(bailing_hybrid_configs())
def test_bailing_hybrid_configs(drawn):
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    check_drawn(routed(BailingHybridForCausalLM, BailingHybridConfig), drawn)


@st.composite
def rwkv7_configs(draw):
    """RWKV-7 (rwkv7-hf's classes, fla-hub's layout): head dim, the four low-rank widths, the
    channel-mix width (explicit or by ratio), norm eps and bias. Not drawn: a value or attention
    width apart from hidden (the reference builds none) and tied embeddings (rwkv7-hf never ties a
    stored head, fla's class does, turnkv follows the flag; released files do not tie)."""
    hidden = draw(st.sampled_from([32, 64]))
    kw = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=draw(st.sampled_from([1, 2, 3])),
              head_dim=draw(st.sampled_from([8, 16])), decay_low_rank_dim=draw(st.sampled_from([8, 16])),
              gate_low_rank_dim=draw(st.sampled_from([8, 32])), a_low_rank_dim=draw(st.sampled_from([8, 16])),
              v_low_rank_dim=draw(st.sampled_from([4, 8])), norm_eps=draw(st.sampled_from(EPS)),
              norm_bias=draw(st.booleans()), initializer_range=0.1)
    if draw(st.booleans()):
        kw["intermediate_size"] = draw(st.sampled_from([64, 96]))
    else:
        kw["hidden_ratio"] = draw(st.sampled_from([2.0, 4.0]))
    return Drawn(kw)


def rwkv7_hf(**kw):
    """rwkv7-hf's init leaves the token-shift mixes, ``r_k`` and the norms at 0 / 1: every tensor
    that is not a matrix gets values."""
    import torch
    from rwkv7_hf import RWKV7Config, RWKV7ForCausalLM

    hf = RWKV7ForCausalLM(RWKV7Config(**kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".x_" in name:
                p.copy_(torch.rand(p.shape, generator=g))
            elif p.ndim == 1 or name.endswith("r_k"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return hf


@DRAWS
@given(rwkv7_configs())
def test_rwkv7_configs(drawn):
    check_drawn(rwkv7_hf, drawn)
