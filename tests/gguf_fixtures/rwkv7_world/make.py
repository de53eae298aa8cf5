"""Make rwkv7-world-f16.gguf: a tiny random RWKV-7 whose tokenizer is RWKV's real world vocabulary
(a dev-time tool, not run by CI):

    python tests/gguf_fixtures/rwkv7_world/make.py --llama-cpp PATH/TO/llama.cpp

Unlike the other fixtures, the converter's own vocabulary writer runs unpatched: it reads
``rwkv_vocab_v20230424.txt`` (copied from BlinkDL's ``rwkv`` package, the reference tokenizer) from
the model folder, as it does for a released fla-hub checkpoint. The vocabulary fixes the embedding at
65536 rows, so the model is as small as RWKV-7 allows (one layer, one 8-wide head, f16) to keep the
file near 3.5 MB; its weights are random, only the tokenizer is under test.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from convert import convert  # noqa: E402


def build():
    from rwkv7_hf import RWKV7Config, RWKV7ForCausalLM

    torch.manual_seed(0)
    config = RWKV7Config(vocab_size=65536, hidden_size=8, num_hidden_layers=1, head_dim=8,
                         decay_low_rank_dim=8, gate_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=8,
                         intermediate_size=16, initializer_range=0.1,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return RWKV7ForCausalLM(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout")
    args = ap.parse_args()
    import rwkv

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        build().save_pretrained(folder)
        shutil.copy(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt", folder)
        out = HERE / "rwkv7-world-f16.gguf"
        convert(args.llama_cpp, folder, out, "f16")
        print(f"{out}: {out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
