"""Chats with images, shared by the vision families' tests (gemma3, lfm2_vl, qwen3_5_vl, smolvlm):
a random picture, a request carrying its images, a conversation played with the prompt cache
on and again with it off on the same replies, and the tiny checkpoints' configs (the family file
and test_vision_settings.py build the same shapes)."""

from __future__ import annotations

import numpy as np
import torch

from tiny import greedy
from turnkv.images import last_image_end
from turnkv.engine.engine import GenerationRequest


def picture(seed: int, size=(40, 50)):
    from PIL import Image
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def req(ids, images, max_tokens=6, boundaries=()):
    return GenerationRequest(list(ids), greedy(max_tokens), list(boundaries), images={im.image_id: im for im in images})


def run_chat(eng, images, first, users, replies_from=None):
    """Turn 1 is ``first``; turn t adds the reply to turn t - 1 (the engine's own, or
    ``replies_from``) and ``users[t - 2]``. Returns every turn's prompt and result."""
    prompts, results = [], []
    prompt = list(first)
    for t in range(len(users) + 1):
        if t:
            reply = results[-1].token_ids[:-1] if replies_from is None else replies_from[t - 1]
            prompt = prompt + reply + users[t - 1]
        prompts.append(prompt)
        results.append(eng.generate(req(prompt, images)))
    return prompts, results


def warm_and_cold(warm, cold, images, first, users):
    """The chat on ``warm`` (cache on), then on ``cold`` (cache off) with warm's replies: every
    turn's tokens equal and first logits within 1e-4, and the first turn found nothing cached.
    Returns warm's prompts and results."""
    prompts, res = run_chat(warm, images, first, users)
    _, ref = run_chat(cold, images, first, users, replies_from=[r.token_ids[:-1] for r in res])
    for a, b in zip(res, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.first_logits, b.first_logits, atol=1e-4, rtol=0)
    assert res[0].usage.cached_tokens == 0
    return prompts, res


def edit_after_the_image(warm, cold, image, system, a, b, reference) -> None:
    """``a`` on ``warm``, then ``b``: ``a`` with the text after its image edited. ``b`` restores
    the media checkpoint at the image's end (the image neither encoded nor prefilled again) and
    equals ``cold`` (cache off) and ``reference(b)`` (transformers' logits)."""
    end = last_image_end(a)
    first = warm.generate(req(a, [image], boundaries=[len(system)]))
    assert first.stats.checkpoints == 3        # the system prompt, the media checkpoint, the prompt's end
    res = warm.generate(req(b, [image], boundaries=[len(system)]))
    s = res.stats
    assert (s.reuse_from, s.restored_origin, s.restored_entry_length) == ("prefix", "checkpoint", end)
    assert res.usage.cached_tokens == end and warm.encoder_cache.stats()["encoded"] == 1
    alone = cold.generate(req(b, [image]))
    assert res.token_ids == alone.token_ids
    torch.testing.assert_close(res.first_logits, alone.first_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(res.first_logits, reference(b)[-1], atol=1e-4, rtol=0)


def tiny_smolvlm_config(image_id: int):
    from transformers import SmolVLMConfig

    return SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=image_id)


def tiny_qwen3_5_vl_config(image_id: int, start_id: int, end_id: int):
    """4 px patches, merge 2, a 4 x 4 position table, M-RoPE over t / h / w."""
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    text = Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                             linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
                             linear_num_value_heads=4, max_position_embeddings=4096, initializer_range=0.05,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, image_token_id=image_id,
                         vision_start_token_id=start_id, vision_end_token_id=end_id)


def tiny_lfm2_vl_config(image_id: int):
    from transformers import Lfm2VlConfig

    return Lfm2VlConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"],
                         max_position_embeddings=4096),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           patch_size=4, num_patches=16),
        image_token_id=image_id, projector_hidden_size=48)
