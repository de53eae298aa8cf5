"""Image turns and reuse: a 6-turn chat with one image in turn 1, per vision family, cache on vs off.

Each family is a random model (transformers builds it with random weights and ``save_pretrained``
writes it, turnkv loads the folder as it loads a real one). The chat: a system prompt, turn 1 = an
image + a user message, turns 2..N text only, each turn re-sending the whole history (system, the
image, users and the model's own replies, as chat clients do). The same prompts go to an engine
with the prompt cache and to one without (alternating, so machine load hits both alike). Tiny
weights make absolute times small, so the table gives ratios: TTFT with / without the cache per
turn, the share of the prompt reused (image tokens included) and the image encoder's time.
Goal (issue 13): turns 2+ reuse >= 90% of the prompt and TTFT with the cache <= 20% of without.

    python bench/multimodal.py                       # every vision family, 6 turns
    python bench/multimodal.py --families gemma3 --turns 3 --hidden 256
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench.machine import cpu_model  # noqa: E402
from turnkv.engine.engine import Engine, GenerationRequest  # noqa: E402
from turnkv.engine.sampling import SamplingParams  # noqa: E402
from turnkv.loading import load_checkpoint  # noqa: E402
from turnkv.models import family_class  # noqa: E402
from turnkv.prompt_cache.store import PromptCache  # noqa: E402

VOCAB = 4096
IMAGE, FAKE, GLOBAL, BOI, EOI, NL = 4000, 4001, 4002, 4003, 4004, 10
GOAL_REUSE, GOAL_TTFT = 0.90, 0.20


def text_config(layers: int, hidden: int, **kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                max_position_embeddings=8192, **kw)


def build(family: str, layers: int, hidden: int, folder: Path) -> None:
    torch.manual_seed(0)
    vision = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3)
    if family == "smolvlm":
        from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        cfg = SmolVLMConfig(text_config=dict(model_type="llama", **text_config(layers, hidden)),
                            vision_config=dict(vision, image_size=128, patch_size=16), scale_factor=2,
                            image_token_id=IMAGE)
        SmolVLMForConditionalGeneration(cfg).save_pretrained(folder)
        # 256 px images in 128 px tiles: 2 x 2 tiles + the global one, 16 rows each (80 image tokens)
        SmolVLMImageProcessorPil(size={"longest_edge": 256},
                                 max_image_size={"longest_edge": 128}).save_pretrained(folder)
    elif family == "gemma3":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        window = 256
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg = Gemma3Config(text_config=text_config(layers, hidden, head_dim=64, sliding_window=window,
                                                   layer_types=types),
                           vision_config=dict(vision, image_size=224, patch_size=14),
                           mm_tokens_per_image=64, image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
        Gemma3ForConditionalGeneration(cfg).save_pretrained(folder)
        Gemma3ImageProcessorPil(size={"height": 224, "width": 224}, image_mean=[0.5] * 3,
                                image_std=[0.5] * 3).save_pretrained(folder)
    elif family == "lfm2_vl":
        import json

        from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

        types = [("full_attention" if i % 3 == 2 else "conv") for i in range(layers)]
        cfg = Lfm2VlConfig(text_config=text_config(layers, hidden, layer_types=types),
                           vision_config=dict(vision, patch_size=16, num_patches=256), image_token_id=IMAGE,
                           projector_hidden_size=hidden * 2)
        Lfm2VlForConditionalGeneration(cfg).save_pretrained(folder)
        # 256 px tiles of 16 px patches, 16..64 tokens per image (real checkpoints: 512 px, 64..256)
        (folder / "preprocessor_config.json").write_text(json.dumps(dict(
            tile_size=256, encoder_patch_size=16, min_image_tokens=16, max_image_tokens=64, downsample_factor=2)))
    elif family == "qwen3_5_vl":
        import json

        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [4, 2, 2], "mrope_interleaved": True}   # 16 rotary dims of 64: 8 t / h / w pairs
        text = text_config(layers, hidden, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                           linear_num_key_heads=max(1, hidden // 128), linear_num_value_heads=hidden // 64,
                           rope_parameters=rope)
        cfg = Qwen3_5Config(text_config=text, image_token_id=IMAGE, vision_start_token_id=BOI,
                            vision_end_token_id=EOI,
                            vision_config=dict(depth=4, hidden_size=192, intermediate_size=768, num_heads=3,
                                               out_hidden_size=hidden, patch_size=16, spatial_merge_size=2,
                                               temporal_patch_size=2, num_position_embeddings=256))
        Qwen3_5ForConditionalGeneration(cfg).save_pretrained(folder)
        # 16 px patches merged 2 x 2: 32 px per image token, up to 64 tokens (256 x 256 px)
        (folder / "preprocessor_config.json").write_text(json.dumps(dict(
            patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=16 * 32 * 32, max_pixels=64 * 32 * 32)))
    else:
        raise SystemExit(f"unknown vision family {family!r} (smolvlm, gemma3, lfm2_vl, qwen3_5_vl)")


def image_tokens(family: str, model, image) -> list[int]:
    """The image's prompt tokens as the family's processor expands it, keys in place of <image>."""
    keys = image.keys()
    if family == "qwen3_5_vl":   # <|vision_start|> <|image_pad|>* <|vision_end|>
        return [BOI] + keys + [EOI]
    if family == "gemma3":
        return [NL, NL, BOI] + keys + [EOI, NL, NL]
    if family == "lfm2_vl":      # <|image_start|> [<|img_row_r_col_c|> tile]* [<|img_thumbnail|>] image <|image_end|>
        rows, cols = image.grid
        per = (model.prep.tile_size // model.prep.encoder_patch_size // model.factor) ** 2 if rows * cols > 1 else 0
        out = [BOI]
        for t in range(rows * cols if per else 0):
            out += [100 + t] + keys[t * per:(t + 1) * per]
        return out + ([GLOBAL] if per else []) + keys[rows * cols * per:] + [EOI]
    per, (rows, cols) = model.tile_rows, image.grid
    out, tile = [], 0
    for r in range(rows):
        for c in range(cols):
            out += [FAKE, 100 + r * 8 + c] + keys[tile * per:(tile + 1) * per]
            tile += 1
        out.append(NL)
    return out + [NL, FAKE, GLOBAL] + keys[tile * per:(tile + 1) * per] + [FAKE]


def run(family: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        build(family, args.layers, args.hidden, Path(tmp))
        ckpt = load_checkpoint(tmp, dtype=torch.float32, progress=False)
        model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
        model.load_processor(tmp)
    from PIL import Image
    picture = Image.fromarray(np.random.RandomState(0).randint(0, 255, (300, 260, 3), dtype=np.uint8))
    image = model.prepare_image(picture)
    rng = random.Random(1)
    words = lambda n: [rng.randrange(11, 3900) for _ in range(n)]  # noqa: E731
    system = words(args.system)
    first = system + image_tokens(family, model, image) + words(args.user)
    users = [words(args.user) for _ in range(args.turns - 1)]
    # off: neither the prompt cache nor the encoder cache (every turn encodes and prefills it all)
    engines = {on: Engine(model, None, fingerprint=f"bench-{family}", max_context=8192,
                          prompt_cache=PromptCache((1 << 30) if on else 0), image_cache_mb=256 if on else 0)
               for on in (True, False)}
    rows, prompt, reply = [], list(first), None
    for t in range(args.turns):
        if t:
            prompt = prompt + reply + users[t - 1] + [NL]
        # reusable: all but the new user message (the previous turn's state ends right before it)
        new = len(users[t - 1]) + 1 if t else len(prompt)
        row = {"turn": t + 1, "prompt": len(prompt), "reusable": len(prompt) - new}
        for on in (True, False):
            eng = engines[on]
            enc0 = eng.encoder_cache.stats()["encode_ms"]
            params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
            req = GenerationRequest(list(prompt), params, [len(system)], images={image.image_id: image})
            res = eng.generate(req)
            key = "on" if on else "off"
            row[f"ttft_{key}"] = res.stats.ttft_ms
            row[f"enc_{key}"] = eng.encoder_cache.stats()["encode_ms"] - enc0
            if on:
                row["cached"] = res.usage.cached_tokens
                reply = res.token_ids[:-1]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="smolvlm,gemma3,lfm2_vl,qwen3_5_vl")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--system", type=int, default=300, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=60, help="tokens per user message")
    ap.add_argument("--reply", type=int, default=16, help="generated tokens per turn")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}; text {args.layers} layers x {args.hidden}, "
          f"{args.turns} turns, reply {args.reply} tokens")
    for family in args.families.split(","):
        rows = run(family, args)
        print(f"\n{family}")
        print("| turn | prompt | reused | reused of reusable | TTFT on / off | encoder ms on | encoder ms off "
              "| encoder share of TTFT off |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            of = f"{r['cached'] / r['reusable']:.0%}" if r["reusable"] else "-"
            print(f"| {r['turn']} | {r['prompt']} | {r['cached'] / r['prompt']:.0%} | {of} "
                  f"| {r['ttft_on'] / r['ttft_off']:.2f} "
                  f"| {r['enc_on']:.1f} | {r['enc_off']:.1f} | {r['enc_off'] / r['ttft_off']:.0%} |")
        later = rows[1:]
        if later:
            reuse = min(r["cached"] / r["prompt"] for r in later)
            ttft = max(r["ttft_on"] / r["ttft_off"] for r in later)
            print(f"turns 2+: reuse >= {reuse:.0%} of the prompt (goal {GOAL_REUSE:.0%}: "
                  f"{'met' if reuse >= GOAL_REUSE else 'NOT met'}), TTFT on/off <= {ttft:.2f} (goal {GOAL_TTFT:.2f}: "
                  f"{'met' if ttft <= GOAL_TTFT else 'NOT met'})")


if __name__ == "__main__":
    main()
