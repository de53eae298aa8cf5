"""The tiny random transformers models the GGUF fixtures are converted from (convert.py).

`make_<family>()` returns (model, vocab_patches): vocab_patches names converter classes whose
set_vocab must be pointed at the GPT-2 writer (see convert.py). Models are small (a few hundred
kB) and their 1-D weights perturbed, so a wrong norm offset or a missing bias shows."""

from __future__ import annotations

import torch

VOCAB = 320


def perturb(model, seed: int = 1, scale: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    return perturb(LlamaForCausalLM(cfg)), ()


def make_qwen3():
    """Qwen 3 dense: q/k RMS norms, head_dim 32 over a 64-wide residual (no q/k permute)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    return perturb(Qwen3ForCausalLM(cfg)), ()


def make_qwen3_moe():
    """Qwen 3 MoE: every block routed, the kept weights renormalized (llama.cpp's qwen3moe graph
    always renormalizes), routers drawn so tokens spread over the experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
    return perturb(hf), ()


def make_qwen2():
    """Qwen 2 / 2.5: q/k/v biases, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True)
    hf = perturb(Qwen2ForCausalLM(cfg))
    hf.tokenizer_specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    return hf, ()


def make_llama3():
    """Llama 3.x: rope_type llama3, which the converter writes as rope_freqs.weight divisors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256})
    return perturb(LlamaForCausalLM(cfg)), ()


