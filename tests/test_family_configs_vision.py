"""Vision sizes beyond the tests' defaults: for each vision-language family, 25 vision configs
drawn from transformers' own config classes (patch size, image / tile size, tower widths,
depth and heads, the connector's merge factor and widths, the activation), each saved with its
processor settings; one picture's rows from turnkv's encoder must be as many as its image tokens
and equal transformers' image features on the same pixels (tests/config_draws.py). The text
decoders' own fields are drawn in the families' text tests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, EPS, check_vision

TEXT = dict(vocab_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=256)
IMAGE = 250


def tower(draw, image=True) -> dict:
    """A SigLIP-style tower: width, MLP width, depth, heads, layer-norm eps."""
    return dict(hidden_size=draw(st.sampled_from([16, 32])), intermediate_size=draw(st.sampled_from([24, 64])),
                num_hidden_layers=draw(st.sampled_from([1, 2])), num_attention_heads=draw(st.sampled_from([2, 4])),
                layer_norm_eps=draw(st.sampled_from(EPS)))


@st.composite
def smolvlm_configs(draw):
    """SmolVLM / Idefics3: tile (image_size), patch, merge (scale_factor), tower, text width, the
    tower's activation (quick GELU refused); the processor's longest edge and splitting."""
    scale, patch = draw(st.sampled_from([1, 2])), draw(st.sampled_from([4, 8]))
    image = patch * scale * draw(st.sampled_from([1, 2, 4]))
    vision = dict(tower(draw), image_size=image, patch_size=patch,
                  hidden_act=draw(st.sampled_from(["gelu_pytorch_tanh", "gelu", "gelu_pytorch_tanh", "quick_gelu"])))
    text = dict(TEXT, model_type="llama", hidden_size=draw(st.sampled_from([32, 64])), intermediate_size=64)
    return dict(kind=draw(st.sampled_from(["smolvlm", "idefics3"])), text_config=text, vision_config=vision,
                scale_factor=scale, image_token_id=IMAGE, split=draw(st.booleans()),
                edge=image * draw(st.sampled_from([1, 2])))


@DRAWS
@given(smolvlm_configs())
def test_smolvlm_vision_configs(drawn):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    kw = dict(drawn)
    kind, split, edge, image = kw.pop("kind"), kw.pop("split"), kw.pop("edge"), kw["vision_config"]["image_size"]
    config, model, proc = ((SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil)
                           if kind == "smolvlm" else
                           (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil))
    saved = proc(size={"longest_edge": edge}, max_image_size={"longest_edge": image}, do_image_splitting=split)

    def features(hf, im):
        return hf.model.get_image_features(pixel_values=im.pixel_values[None],
                                           pixel_attention_mask=im.pixel_mask[None]).pooler_output[0]

    refused = "hidden_act" if kw["vision_config"]["hidden_act"] == "quick_gelu" else None
    check_vision(model(config(**kw)), saved.save_pretrained, features, refused)


@st.composite
def lfm2_vl_configs(draw):
    """LFM2-VL: the SigLIP 2 NaFlex tower (patch, position table, widths, activation), the
    projector (downsample factor, width, bias, layer norm, activation: quick GELU refused), and
    the processor's tile size, token bounds, splitting and thumbnail; pictures of two sizes."""
    patch, factor = draw(st.sampled_from([4, 8])), draw(st.sampled_from([1, 2]))
    vision = dict(tower(draw), patch_size=patch, num_patches=draw(st.sampled_from([16, 64])),
                  hidden_act=draw(st.sampled_from(["gelu_pytorch_tanh", "gelu"])))
    text = dict(TEXT, hidden_size=draw(st.sampled_from([32, 64])), intermediate_size=64,
                layer_types=["full_attention"])
    act = draw(st.sampled_from(["gelu", "gelu_pytorch_tanh", "gelu", "quick_gelu"]))
    config = dict(text_config=text, vision_config=vision, image_token_id=IMAGE, downsample_factor=factor,
                  projector_hidden_size=draw(st.sampled_from([32, 48])), projector_bias=draw(st.booleans()),
                  projector_use_layernorm=draw(st.booleans()), projector_hidden_act=act)
    tile = patch * factor * draw(st.sampled_from([2, 4]))
    prep = dict(image_processor_type="Lfm2VlImageProcessor", tile_size=tile, encoder_patch_size=patch,
                downsample_factor=factor, min_image_tokens=draw(st.sampled_from([1, 4])),
                max_image_tokens=draw(st.sampled_from([16, 64])), do_image_splitting=draw(st.booleans()),
                use_thumbnail=draw(st.booleans()))
    return dict(config=config, prep=prep, size=draw(st.sampled_from([(40, 50), (90, 30)])),
                refused="projector_hidden_act" if act == "quick_gelu" else None)


