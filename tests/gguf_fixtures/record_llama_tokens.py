"""Record llama.cpp's token ids for a mixed corpus on every bundled and fixture GGUF (a dev-time
tool, not run by CI: it needs llama.cpp's `llama-tokenize`):

    python tests/gguf_fixtures/record_llama_tokens.py --llama-tokenize PATH/TO/llama-tokenize

writes tests/gguf_fixtures/llama_cpp_tokens.json: for each GGUF, the ids llama.cpp gives each
text of the corpus (no BOS, special-token text not parsed), which tests/test_gguf_tokenizer.py
holds turnkv's tokenizer to. The corpus mixes code, runs of spaces and tabs, digits, several
scripts and emoji, and for the bundled models the GPL-3 text Debian ships
(/usr/share/common-licenses/GPL-3).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "llama_cpp_tokens.json"
GPL3 = Path("/usr/share/common-licenses/GPL-3")

CORPUS = [
    "Version 3,  29 June 2007",
    "a  1  22   333    4444",
    "def f(x):\n    return x**2  # square\n\n\tif x > 10:  pass\n",
    "   leading spaces and trailing   ",
    "numbers: 1 12 123 1234 12345 3.14159 1,000,000 2024-12-06 0x1F",
    "Ünïcödé façade naïve — “quotes” ‘single’ … ½",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 😀👍🏽 🇫🇷 ❤️ 🧑‍💻",
    "Русский текст и العربية والعبرית",
    "tabs\tand\r\nwindows\r\n\r\nlines\n\n\n",
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    '{"key": [1, 2, 3], "url": "https://example.com/a?b=c&d=e"}',
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


def ggufs() -> dict[str, Path]:
    """name -> path: the bundled models and the converter-made fixtures."""
    from turnkv.loading.bundled import locate_bundled
    from turnkv.registry import BUNDLED

    out = {name: Path(locate_bundled(name)) for name in BUNDLED}
    for path in sorted(HERE.glob("*/*-f32.gguf")):
        if not path.name.startswith("mmproj"):       # a vision projector has no tokenizer
            out[f"fixture:{path.parent.name}"] = path
    return out


def llama_ids(binary: Path, model: Path, text: str) -> list[int]:
    r = subprocess.run([str(binary), "-m", str(model), "--stdin", "--ids", "--no-bos", "--no-parse-special",
                        "--log-disable"], input=text.encode(), capture_output=True, check=True)
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-tokenize", type=Path, required=True)
    args = ap.parse_args()
    texts = CORPUS + [GPL3.read_text(encoding="utf-8")]
    version = subprocess.run([str(args.llama_tokenize), "--version"], capture_output=True, text=True)
    record = {"llama_cpp": (version.stdout + version.stderr).strip().splitlines()[0] if version.returncode == 0
              else str(args.llama_tokenize), "texts": CORPUS, "gpl3_chars": len(texts[-1]), "models": {}}
    for name, path in ggufs().items():     # the GPL-3 text for the bundled models (real vocabularies)
        record["models"][name] = [llama_ids(args.llama_tokenize, path, t)
                                  for t in (CORPUS if name.startswith("fixture:") else texts)]
        print(name, [len(ids) for ids in record["models"][name]])
    OUT.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
