"""Image processor settings as transformers 5 saves them (docs/images.md): a folder whose processor
was saved with ``processor.save_pretrained`` (processor_config.json with ``image_processor``, no
preprocessor_config.json), with settings away from the defaults, gives turnkv the prompt tokens and
greedy replies transformers gives on that folder over a multi-turn chat, reused turns equal to cold
ones. Settings turnkv cannot honour fail at load; two settings never share an encoder cache entry.

transformers 5.25 cannot build SmolVLMProcessor or Qwen3VLProcessor without torchvision (their
video processors' class check), so the SmolVLM folder is saved by Idefics3Processor, the image-only
twin (same layout: image_processor + image_seq_len; same image prompt), and the Qwen3.5-VL and
LFM2-VL folders are written in the layout ProcessorMixin.save_pretrained writes."""

from __future__ import annotations

import json

import pytest
import torch

from test_server_images import data_url
from tiny import greedy
from vision_chat import picture, tiny_lfm2_vl_config, tiny_qwen3_5_vl_config, tiny_smolvlm_config
from turnkv.engine.engine import Engine
from turnkv.images import is_key, last_image_end, model_ids
from turnkv.loading.errors import ModelLoadError
from turnkv.prompt_cache.store import PromptCache

IMAGE, FAKE, GLOBAL, EOU, BOS = 250, 251, 252, 253, 254


def word_tokenizer(words: dict, specials: dict, **kw):
    """A transformers fast tokenizer over whole words (w20 .. w99 and ``words``) and ``specials``."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(20, 100)}, **words, **specials}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()          # words joined by spaces
    backend.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **kw)


def engines(folder):
    kw = dict(progress=False, prefill_chunk=16, max_context=4096)
    return (Engine.load(str(folder), prompt_cache=PromptCache(1 << 30), **kw),
            Engine.load(str(folder), prompt_cache=PromptCache(0), **kw))


def processor_inputs(folder, nested_images: bool):
    """transformers' processor of the folder: (chat messages, pictures) -> model inputs."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(folder)

    def inputs(messages, pictures):
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return proc(text=prompt, images=([pictures] if nested_images else pictures), return_tensors="pt")
    return inputs


def chat_equals_transformers(folder, hf, hf_inputs, turns=4, max_tokens=6):
    """A ``turns``-turn chat with pictures in turns 1 and 3: every prompt (placeholders for keys) and
    greedy reply equal transformers' on the folder (``hf_inputs(messages, pictures)``), a reused turn
    equals a cold one and reuses the prompt up to its last picture, which is encoded once."""
    warm, cold = engines(folder)
    eos = sorted(warm.tokenizer.eos_token_ids)
    ours, theirs, pictures, prev, replies = [], [], [], None, []
    for t in range(turns):
        text = f"w{30 + t} w{40 + t} w{50 + t}"
        img = picture(t) if t in (0, 2) else None
        pictures += [img] if img else []
        ours.append({"role": "user", "content": ([{"type": "image_url", "image_url": {"url": data_url(img)}}]
                                                 if img else []) + [{"type": "text", "text": text}]})
        theirs.append({"role": "user",
                       "content": ([{"type": "image"}] if img else []) + [{"type": "text", "text": text}]})
        req, ref = warm.chat_request(ours), cold.chat_request(ours)
        req.params = ref.params = greedy(max_tokens)
        res, cres = warm.generate(req), cold.generate(ref)
        inputs = hf_inputs(theirs, pictures)
        want = inputs["input_ids"][0].tolist()
        assert model_ids(req.prompt_ids, warm.model.image_token_id) == want, f"turn {t + 1}"
        with torch.no_grad():
            gen = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos)
        assert res.token_ids == gen[0, len(want):].tolist(), f"turn {t + 1}"
        assert res.token_ids == cres.token_ids and res.text == cres.text
        if prev is not None:       # the previous prompt, its pictures included, is restored
            assert res.usage.cached_tokens >= last_image_end(prev) > 0, f"turn {t + 1}"
        prev = req.prompt_ids
        replies.append(len(res.token_ids))
        ours.append({"role": "assistant", "content": res.text})
        theirs.append({"role": "assistant", "content": [{"type": "text", "text": res.text}]})
    assert warm.encoder_cache.stats()["encoded"] == 2 and max(replies) > 2      # replies, not just an EOS
    return warm