@DRAWS
@given(lfm2_vl_configs())
def test_lfm2_vl_vision_configs(drawn):
    import json

    import torch
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    def save(folder):
        (folder / "preprocessor_config.json").write_text(json.dumps(drawn["prep"]))

    def features(hf, im):
        out = hf.model.get_image_features(pixel_values=im.pixel_values, pixel_attention_mask=im.pixel_mask,
                                          spatial_shapes=im.extra["spatial_shapes"]).pooler_output
        return torch.cat(list(out))

    check_vision(Lfm2VlForConditionalGeneration(Lfm2VlConfig(**drawn["config"])), save, features,
                 drawn["refused"], size=drawn["size"])


@st.composite
def gemma3_vision_configs(draw):
    """Gemma 3: the SigLIP tower (image size, patch, widths, activation), the pooled tokens per
    image (mm_tokens_per_image: any square whose side divides the patch grid's), the text width;
    the processor's size, mean and std."""
    patch, side = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8]))
    pooled = side // draw(st.sampled_from([k for k in (1, 2, 4) if side % k == 0]))
    vision = dict(tower(draw), image_size=patch * side, patch_size=patch,
                  hidden_act=draw(st.sampled_from(["gelu_pytorch_tanh", "gelu"])))
    text = dict(TEXT, hidden_size=draw(st.sampled_from([32, 64])), intermediate_size=64, head_dim=16)
    mean = draw(st.sampled_from([[0.5] * 3, [0.5, 0.4, 0.3]]))
    return dict(text_config=text, vision_config=vision, mm_tokens_per_image=pooled * pooled,
                image_token_index=IMAGE, boi_token_index=IMAGE + 1, eoi_token_index=IMAGE + 2), mean


@DRAWS
@given(gemma3_vision_configs())
def test_gemma3_vision_configs(drawn):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config, mean = drawn
    side = config["vision_config"]["image_size"]
    hf = Gemma3ForConditionalGeneration(Gemma3Config(**config))
    hf.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0, 0.3)   # zero at init
    saved = Gemma3ImageProcessorPil(size={"height": side, "width": side}, image_mean=mean, image_std=[0.5, 0.6, 0.7])

    def features(hf, im):
        return hf.model.get_image_features(pixel_values=im.pixel_values).pooler_output[0]

    check_vision(hf, saved.save_pretrained, features)


@st.composite
def qwen3_5_vl_configs(draw):
    """Qwen 3.5 VL: the tower (patch, temporal patch, merge, position table, width, MLP width,
    depth, heads, activation, its RoPE theta), the merger's output width (the text width); the
    processor's pixel bounds, mean and std; pictures of two sizes."""
    patch, merge = draw(st.sampled_from([4, 8])), draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([1, 2]))
    vision = dict(depth=draw(st.sampled_from([1, 2])), hidden_size=heads * draw(st.sampled_from([8, 16])),
                  intermediate_size=draw(st.sampled_from([24, 64])), num_heads=heads, patch_size=patch,
                  spatial_merge_size=merge, temporal_patch_size=draw(st.sampled_from([1, 2])),
                  num_position_embeddings=draw(st.sampled_from([16, 64])),
                  hidden_act=draw(st.sampled_from(["gelu_pytorch_tanh", "gelu"])),
                  rope_parameters={"rope_type": "axial", "rope_theta": draw(st.sampled_from([1e4, 5e4]))})
    hidden = draw(st.sampled_from([32, 64]))
    vision["out_hidden_size"] = hidden
    text = dict(TEXT, hidden_size=hidden, intermediate_size=64, head_dim=16, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                layer_types=[draw(st.sampled_from(["linear_attention"] * 5 + ["full_attention"]))],
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    unit = (patch * merge) ** 2
    prep = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=patch, merge_size=merge,
                temporal_patch_size=vision["temporal_patch_size"], min_pixels=unit * draw(st.sampled_from([1, 4])),
                max_pixels=unit * draw(st.sampled_from([16, 30])), image_mean=[0.5] * 3,
                image_std=draw(st.sampled_from([[0.5] * 3, [0.5, 0.6, 0.7]])))
    config = dict(text_config=text, vision_config=vision, image_token_id=IMAGE, vision_start_token_id=IMAGE + 1,
                  vision_end_token_id=IMAGE + 2)
    return dict(config=config, prep=prep, size=draw(st.sampled_from([(40, 50), (90, 30)])))


@DRAWS
@given(qwen3_5_vl_configs())
def test_qwen3_5_vl_vision_configs(drawn):
    import json

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    def save(folder):
        (folder / "preprocessor_config.json").write_text(json.dumps(drawn["prep"]))

    def features(hf, im):
        grid = torch.tensor([list(im.extra["grid_thw"])])
        return hf.model.get_image_features(pixel_values=im.pixel_values, image_grid_thw=grid).pooler_output[0]

    # turnkv keeps the M-RoPE delta in a delta-net layer's state: a decoder without one is refused
    refused = "layer_types" if drawn["config"]["text_config"]["layer_types"] == ["full_attention"] else None
    check_vision(Qwen3_5ForConditionalGeneration(Qwen3_5Config(**drawn["config"])), save, features, refused,
                 size=drawn["size"])
