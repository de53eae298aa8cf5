"""Vision sizes beyond the tests' defaults: for each vision-language family, 25 vision configs
drawn from transformers' own config classes (patch size, image / tile size, tower widths,
depth and heads, the connector's merge factor and widths, the activation), each saved with its
processor settings; one picture's rows from turnkv's encoder must be as many as its image tokens
and equal transformers' image features on the same pixels (tests/config_draws.py). The text
decoders' own fields are drawn in the families' text tests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config_draws import DRAWS, check_vision

TEXT = dict(vocab_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=256)
IMAGE = 250


def tower(draw, image=True) -> dict:
    """A SigLIP-style tower: width, MLP width, depth, heads, layer-norm eps."""
    return dict(hidden_size=draw(st.sampled_from([16, 32])), intermediate_size=draw(st.sampled_from([24, 64])),
                num_hidden_layers=draw(st.sampled_from([1, 2])), num_attention_heads=draw(st.sampled_from([2, 4])),
                layer_norm_eps=draw(st.sampled_from([1e-6, 1e-5])))


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
