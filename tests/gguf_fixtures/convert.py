"""Make the GGUF test fixtures with llama.cpp's own converter (a dev-time tool, not run by CI).

A family's GGUF loader is only worth something if it reads the layout llama.cpp writes, so the
fixtures come from llama.cpp's `convert_hf_to_gguf.py`, never from a writer of ours:

    python tests/gguf_fixtures/convert.py --llama-cpp PATH/TO/llama.cpp FAMILY [FAMILY ...]

For each family it builds the tiny random transformers model its `make_<family>` function in
`tests/gguf_fixtures/families.py` returns, saves it under `tests/gguf_fixtures/<family>/hf/`
(safetensors, the reference the tests compare with) and converts that folder to
`tests/gguf_fixtures/<family>/<family>-f32.gguf` (and `-q8_0.gguf` when asked).

The only liberty taken with the converter is the vocabulary: a tiny random model has a 320-token
vocabulary that no released tokenizer matches, so the folder gets a byte-level BPE tokenizer of
exactly that size and the converter is told its pre-tokenizer is GPT-2's (the hash check it does
to recognise released tokenizers cannot know a test tokenizer). Tensor names, shapes, permutes,
norm offsets, expert stacking and metadata keys are all the converter's own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VOCAB = 320


def byte_tokenizer(folder: Path, vocab_size: int = VOCAB, specials=("<pad>", "<s>", "</s>")) -> None:
    """A byte-level BPE tokenizer.json of exactly `vocab_size` tokens: the specials, then byte
    tokens and merges from a fixed text until the size is reached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ("the quick brown fox jumps over the lazy dog; a chat turn re-sends the whole history "
            "and the server restores what it computed before. ") * 50
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[1], "eos_token": specials[2],
        "pad_token": specials[0], "model_max_length": 4096,
    }))


_RUNNER = r'''
import sys
sys.path.insert(0, {llama!r})
sys.path.insert(1, {gguf_py!r})
import conversion.base as base
# A test tokenizer: its pre-tokenizer named (see tests/gguf_fixtures/convert.py).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
for extra in {vocab_patches!r}:
    cls_path, method = extra.split(":")
    mod, cls = cls_path.rsplit(".", 1)
    import importlib
    setattr(getattr(importlib.import_module(mod), cls), "set_vocab", lambda self: self._set_vocab_gpt2())
sys.argv = ["convert_hf_to_gguf.py", {folder!r}, "--outfile", {out!r}, "--outtype", {outtype!r}] + {extra_args!r}
import runpy
runpy.run_path({script!r}, run_name="__main__")
'''


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str = "f32", vocab_patches: tuple = (),
            mmproj: bool = False, pre: str = "gpt-2") -> None:
    """Run llama.cpp's converter on `folder`. `vocab_patches`: "module.Class:gpt2" entries whose
    set_vocab reads a sentencepiece or other tokenizer the test folder does not have; they are
    pointed at the converter's own GPT-2-style vocabulary writer instead. `mmproj`: write the
    vision tower and projector (the converter's ``--mmproj``) instead of the text model. `pre`: the
    pre-tokenizer name written (a released tokenizer's, e.g. "smollm", when the folder holds one)."""
    code = _RUNNER.format(llama=str(llama_cpp), gguf_py=str(llama_cpp / "gguf-py"), folder=str(folder),
                          out=str(out), outtype=outtype, script=str(llama_cpp / "convert_hf_to_gguf.py"),
                          vocab_patches=list(vocab_patches), pre=pre, extra_args=["--mmproj"] if mmproj else [])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp)


def released_config_view(folder: Path, overrides: dict, out: Path) -> Path:
    """`folder` as the converter should see it when its class was written for a released
    checkpoint's config.json that transformers' own config class does not round-trip (a model's
    ``released_config``: keys merged over the saved config.json, e.g. a remote-code model_type, so
    the converter reads the file itself as it does for such checkpoints). The other files are links."""
    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **overrides}, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout")
    ap.add_argument("--q8", action="store_true", help="also write a Q8_0 file")
    ap.add_argument("families", nargs="+")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent))     # tests/: tiny.py's shared builders
    families = importlib.import_module("families")
    for name in args.families:
        spec = getattr(families, f"make_{name}")
        hf_model, vocab_patches = spec()
        folder = HERE / name / "hf"
        folder.mkdir(parents=True, exist_ok=True)
        hf_model.save_pretrained(folder)
        # a family whose tokenizer class adds its own specials (transformers maps qwen2 to
        # Qwen2Tokenizer, which appends <|endoftext|>) names them, so the vocabulary keeps its size
        specials = getattr(hf_model, "tokenizer_specials", ("<pad>", "<s>", "</s>"))
        byte_tokenizer(folder, hf_model.config.get_text_config().vocab_size, specials)
        with tempfile.TemporaryDirectory() as tmp:
            source = folder
            if released := getattr(hf_model, "released_config", None):
                source = released_config_view(folder, released, Path(tmp) / "hf")
            for outtype in ("f32", "q8_0") if args.q8 else ("f32",):
                out = HERE / name / f"{name}-{outtype}.gguf"
                convert(args.llama_cpp, source, out, outtype, vocab_patches)
                print(f"{out.relative_to(ROOT)}: {out.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
