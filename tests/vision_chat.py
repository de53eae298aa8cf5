"""Chats with images, shared by the vision families' tests (gemma3, lfm2_vl, qwen3_5_vl, smolvlm):
a random picture, a request carrying its images, and a conversation played with the prompt cache
on and again with it off on the same replies."""

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
