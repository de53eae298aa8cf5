"""Make the vision GGUF fixtures with llama.cpp's own converter (a dev-time tool, not run by CI):

    python tests/gguf_fixtures/vision.py --llama-cpp PATH/TO/llama.cpp FAMILY [FAMILY ...]

For each family (smolvlm, gemma3, lfm2, qwen3_5) it builds the tiny random transformers vision
model of tests/vision_chat.py (Gemma 3's here, as its family test builds it; LFM2-VL's tower resized
for the converter; the text vocabulary widened to convert.py's byte tokenizer), saves it with its
image processor under `tests/gguf_fixtures/<family>_vision/hf/` (the reference the tests compare
with), and converts that folder twice, as users of GGUF engines get vision models: the text model
(`<family>_vision-f32.gguf`) and the vision tower + projector (`mmproj-<family>_vision-f32.gguf`,
the converter's `--mmproj`). The folder is shown to the converter as released checkpoints write it
where transformers 5 saves otherwise (SmolVLM's and LFM2-VL's text architecture, the Gemma 3 and
LFM2-VL towers' tensor names), as convert.py does for remote-code configs; what a GGUF cannot say is
set as released checkpoints and llama.cpp have it (each make_* says what).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))     # tests/: vision_chat.py's tiny configs

from convert import ROOT, VOCAB, byte_tokenizer, convert  # noqa: E402
from families import perturb  # noqa: E402

# the byte tokenizer's specials (ids 0, 1, ...; bos, eos second and third): a SmolVLM vocabulary's
# chat and image tokens, which the GGUF side finds by name
SMOLVLM_SPECIALS = ("<pad>", "<|im_start|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>",
                    "<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)))


def make_smolvlm(folder: Path):
    """Tiles of 32 px, images up to 64 px (a 2 x 2 grid + the global tile, 4 rows each). Returns the
    text_config keys a released SmolVLM has and transformers 5 does not save."""
    from transformers import SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE
    from vision_chat import tiny_smolvlm_config

    torch.manual_seed(0)
    cfg = tiny_smolvlm_config(SMOLVLM_SPECIALS.index("<image>"))
    cfg.text_config.vocab_size = VOCAB
    hf = perturb(SmolVLMForConditionalGeneration(cfg))
    hf.save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(folder)
    byte_tokenizer(folder, VOCAB, SMOLVLM_SPECIALS)
    with_template(folder, DEFAULT_CHAT_TEMPLATE)
    return {"architectures": ["VLlama3ForCausalLM"]}


GEMMA3_SPECIALS = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "<end_of_image>", "<image_soft_token>")


def make_gemma3(folder: Path):
    """SigLIP on 32 px images in 4 px patches, pooled to 16 image tokens; text window 16. The
    processor's image_seq_length (16) sits in processor_config.json, where the converter reads it.
    What a Gemma 3 GGUF cannot say is as released checkpoints have it: every sixth layer global
    (llama.cpp's fixed pattern), query_pre_attn_scalar = head_dim (its attention scale)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from turnkv.loading.tokenizer import shipped_template

    torch.manual_seed(0)
    ids = {t: GEMMA3_SPECIALS.index(t) for t in GEMMA3_SPECIALS}
    cfg = Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=16, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=4),
        mm_tokens_per_image=16, image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"])
    hf = perturb(Gemma3ForConditionalGeneration(cfg))
    with torch.no_grad():
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    hf.save_pretrained(folder)
    released_names(folder, "vision_tower.", "vision_tower.vision_model.")
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
                            image_std=[0.5, 0.6, 0.7]).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 16,
                                                              "processor_class": "Gemma3Processor"}))
    byte_tokenizer(folder, VOCAB, GEMMA3_SPECIALS)
    with_template(folder, shipped_template("gemma3"))
    return {}


QWEN3_5_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|image_pad|>")


