"""Make the quantized RWKV-7 fixtures with llama.cpp's own tools (a dev-time tool, not run by CI):

    python tests/gguf_fixtures/rwkv7_quant/make.py --llama-cpp PATH/TO/llama.cpp

- ``../rwkv7/rwkv7-q8_0.gguf``: the converter's ``q8_0`` output for the tiny folder beside the f32
  file (tests/test_gguf_families.py's Q8_0 column picks it up). The converter quantizes every matrix
  whose rows are whole Q8_0 blocks but the decay LoRA (``time_mix_w{1,2}``, kept F32) and writes the
  narrower ones (the LoRA up-projections of 8 and 16 inputs) as F16, so the in-context-rate, gate and
  value-residual LoRA are Q8_0 / F16 here: the low-rank projections on GGUF blocks.
- ``rwkv7-wide-q4_k_m.gguf``: a wider random model (hidden 256, so rows are whole 256-value
  K-quant super-blocks; the tiny one's 64 make llama-quantize fall back to Q5_0 / Q8_0) converted
  to F16 and quantized by ``llama-quantize Q4_K_M``: Q4_K projections and embedding, a Q6_K head,
  and the LoRA kept F16 as llama-quantize keeps RWKV's small matrices.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))           # convert.py
sys.path.insert(1, str(HERE.parent.parent))    # tests/: test_family_rwkv7.build
from convert import VOCAB, byte_tokenizer, convert  # noqa: E402

PATCH = ("conversion.rwkv.Rwkv7Model:gpt2",)
WIDE = dict(hidden_size=256, num_hidden_layers=2, head_dim=64, intermediate_size=256, decay_low_rank_dim=16,
            gate_low_rank_dim=16, a_low_rank_dim=16, v_low_rank_dim=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout with build/bin")
    args = ap.parse_args()
    from test_family_rwkv7 import build

    q8 = HERE.parent / "rwkv7" / "rwkv7-q8_0.gguf"
    convert(args.llama_cpp, HERE.parent / "rwkv7" / "hf", q8, "q8_0", PATCH)
    with tempfile.TemporaryDirectory() as tmp:
        folder, f16 = Path(tmp) / "hf", Path(tmp) / "wide-f16.gguf"
        torch.manual_seed(0)
        model = build(vocab_size=VOCAB, **WIDE)
        model.config.eos_token_id = 2
        model.save_pretrained(folder)
        byte_tokenizer(folder, VOCAB)
        convert(args.llama_cpp, folder, f16, "f16", PATCH)
        out = HERE / "rwkv7-wide-q4_k_m.gguf"
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(out), "Q4_K_M", "1"],
                       check=True)
    for f in (q8, out):
        print(f"{f}: {f.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