def _score_biases(model, seed: int = 3):
    """Set the routers' score-correction biases (zero at init, which would hide a dropped bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=g))
    return model


def make_kimi_linear():
    # KDA, MLA, KDA, MLA; a dense first layer, then the MoE. linear_attn_config, first_k_dense_replace
    # and moe_router_activation_func as the released config.json holds them (the converter reads
    # them; the last becomes expert_gating_func, a key llama.cpp's loader requires).
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, moe_router_activation_func="sigmoid",
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2, 4], "kda_layers": [1, 3]},
        max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _score_biases(perturb(KimiLinearForCausalLM(cfg)))
    # save_pretrained names the dense first layer's MLP ``block_sparse_moe`` like the MoE layers;
    # the released checkpoints (and llama.cpp's tensor map) call it ``mlp``: the folder gets that.
    _rename_on_save(model, r"^(model\.layers\.0)\.block_sparse_moe\.", r"\1.mlp.")
    return model, ()


def _rename_on_save(model, pattern: str, repl: str) -> None:
    """After the model's save_pretrained, rename matching tensors in its model.safetensors (to a
    released checkpoint's names where transformers' own differ)."""
    import re
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    save = model.save_pretrained

    def save_renamed(folder, *args, **kwargs):
        save(folder, *args, **kwargs)
        path = Path(folder) / "model.safetensors"
        tensors = {re.sub(pattern, repl, k): v for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})

    model.save_pretrained = save_renamed


def make_gpt_oss():
    """Two layers (sliding then full, llama.cpp's default pattern 2), attention sinks, YaRN,
    4 float experts with biases (the converter writes float 3-D experts, not MXFP4)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=16, initializer_range=0.1, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = perturb(GptOssForCausalLM(cfg), scale=0.5)   # sinks and router biases must matter
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # the 2-D expert biases too: a dropped or mis-split bias must show
        for layer in model.model.layers:
            for b in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                b.add_(0.1 * torch.randn(b.shape, generator=g))
    return model, ()


def make_glm4_moe():
    """A dense first layer, one MoE layer (8 experts in 4 groups, shared expert, score-correction
    bias, routed scaling), QK-norm, q/k/v biases, partial RoPE, and the MTP (nextn) layer the
    released checkpoints carry after the decoder (``model.layers.{num_hidden_layers}``: a full
    MoE block plus eh_proj / enorm / hnorm / shared_head.norm), which turnkv ignores."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

    torch.manual_seed(0)
    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                        num_nextn_predict_layers=1, max_position_embeddings=4096, initializer_range=0.1,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = Glm4MoeForCausalLM(cfg)
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    mtp = Glm4MoeDecoderLayer(cfg, n)   # transformers' forward runs layers[:num_hidden_layers] only
    mtp.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    mtp.enorm, mtp.hnorm = Glm4MoeRMSNorm(hidden), Glm4MoeRMSNorm(hidden)
    mtp.shared_head = torch.nn.Module()
    mtp.shared_head.norm = Glm4MoeRMSNorm(hidden)
    model.model.layers.append(mtp)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if p.ndim > 1:
                p.normal_(0, 0.1)
    model = perturb(model, scale=0.2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # a buffer, not a parameter: perturb leaves it at 0
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    # Glm4MoeModel.set_vocab reads GLM's own tokenizer ([gMASK] etc.), which the test folder lacks
    return model, ("conversion.glm.Glm4MoeModel:gpt2",)


def _qwen3_5_common():
    # linear, linear, linear, full (full_attention_interval 4); 2 key heads serving 4 value heads, so
    # the converter's grouped -> tiled V-head reorder shows; key and value head dims equal, as
    # llama.cpp's qwen35 loader requires. mtp_num_hidden_layers as the released configs hold it
    # (the converter counts an MTP block in block_count; transformers has no MTP weights to save).
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, mtp_num_hidden_layers=1)


def make_qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(intermediate_size=96, tie_word_embeddings=False, **_qwen3_5_common())
    return perturb(Qwen3_5ForCausalLM(cfg)), ()


def make_qwen3_5_mtp():
    """Qwen 3.5 dense with the multi-token-prediction block a released checkpoint carries (``mtp.*``:
    fc, the two pre-fc norms, one full-attention decoder layer, the final norm), which transformers
    neither builds nor saves (``_keys_to_ignore_on_load_unexpected``): the folder gets them after
    save_pretrained, random (the layer's from a second model's full-attention layer, every 1-D
    weight perturbed), and llama.cpp's converter writes them as ``blk.4.*`` / ``blk.4.nextn.*``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(intermediate_size=96, tie_word_embeddings=False, **_qwen3_5_common())
    model = perturb(Qwen3_5ForCausalLM(cfg))
    torch.manual_seed(7)
    donor = perturb(Qwen3_5ForCausalLM(cfg), seed=8, scale=0.3)
    g = torch.Generator().manual_seed(9)
    hidden = cfg.hidden_size
    mtp = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in donor.model.layers[3].state_dict().items()}
    mtp |= {"mtp.fc.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g)}
    mtp |= {f"mtp.{n}.weight": 0.3 * torch.randn(hidden, generator=g)
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    _add_on_save(model, mtp)
    return model, ()


def _add_on_save(model, extra: dict) -> None:
    """After the model's save_pretrained, add ``extra`` tensors to its model.safetensors (weights a
    released checkpoint holds that transformers' class does not)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    save = model.save_pretrained

    def save_more(folder, *args, **kwargs):
        save(folder, *args, **kwargs)
        path = Path(folder) / "model.safetensors"
        save_file(load_file(path) | {k: v.contiguous() for k, v in extra.items()}, path, metadata={"format": "pt"})

    model.save_pretrained = save_more


def make_qwen3_5_moe():
    # tied embeddings (as the small released models), shared expert gate on every layer. A vocabulary
    # padded past the tokenizer's (as the released 248320 is): transformers loads a qwen3_5_moe_text
    # folder's tokenizer as Qwen3_5Tokenizer, which adds <|endoftext|> after the byte tokenizer's
    # tokens (337 at most from its text), and the converter asserts every id < vocab_size.
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    # Seed 1: the Q8_0 error of these tiny random MoEs swings with the seed (routing flips; 0.04 to
    # 0.5 of the logits' scale over seeds 0-3), and seed 0's 0.17 says nothing about the loader.
    torch.manual_seed(1)
    common = {**_qwen3_5_common(), "vocab_size": 352}
    cfg = Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, tie_word_embeddings=True, **common)
    return perturb(Qwen3_5MoeForCausalLM(cfg)), ()


def make_gemma4():
    # Every Gemma 4 layer kind in four layers: sliding and full layers with their own head dims
    # (16 / 32) and kv heads (2 / 1, k = v on the full layers: no v_proj), the last two layers
    # reading the K/V of layers 0 (sliding) and 1 (full), as llama.cpp's reuse rule
    # (n_layer_kv_from_start - 2 / - 1) and transformers' (last earlier layer of the type) both
    # say for this order; per-layer embeddings, the MoE block beside the MLP, double-wide MLPs on
    # the shared layers, layer scalars off 1, final soft-cap. set_vocab reads a sentencepiece-style
    # vocabulary the test folder does not have: the GPT-2 writer instead.
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    types = ["sliding_attention", "full_attention"] * 2
    cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                           attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=16,
                           layer_types=types, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                           num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
                           top_k_experts=2, moe_intermediate_size=16, final_logit_softcapping=30.0,
                           max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    model = perturb(Gemma4ForCausalLM(cfg))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return model, ("conversion.gemma.Gemma4Model:gpt2",)


def make_afmoe():
    # Three sliding RoPE layers then a NoPE full one (llama.cpp reads AFMoE's pattern as every 4th
    # layer global: global_attn_every_n_layers must be 4), a dense first layer, sigmoid-routed MoE
    # with expert bias, route scale and a shared expert. llama.cpp always applies the muP embedding
    # scale and renormalises the routing weights only when the file says so (route_norm), as the
    # released Trinity configs hold both.
    from transformers import AfmoeConfig, AfmoeForCausalLM

    torch.manual_seed(0)
    cfg = AfmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=4, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.0,
                      global_attn_every_n_layers=4, sliding_window=16, mup_enabled=True, route_norm=True,
                      score_func="sigmoid", max_position_embeddings=4096, initializer_range=0.1,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AfmoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # transformers zero-inits the router: give it values
        for layer in model.model.layers[cfg.num_dense_layers:]:
            layer.mlp.router.gate.weight.normal_(0.0, 0.3, generator=g)
    return perturb(model, scale=0.2), ()


def make_exaone4():
    # sliding RoPE layers and a global NoPE layer (layer_types), QK-norm, post-norm branches, and
    # llama3 rope scaling so the converter writes rope_freqs (original context 64: every region of
    # the factors occurs at head_dim 16)
    from transformers import Exaone4Config, Exaone4ForCausalLM

    torch.manual_seed(0)
    cfg = Exaone4Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                        sliding_window_pattern=3, max_position_embeddings=4096, initializer_range=0.1,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64},
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return perturb(Exaone4ForCausalLM(cfg)), ()


def make_ministral():
    # Ministral 3 (Ministral3ForCausalLM: llama.cpp's "mistral3"): YaRN over an original context of
    # 64 and the Llama-4 query scale, both active within the test prompt. No sliding window: the
    # converter does not write one for mistral3 and llama.cpp runs every layer over the full context.
    # (MinistralForCausalLM, model_type "ministral", has no converter class in llama.cpp.)
    from transformers import Ministral3Config, Ministral3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 64,
            "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    cfg = Ministral3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
                           max_position_embeddings=1024, rope_parameters=rope, initializer_range=0.1,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return perturb(Ministral3ForCausalLM(cfg)), ()


class _Mxfp4Folder:
    """A gpt-oss model whose save_pretrained writes the released checkpoints' layout: expert
    weights as MXFP4 ``*_blocks`` / ``*_scales`` (no float expert tensors) and
    ``quantization_config.quant_method = "mxfp4"``, which makes llama.cpp's converter repack them
    into ggml MXFP4 blocks instead of writing floats."""

    def __init__(self, model, packed: dict):
        self.model, self.packed, self.config = model, packed, model.config

    def save_pretrained(self, folder):
        import json
        from pathlib import Path

        from safetensors.torch import load_file, save_file

        self.model.save_pretrained(folder)
        path = Path(folder) / "model.safetensors"
        tensors = {k: v for k, v in load_file(path).items()
                   if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        save_file(tensors | self.packed, path, metadata={"format": "pt"})
        cfg_path = Path(folder) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        cfg_path.write_text(json.dumps(cfg, indent=2))


def make_gpt_oss_mxfp4():
    """gpt-oss as released: the same tiny model as make_gpt_oss, its experts random MXFP4 codes
    and power-of-two scales (the float weights set to exactly what those blocks hold)."""
    from tiny import random_mxfp4_experts    # tests/ (convert.py puts it on the path)

    model, patches = make_gpt_oss()
    packed = random_mxfp4_experts(model, torch.Generator().manual_seed(3))
    return _Mxfp4Folder(model, packed), patches


def make_muse_glimmer():
    """Three sliding RoPE layers and a full NoPE one (the text path of the conditional-generation
    model; a one-layer vision tower the text GGUF leaves out). The image / video token ids lie outside the vocabulary: the text GGUF does not
    carry them, and the folder's model would embed them as token 0."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=4096,
                initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=48, num_attention_heads=2)
    cfg = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=128, projector_hidden_size=64,
                            image_token_id=VOCAB + 10, video_token_id=VOCAB + 11)
    return perturb(MuseGlimmerForConditionalGeneration(cfg)), ()