# --- SmolVLM --------------------------------------------------------------------------------------

def smolvlm_folder(tmp_path, **image_kw):
    from transformers import Idefics3Processor, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    torch.manual_seed(0)
    cfg = tiny_smolvlm_config(IMAGE)
    hf = SmolVLMForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    rows = {f"<row_{r}_col_{c}>": 100 + (r - 1) * 8 + (c - 1) for r in range(1, 5) for c in range(1, 5)}
    tok = word_tokenizer({"\n": 10, "User": 11, "Assistant": 12, "System": 13, ":": 14, **rows},
                         {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL,
                          "<end_of_utterance>": EOU, "<|im_start|>": BOS},
                         bos_token="<|im_start|>", eos_token="<end_of_utterance>")
    kw = dict(do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
    Idefics3Processor(SmolVLMImageProcessorPil(**{**kw, **image_kw}), tok, image_seq_len=4,
                      chat_template=DEFAULT_CHAT_TEMPLATE).save_pretrained(tmp_path)
    return hf


def test_smolvlm_saved_by_transformers_5_chats_as_transformers(tmp_path):
    hf = smolvlm_folder(tmp_path)
    assert (tmp_path / "processor_config.json").is_file() and not (tmp_path / "preprocessor_config.json").exists()
    eng = chat_equals_transformers(tmp_path, hf, processor_inputs(tmp_path, nested_images=True))
    image = eng.model.prepare_image(picture(0))
    assert image.grid == (0, 0) and image.n_rows == 4         # one tile, not the default 4 x 4 grid + global


def test_smolvlm_settings_turnkv_cannot_honour_fail_at_load(tmp_path):
    smolvlm_folder(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    for change, needle in (({"image_seq_len": 9}, "image_seq_len=9"),
                           ({"image_processor": {**saved["image_processor"], "max_image_size": {"longest_edge": 64}}},
                            "max_image_size.longest_edge=64")):
        (tmp_path / "processor_config.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
            Engine.load(str(tmp_path), progress=False)


def test_processor_config_wins_over_preprocessor_config(tmp_path):
    """transformers reads processor_config.json's image_processor before preprocessor_config.json."""
    from turnkv.models.vision_settings import read_settings

    smolvlm_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_image_splitting": True}))
    settings = read_settings(tmp_path)
    assert settings.image["do_image_splitting"] is False and settings.processor == {"image_seq_len": 4}
    nested = json.loads((tmp_path / "processor_config.json").read_text())
    del nested["image_processor"]
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    settings = read_settings(tmp_path)
    assert settings.image == {"do_image_splitting": True} and settings.source == "preprocessor_config.json"


def test_two_settings_of_one_picture_never_share_an_encoder_cache_entry(tmp_path):
    """The same picture under two image_mean settings: two image ids, two encoder cache entries,
    each turn equal to a cold engine of its own folder."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    smolvlm_folder(tmp_path / "a")
    smolvlm_folder(tmp_path / "b", image_mean=[0.2, 0.3, 0.4])
    a, cold_a = engines(tmp_path / "a")
    b, _ = engines(tmp_path / "b")
    img = picture(5)
    ia, ib = a.model.prepare_image(img), b.model.prepare_image(img)
    assert not torch.equal(ia.pixel_values, ib.pixel_values)
    assert ia.digest != ib.digest and ia.image_id != ib.image_id
    # one encoder cache seeing the picture under both settings: two entries, no false hit
    cache = a.encoder_cache
    ea = cache.get_or_encode(ia, a.model.encode_image)
    eb = cache.get_or_encode(ib, b.model.encode_image)
    assert cache.stats()["entries"] == 2 and cache.stats()["hits"] == 0
    assert not torch.equal(ea, eb)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                         {"type": "text", "text": "w30 w31"}]}]
    req = a.chat_request(msgs)
    req.params = greedy(4)
    ref = cold_a.chat_request(msgs)
    ref.params = greedy(4)
    assert a.generate(req).token_ids == cold_a.generate(ref).token_ids
    assert sum(map(is_key, req.prompt_ids)) == ia.n_rows


# --- Gemma 3 --------------------------------------------------------------------------------------

def gemma3_folder(tmp_path, **image_kw):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from turnkv.loading.tokenizer import shipped_template

    torch.manual_seed(0)
    boi, eoi, soft = 240, 241, 242
    cfg = Gemma3Config(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=4),
        mm_tokens_per_image=16, image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    tok = word_tokenizer({"\n": 10, "user": 11, "model": 12},
                         {"<bos>": 2, "<eos>": 1, "<start_of_turn>": 243, "<end_of_turn>": 244,
                          "<start_of_image>": boi, "<end_of_image>": eoi, "<image_soft_token>": soft},
                         bos_token="<bos>", eos_token="<end_of_turn>",
                         extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"})
    kw = dict(size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3], image_std=[0.5, 0.6, 0.7], resample=3)
    Gemma3Processor(Gemma3ImageProcessorPil(**{**kw, **image_kw}), tok, chat_template=shipped_template("gemma3"),
                    image_seq_length=16).save_pretrained(tmp_path)
    return hf


def test_gemma3_saved_by_transformers_5_chats_as_transformers(tmp_path):
    hf = gemma3_folder(tmp_path)
    assert (tmp_path / "processor_config.json").is_file() and not (tmp_path / "preprocessor_config.json").exists()
    eng = chat_equals_transformers(tmp_path, hf, processor_inputs(tmp_path, nested_images=False))
    assert eng.model.processor.resample == 3 and list(eng.model.processor.image_mean) == [0.5, 0.4, 0.3]


def test_gemma3_settings_turnkv_cannot_honour_fail_at_load(tmp_path):
    gemma3_folder(tmp_path, do_pan_and_scan=True)
    with pytest.raises(ModelLoadError, match="do_pan_and_scan=True"):
        Engine.load(str(tmp_path), progress=False)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    saved["image_processor"]["do_pan_and_scan"] = None
    (tmp_path / "processor_config.json").write_text(json.dumps({**saved, "image_seq_length": 64}))
    with pytest.raises(ModelLoadError, match="image_seq_length=64"):
        Engine.load(str(tmp_path), progress=False)


# --- Qwen3.5-VL ------------------------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def qwen3_5_vl_folder(tmp_path, **image_kw):
    """Written as ProcessorMixin.save_pretrained writes Qwen3VLProcessor's processor_config.json
    (the image processor's to_dict under image_processor)."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(tiny_qwen3_5_vl_config(IMAGE, FAKE, GLOBAL)).eval()
    hf.save_pretrained(tmp_path)
    tok = word_tokenizer({"\n": 10, "user": 11, "assistant": 12},
                         {"<|image_pad|>": IMAGE, "<|vision_start|>": FAKE, "<|vision_end|>": GLOBAL,
                          "<|im_end|>": EOU, "<|im_start|>": BOS}, eos_token="<|im_end|>")
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(tmp_path)
    kw = dict(patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.4, 0.5, 0.6],
              size={"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 12})
    image = Qwen2VLImageProcessorPil(**{**kw, **image_kw}).to_dict()
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": image,
                                                                "processor_class": "Qwen3VLProcessor"}))
    return hf


def qwen_inputs(folder):
    """Qwen3VLProcessor's steps: the folder's image processor (read by transformers), one
    <|image_pad|> per merged patch, the tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # the word-level test tokenizer (AutoTokenizer would pick Qwen's BPE class for this config)
    images, tok = Qwen2VLImageProcessorPil.from_pretrained(folder), PreTrainedTokenizerFast.from_pretrained(folder)

    def inputs(messages, pictures):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pix = images(images=pictures, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        counts = [int(g.prod()) // images.merge_size ** 2 for g in pix["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:]))
        ids = tok(text, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).long(), **pix}
    return inputs


def test_qwen3_5_vl_saved_in_the_transformers_5_layout_chats_as_transformers(tmp_path):
    hf = qwen3_5_vl_folder(tmp_path)
    assert not (tmp_path / "preprocessor_config.json").exists()
    eng = chat_equals_transformers(tmp_path, hf, qwen_inputs(tmp_path))
    assert eng.model.processor.size["longest_edge"] == 8 * 8 * 12 and list(eng.model.processor.image_mean) == [
        0.4, 0.5, 0.6]


def test_qwen3_5_vl_settings_turnkv_cannot_honour_fail_at_load(tmp_path):
    qwen3_5_vl_folder(tmp_path, merge_size=4)
    with pytest.raises(ModelLoadError, match="merge_size=4"):
        Engine.load(str(tmp_path), progress=False)


# --- LFM2-VL ---------------------------------------------------------------------------------------

LFM_PREP = dict(tile_size=32, encoder_patch_size=4, min_image_tokens=4, max_image_tokens=16, downsample_factor=2,
                do_image_splitting=False, image_mean=[0.4, 0.5, 0.6])


def lfm2_vl_folder(tmp_path, **image_kw):
    """Written as ProcessorMixin.save_pretrained writes Lfm2VlProcessor's processor_config.json
    (transformers' Lfm2VlImageProcessor needs torchvision, which turnkv does not depend on)."""
    from transformers import Lfm2VlForConditionalGeneration

    torch.manual_seed(0)
    cfg = tiny_lfm2_vl_config(IMAGE)
    hf = Lfm2VlForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    tok = word_tokenizer({"\n": 10, "user": 11, "assistant": 12},
                         {"<image>": IMAGE, "<|image_start|>": FAKE, "<|image_end|>": GLOBAL, "<|img_thumbnail|>": 249,
                          "<|im_end|>": EOU, "<|im_start|>": BOS}, eos_token="<|im_end|>")
    tok.chat_template = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    tok.save_pretrained(tmp_path)
    image = {"image_processor_type": "Lfm2VlImageProcessor", "do_resize": True, "resample": 2, "do_pad": True,
             "data_format": "channels_first", "do_center_crop": None, **LFM_PREP, **image_kw}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": image,
                                                                "processor_class": "Lfm2VlProcessor"}))
    return hf


