"""Real-size models: random-weight GGUFs of released shapes to measure turnkv on.

    .venv/bin/python bench/realsize.py make [--preset llama-3.2-1b ...] [--types Q4_K_M Q8_0 IQ4_XS]

``make`` is described in bench/realsize_models.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# run as a script from anywhere; bench/ itself off the path (bench/kernels.py would shadow the
# `kernels` package transformers imports)
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.realsize_models import DEFAULT_TYPES, PRESETS, make  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("make",))
    ap.add_argument("--preset", nargs="+", default=["llama-3.2-1b"], choices=list(PRESETS))
    ap.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES))
    args = ap.parse_args()
    for preset in args.preset:
        files = make(preset, args.types)
        print("\n".join(f"  {t}: {p}" for t, p in files.items()))


if __name__ == "__main__":
    main()
