"""Real-size models: make random-weight GGUFs of released shapes, then time turnkv against
llama.cpp (and ik_llama.cpp where built) on the same files.

    .venv/bin/python bench/realsize.py make [--preset llama-3.2-1b ...] [--types Q4_K_M Q8_0 IQ4_XS]
    .venv/bin/python bench/realsize.py run  [--preset llama-3.2-1b] [--types ...] [--threads 2] [--rounds 3]
    .venv/bin/python bench/realsize.py long [--preset llama-3.2-1b] [--types Q4_K_M] [--lengths 1024 8192 32768]
    .venv/bin/python bench/realsize.py exact [--preset llama-3.2-1b gemma-3-1b ...] [--types Q4_K_M]

``make`` is described in bench/realsize_models.py. ``run`` times, one engine at a time under
``flock /tmp/turnkv-bench.lock``, per file: turnkv in-process (load time, resident memory after
load, prefill of a 512-token prompt, decode of 128 tokens), llama.cpp's ``llama-bench -p 512 -n
128`` and ik_llama.cpp's with ``-rtr 1``; then prints turnkv / peer ratios, the CPU model and a
read-bandwidth probe before and after each turnkv run, so decode reads as a share of what the
machine can stream; ``--rounds N`` runs every engine N times, alternating their order, and
prints medians (the ratios: medians of each round's). ``long`` times long prompts and decode at long contexts
(bench/realsize_long.py); ``exact`` checks reuse == cold, chunk 64 == 512 and batched == alone
bit for bit on the files (bench/realsize_exact.py).

``run`` and ``long`` take the bench lock themselves for each engine's run: do not wrap them in
``flock /tmp/turnkv-bench.lock`` (the inner lock would wait on the outer one for ever).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# run as a script from anywhere: the repository root first on the path
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.realsize_models import DEFAULT_TYPES, PRESETS, make  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("make", "run", "long", "exact"))
    ap.add_argument("--preset", nargs="+", default=["llama-3.2-1b"], choices=list(PRESETS))
    ap.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run: each file this many times on each engine, alternated; medians (a VM's memory speed moves)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 8192, 32768], help="long: prompt lengths")
    ap.add_argument("--ik-lengths", nargs="+", type=int, default=[1024, 32768],
                    help="long: contexts ik_llama.cpp decodes at (each prefills its prompt first)")
    args = ap.parse_args()
    failed = []
    for preset in args.preset:
        files = make(preset, args.types)
        if args.command == "run":
            from bench.realsize_run import run_all
            run_all(preset, {t: files[t.upper()] for t in args.types}, args.threads, args.rounds)
        elif args.command == "long":
            from bench.realsize_long import run_long
            for t in args.types:
                run_long(files[t.upper()], args.threads, sorted(args.lengths), sorted(args.ik_lengths))
        elif args.command == "exact":
            from bench.realsize_exact import check_exact
            failed += [f"{preset} {t}" for t in args.types if not check_exact(files[t.upper()], args.threads)]
    if failed:
        raise SystemExit(f"not exact: {', '.join(failed)}")


if __name__ == "__main__":
    main()
