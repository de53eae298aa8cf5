"""Make the vision GGUF fixtures with llama.cpp's own converter (a dev-time tool, not run by CI):

    python tests/gguf_fixtures/vision.py --llama-cpp PATH/TO/llama.cpp FAMILY [FAMILY ...]

For each family (smolvlm, ...) it builds the tiny random transformers vision model of
tests/vision_chat.py (the text vocabulary widened to convert.py's byte tokenizer), saves it with its
image processor under `tests/gguf_fixtures/<family>_vision/hf/` (the reference the tests compare
with), and converts that folder twice, as users of GGUF engines get vision models: the text model
(`<family>_vision-f32.gguf`) and the vision tower + projector (`mmproj-<family>_vision-f32.gguf`,
the converter's `--mmproj`). The folder's config is shown to the converter as released checkpoints
write it where transformers 5 leaves a key out (`released_text_config`: SmolVLM's text
architecture), as convert.py does for remote-code configs.
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