def make_bailing_hybrid():
    """Ling 3: KDA, MLA, KDA, MLA (layer_group_size 2), a dense first layer, then the MoE; no MTP
    layer. llama.cpp converts this model as BailingMoeV3ForCausalLM (conversion/bailingmoe3.py,
    whose example is inclusionAI/Ling-3.0-flash, the checkpoint transformers' bailing_hybrid ports)
    and reads that checkpoint's own config.json: ``norm_topk_prob``, ``head_dim`` as the KDA head
    dim, ``no_kda_lora``, ``gated_attention_proj_granularity_type``,
    ``moe_shared_expert_intermediate_size``, ``score_function``. transformers' config class does not
    round-trip that file (it renames norm_topk_prob and rewrites head_dim to qk_rope_head_dim), so the
    converter is given the folder with those keys as the released file has them
    (``released_config``, convert.py); the tensors are the folder's."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    torch.manual_seed(0)
    cfg = BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, head_dim=16, short_conv_kernel_size=4, layer_group_size=2, first_k_dense_replace=1,
        kda_lower_bound=-1.0, rope_theta=10000.0, max_position_embeddings=4096, num_mtp_layers=0,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _score_biases(perturb(BailingHybridForCausalLM(cfg)))
    model.released_config = {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_moe_v3", "head_dim": 16,
        "norm_topk_prob": True, "no_kda_lora": True, "gated_attention_proj_granularity_type": "head_wise",
        "moe_shared_expert_intermediate_size": 32, "score_function": "sigmoid"}
    return model, ()


def make_rwkv7():
    """RWKV-7 in fla-hub's layout, written by rwkv7-hf's RWKV7ForCausalLM (tests/test_family_rwkv7.py's
    tiny model at this vocabulary); the converter's own vocabulary writer reads RWKV's world trie
    file, which a test folder has not. save_pretrained also copies rwkv7-hf's remote-code .py files
    into hf/: the fixture keeps only the config, weights and tokenizer (turnkv reads no code)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_family_rwkv7 import build

    torch.manual_seed(0)
    model = build(vocab_size=VOCAB)
    model.config.eos_token_id = 2
    return model, ("conversion.rwkv.Rwkv7Model:gpt2",)


def make_lfm2():
    """LFM2: short-conv layers and attention layers, the conv hybrid of speculative decoding's
    table under --weights gguf (tests/test_speculative.py). No conv bias, as released: the
    converter squeezes every ``conv.conv`` tensor, the bias too."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=16,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3],
                     conv_L_cache=3, conv_bias=False, initializer_range=0.2, max_position_embeddings=4096,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return perturb(Lfm2ForCausalLM(cfg)), ()