def make_qwen3_5(folder: Path):
    """4 px patches merged 2 x 2, a 4 x 4 position table, M-RoPE over t / h / w. The image processor
    keeps the pixel range an mmproj implies (llama.cpp's: 8 to 4096 merged tokens an image)."""
    from transformers import Qwen3_5ForConditionalGeneration
    from test_server_images_qwen3_5_vl import TEMPLATE
    from vision_chat import tiny_qwen3_5_vl_config

    torch.manual_seed(0)
    ids = {t: QWEN3_5_SPECIALS.index(t) for t in QWEN3_5_SPECIALS}
    cfg = tiny_qwen3_5_vl_config(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    # as released configs and llama.cpp's qwen35 loader have them: an MTP block counted (transformers
    # saves no MTP weights), key and value head sizes of the delta-net equal
    cfg.text_config.vocab_size, cfg.text_config.mtp_num_hidden_layers = VOCAB, 1
    cfg.text_config.linear_value_head_dim = cfg.text_config.linear_key_head_dim
    hf = perturb(Qwen3_5ForConditionalGeneration(cfg))
    hf.save_pretrained(folder)
    area = (4 * 2) ** 2
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 8 * area, "max_pixels": 4096 * area, "image_mean": [0.5, 0.4, 0.3],
        "image_std": [0.5, 0.6, 0.7]}))
    byte_tokenizer(folder, VOCAB, QWEN3_5_SPECIALS)
    with_template(folder, TEMPLATE)
    return {}


LFM2_SPECIALS = ("<|pad|>", "<|startoftext|>", "<|im_end|>", "<|im_start|>", "<image>", "<|image_start|>",
                 "<|image_end|>", "<|img_thumbnail|>", *(f"<|img_row_{r}_col_{c}|>" for r in range(1, 4) for c in range(1, 4)))


def make_lfm2(folder: Path):
    """LFM2-VL: conv, attention, conv; SigLIP 2 NaFlex of 3 layers (the converter's tensor map only
    names projector layers up to the tower's depth) in 16 px patches (it reshapes the patch
    embedding for 16 px only), downsample 2. The processor keeps its defaults, which are llama.cpp's
    fixed LFM2 preprocessing (512 px tiles, 64 to 256 image tokens)."""
    from transformers import Lfm2VlForConditionalGeneration
    from test_server_images_qwen3_5_vl import TEMPLATE
    from vision_chat import tiny_lfm2_vl_config

    torch.manual_seed(0)
    cfg = tiny_lfm2_vl_config(LFM2_SPECIALS.index("<image>"))
    cfg.text_config.vocab_size = VOCAB
    cfg.vision_config.patch_size, cfg.vision_config.num_hidden_layers = 16, 3
    cfg.vision_config.vision_use_head = False                 # as released: no pooling head
    cfg.text_config.block_auto_adjust_ff_dim = False          # a 128-wide MLP, not rounded up to 256
    hf = perturb(Lfm2VlForConditionalGeneration(cfg))
    hf.save_pretrained(folder)
    released_names(folder, "model.vision_tower.", "model.vision_tower.vision_model.")
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True,
        "image_processor": {"image_processor_type": "Lfm2VlImageProcessor", "encoder_patch_size": 16,
                            "downsample_factor": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}))
    byte_tokenizer(folder, VOCAB, LFM2_SPECIALS)
    with_template(folder, TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>"))
    return {"architectures": ["Lfm2ForCausalLM"]}


def released_names(folder: Path, old: str, new: str) -> None:
    """Rename the saved tensors ``old``* to ``new``*: the layout released checkpoints ship (and the
    converter's tensor map knows) where transformers 5 saves another (Gemma 3's vision tower).
    transformers and turnkv load both."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})


def with_template(folder: Path, template: str) -> None:
    """The family's chat template in tokenizer_config.json, where the converter reads it."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))


def converter_view(folder: Path, text_overrides: dict, out: Path) -> Path:
    """``folder`` with ``text_overrides`` merged into config.json's text_config (other files linked)."""
    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    config["text_config"] = {**config.get("text_config", {}), **text_overrides}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout")
    ap.add_argument("families", nargs="+")
    args = ap.parse_args()
    for family in args.families:
        name = f"{family}_vision"
        folder = HERE / name / "hf"
        folder.mkdir(parents=True, exist_ok=True)
        text_overrides = globals()[f"make_{family}"](folder)
        with tempfile.TemporaryDirectory() as tmp:
            source = converter_view(folder, text_overrides, Path(tmp) / "hf") if text_overrides else folder
            for out, mmproj in ((HERE / name / f"{name}-f32.gguf", False),
                                (HERE / name / f"mmproj-{name}-f32.gguf", True)):
                convert(args.llama_cpp, source, out, "f32", mmproj=mmproj)
                print(f"{out.relative_to(ROOT)}: {out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
