"""Vision models as two GGUF files, a text model and llama.cpp's mmproj (docs/images.md): the
fixtures under tests/gguf_fixtures/<family>_vision/ are the converter's own output
(`convert_hf_to_gguf.py` and `--mmproj`, tests/gguf_fixtures/vision.py) for the folder beside them,
and turnkv on the pair equals transformers and turnkv on that folder: logits, greedy replies, a
multi-turn chat with pictures in turns 1 and 4, reuse == cold, each picture encoded once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from test_server_images import data_url
from tiny import greedy
from vision_chat import picture
from turnkv.engine.engine import Engine
from turnkv.images import last_image_end, model_ids
from turnkv.loading.errors import ModelLoadError
from turnkv.models.batch import Batch
from turnkv.prompt_cache.store import PromptCache

FIXTURES = Path(__file__).parent / "gguf_fixtures"
KW = dict(progress=False, prefill_chunk=16, max_context=4096)


def pair(family: str) -> tuple[Path, Path, Path]:
    d = FIXTURES / f"{family}_vision"
    return d / f"{family}_vision-f32.gguf", d / f"mmproj-{family}_vision-f32.gguf", d / "hf"


def message(text: str, img=None) -> dict:
    image = [{"type": "image_url", "image_url": {"url": data_url(img)}}] if img is not None else []
    return {"role": "user", "content": image + [{"type": "text", "text": text}]}


def hf_inputs(model, ids: list[int], images) -> dict:
    """transformers' inputs for a turnkv prompt: placeholders for keys, the images' pixels (and
    Gemma 3's token types, which make its image tokens attend both ways, Qwen's grids and token
    types, which place its image tokens at M-RoPE positions)."""
    plain = torch.tensor([model_ids(ids, model.image_token_id)])
    kw = {"input_ids": plain}
    if model.family == "gemma3_vision":
        kw["token_type_ids"] = (plain == model.image_token_id).long()
        if images:
            kw["pixel_values"] = torch.cat([im.pixel_values for im in images])
    elif model.family == "qwen3_5_vl":
        kw["mm_token_type_ids"] = (plain == model.image_token_id).long()
        if images:
            kw["pixel_values"] = torch.cat([im.pixel_values for im in images])
            kw["image_grid_thw"] = torch.tensor([list(im.extra["grid_thw"]) for im in images])
    elif model.family == "lfm2_vl":
        if images:
            kw.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                      pixel_attention_mask=torch.cat([im.pixel_mask for im in images]),
                      spatial_shapes=torch.cat([im.extra["spatial_shapes"] for im in images]))
    elif images:
        kw["pixel_values"] = torch.cat([im.pixel_values for im in images])[None]
        kw["pixel_attention_mask"] = torch.cat([im.pixel_mask for im in images])[None]
    return kw


def logits_and_greedy_equal_transformers(eng: Engine, hf, msgs, max_tokens=8):
    req = eng.chat_request(msgs)
    images = list(req.images.values())
    kw = hf_inputs(eng.model, req.prompt_ids, images)
    with torch.no_grad():
        ref = hf(**kw).logits[0]
        gen = hf.generate(**kw, max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1)
    state = eng.pool.acquire(req.prompt_ids)
    with torch.inference_mode():
        embeds = {im.image_id: eng.model.encode_image(im) for im in images}
        out = eng.model.forward(Batch.build([(req.prompt_ids, state.caches, "all")], images=embeds))
    eng.pool.release(state)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    req.params = greedy(max_tokens)
    req.params.ignore_eos = True
    res = eng.generate(req)
    assert res.token_ids == gen[0, len(req.prompt_ids):].tolist()
    return images


def chat_equals_folder_and_transformers(warm: Engine, folder_cold: Engine, hf, turns=4, max_tokens=6):
    """Pictures in turns 1 and ``turns``: every turn's prompt, reply and first logits on the GGUF
    pair (cache on) equal the folder's (cache off) and transformers' greedy reply; turns 2.. restore
    the previous prompt past its pictures; each picture is encoded once."""
    msgs, pictures = [], {0: picture(10), turns - 1: picture(11, (60, 45))}
    prev, encoded = None, warm.encoder_cache.stats()["encoded"]
    for t in range(turns):
        msgs.append(message(f"what is in turn {t + 1}", pictures.get(t)))
        req, ref = warm.chat_request(msgs), folder_cold.chat_request(msgs)
        req.params = ref.params = greedy(max_tokens)
        assert model_ids(req.prompt_ids, warm.model.image_token_id) == model_ids(ref.prompt_ids,
                                                                                   folder_cold.model.image_token_id)
        for a, b in zip(req.images.values(), ref.images.values()):
            assert torch.equal(a.pixel_values, b.pixel_values)
        res, cold = warm.generate(req), folder_cold.generate(ref)
        assert res.token_ids == cold.token_ids, f"turn {t + 1}"
        torch.testing.assert_close(res.first_logits, cold.first_logits, atol=1e-4, rtol=0)
        with torch.no_grad():
            gen = hf.generate(**hf_inputs(warm.model, req.prompt_ids, list(req.images.values())),
                              max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(warm.tokenizer.eos_token_ids))
        assert res.token_ids == gen[0, len(req.prompt_ids):].tolist(), f"turn {t + 1}"
        if prev is not None:       # the whole previous prompt, its picture included, is restored
            assert res.usage.cached_tokens >= len(prev) > last_image_end(prev) > 0, f"turn {t + 1}"
        prev = req.prompt_ids
        msgs.append({"role": "assistant", "content": res.text})
    assert warm.encoder_cache.stats()["encoded"] == encoded + 2


# --- the families ---------------------------------------------------------------------------------

def as_stored_in_f16(hf, folder_engine) -> None:
    """Gemma 3's projection as the file holds it: the converter writes mm.input_projection in F16
    whatever the output type (llama.cpp issue 13025), so the references round it the same way."""
    w = hf.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        w.copy_(w.half().float())
        folder_engine.model.proj.copy_(folder_engine.model.proj.half().float())
    assert torch.equal(folder_engine.model.proj, w)


FAMILIES = {"smolvlm": ("SmolVLMForConditionalGeneration", "idefics3", None),
            "gemma3": ("Gemma3ForConditionalGeneration", "gemma3_vision", as_stored_in_f16),
            "lfm2": ("Lfm2VlForConditionalGeneration", "lfm2_vl", None),
            "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_vl", None)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    import transformers

    cls, turnkv_family, fix = FAMILIES[request.param]
    text, mmproj, folder = pair(request.param)
    warm = Engine.load(str(text), prompt_cache=PromptCache(1 << 30), **KW)       # the sibling mmproj found
    cold = Engine.load(str(folder), prompt_cache=PromptCache(0), **KW)
    hf = getattr(transformers, cls).from_pretrained(folder).eval()
    if fix is not None:
        fix(hf, cold)
    assert warm.model.family == cold.model.family == turnkv_family
    return warm, cold, hf, request.param


def test_pair_logits_and_greedy_equal_transformers(family):
    warm, _, hf, _ = family
    images = logits_and_greedy_equal_transformers(warm, hf, [message("what is this", picture(0))])
    if warm.model.family == "idefics3":     # 64 px: 2 x 2 tiles + the global one
        assert images[0].grid == (2, 2) and images[0].n_rows == 5 * warm.model.tile_rows


def test_pair_chat_equals_the_folder_and_transformers(family):
    chat_equals_folder_and_transformers(*family[:3])


def test_serve_with_mmproj_chats_as_the_folder(family):
    """`turnkv serve -m TEXT.gguf --mmproj MMPROJ.gguf` over HTTP: a system prompt, pictures in turns
    1 and 4, each reply equal to turnkv on the folder, turns 2-4 reuse all of the previous prompt and
    at least 80% of theirs, each picture encoded once (docs/images.md)."""
    import httpx
    from live_server import serving

    from turnkv.cli import build_parser
    from turnkv.launch import engine_from
    from turnkv.server.app import create_app

    _, cold, _, name = family
    text, mmproj, _ = pair(name)
    args = build_parser().parse_args(["serve", "-m", str(text), "--mmproj", str(mmproj), "--prefill-chunk", "16",
                                      "--max-context", "4096"])
    system = {"role": "system", "content": " ".join(["the assistant describes pictures and answers briefly"] * 10)}
    msgs, pictures, prev = [system], {0: picture(12), 3: picture(13, (45, 60))}, 0
    with serving(create_app(engine_from(args, progress=False))) as url:
        for t in range(4):
            msgs.append(message(f"and now turn {t + 1}", pictures.get(t)))
            r = httpx.post(url + "/v1/chat/completions", timeout=120,
                           json={"messages": msgs, "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200, r.text
            ref = cold.chat_request(msgs)
            ref.params = greedy(5)
            reply, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
            assert reply == cold.generate(ref).text, f"turn {t + 1}"
            assert usage["prompt_tokens"] == len(ref.prompt_ids)
            if t:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= max(prev, 0.8 * usage["prompt_tokens"]), f"turn {t + 1}"
            prev = usage["prompt_tokens"]
            msgs.append({"role": "assistant", "content": reply})
        stats = httpx.get(url + "/v1/cache/stats", timeout=10).json()
    assert stats["images"]["encoded"] == 2


def test_mmproj_is_found_named_or_refused(tmp_path):
    from turnkv.cli import build_parser
    from turnkv.launch import engine_from

    text, mmproj, folder = pair("smolvlm")
    alone = tmp_path / "text.gguf"
    shutil.copy(text, alone)
    plain = Engine.load(str(alone), **KW)                      # no projector beside it: the text model
    assert plain.model.family == "llama"
    named = Engine.load(str(alone), mmproj=str(mmproj), **KW)
    assert named.model.family == "idefics3" and named.fingerprint != plain.fingerprint
    args = build_parser().parse_args(["generate", "-m", str(text), "--no-mmproj", "-p", "x"])
    assert engine_from(args, progress=False).model.family == "llama"
    args = build_parser().parse_args(["generate", "-m", str(alone), "--mmproj", str(mmproj), "-p", "x"])
    assert engine_from(args, progress=False).model.family == "idefics3"
    shutil.copy(mmproj, tmp_path / "mmproj-a.gguf")
    shutil.copy(mmproj, tmp_path / "mmproj-b.gguf")
    with pytest.raises(ModelLoadError, match="several vision projectors"):
        Engine.load(str(alone), **KW)
    with pytest.raises(ModelLoadError, match="not a vision projector"):
        Engine.load(str(alone), mmproj=str(text), **KW)
    with pytest.raises(ModelLoadError, match="Hugging Face folder"):
        Engine.load(str(folder), mmproj=str(mmproj), **KW)
    with pytest.raises(ModelLoadError, match="pairs with a text GGUF of llama, not 'qwen3_5_text'"):
        Engine.load(str(FIXTURES / "qwen3_5" / "qwen3_5-f32.gguf"), mmproj=str(mmproj), **KW)


def test_a_projector_of_another_family_is_a_clear_error(tmp_path):
    """An mmproj of a family turnkv does not run (Pixtral's projector): refused by name, with the
    projector types turnkv reads."""
    import gguf

    text, _, _ = pair("smolvlm")
    path = tmp_path / "mmproj-pixtral.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "pixtral")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"unsupported vision projector type 'pixtral' \(supported: gemma3 "
                                             r"\(Gemma 3\), idefics3 .*lfm2 \(LFM2-VL\)"):
        Engine.load(str(text), mmproj=str(path), **KW)