def lfm2_inputs(folder):
    """Lfm2VlProcessor's steps: the chat template, each <image> expanded by transformers'
    _build_image_tokens, the tokenizer; the pixels are turnkv's port of the image processor."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    model = Engine.load(str(folder), progress=False).model
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    names = SimpleNamespace(image_start_token="<|image_start|>", image_end_token="<|image_end|>",
                            image_thumbnail_token="<|img_thumbnail|>", image_token="<image>")

    def inputs(messages, pictures):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ims = [model.prepare_image(p) for p in pictures]
        expanded = []
        for im in ims:
            (rows, cols), (h, w) = im.grid, im.extra["resized"]
            expanded.append(Lfm2VlProcessor._build_image_tokens(names, rows, cols, 16, (h // 8) * (w // 8), True,
                                                                True))
        parts = text.split("<image>")
        text = parts[0] + "".join(e + rest for e, rest in zip(expanded, parts[1:]))
        return {"input_ids": tok(text, return_tensors="pt")["input_ids"],
                "pixel_values": torch.cat([im.pixel_values for im in ims]),
                "pixel_attention_mask": torch.cat([im.pixel_mask for im in ims]),
                "spatial_shapes": torch.cat([im.extra["spatial_shapes"] for im in ims])}
    return inputs


def test_lfm2_vl_saved_in_the_transformers_5_layout_chats_as_transformers(tmp_path):
    hf = lfm2_vl_folder(tmp_path)
    eng = chat_equals_transformers(tmp_path, hf, lfm2_inputs(tmp_path))
    prep = eng.model.prep
    assert (prep.do_image_splitting, prep.tile_size, prep.max_image_tokens, list(prep.image_mean)) == (
        False, 32, 16, [0.4, 0.5, 0.6])
    assert eng.model.prepare_image(picture(1, (100, 150))).grid == (1, 1)     # splitting off: no 2 x 3 grid


@pytest.mark.parametrize("change, needle", [({"do_center_crop": True}, "do_center_crop=True"),
                                            ({"resample": 3}, "resample=3"),
                                            ({"encoder_patch_size": 8}, "encoder_patch_size=8"),
                                            ({"pan_and_zoom": 2}, "pan_and_zoom=2")])
def test_lfm2_vl_settings_turnkv_cannot_honour_fail_at_load(tmp_path, change, needle):
    lfm2_vl_folder(tmp_path, **change)
    with pytest.raises(ModelLoadError, match=needle):
        Engine.load(str(tmp_path), progress=False)
