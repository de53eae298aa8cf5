"""turnkv perplexity vs llama.cpp's llama-perplexity on the bundled SmolLM2 requantized to each type.

Each type is made by llama-quantize (--allow-requantize) from the bundled Q4_1 GGUF into a cache
folder outside the repository (default ~/.cache/turnkv-ppl-quants); both engines then score
turnkv/data/coriolanus.txt with the same chunking (-c 512 by default), each as its own process:
`turnkv perplexity` with its defaults (the GGUF's own blocks on the native kernels, fp16 KV), the
same with `--weights native --kv-cache-mode native` (dequantized float32 weights and activations:
the file's values without the kernels' int8 activations; only where turnkv's figure is more than
``--float-over`` percent from llama.cpp's, it costs the most), and `llama-perplexity`.

    python bench/perplexity_quants.py [--types Q4_0,Q8_0,...] [--ctx 512] [--threads 2] [--float-over 1]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("TURNKV_PEERS", Path.home() / ".cache" / "turnkv-peers"))
BIN = PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
CACHE = Path(os.environ.get("TURNKV_PPL_CACHE", Path.home() / ".cache" / "turnkv-ppl-quants"))
TEXT = ROOT / "turnkv" / "data" / "coriolanus.txt"
TYPES = ("Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
         "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def bundled_smollm2() -> Path:
    sys.path.insert(0, str(ROOT))
    from turnkv.loading.bundled import locate_bundled
    return locate_bundled("smollm2-135m")


def quantized(source: Path, qtype: str) -> Path:
    """The SmolLM2 file in ``qtype`` (the bundled file itself for its own type, Q4_1)."""
    if qtype == "Q4_1":
        return source
    out = CACHE / f"smollm2-135m-{qtype}.gguf"
    if not out.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(BIN / "llama-quantize"), "--allow-requantize", str(source), str(tmp), qtype, "2"],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


def tensor_types(path: Path) -> str:
    """The 2-D tensors' types in the file, most common first (llama-quantize falls back from
    K-quants on SmolLM2's 576-wide rows)."""
    from gguf import GGUFReader
    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def final(cmd: list[str]) -> tuple[float, float]:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    found = FINAL.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    return float(found.group(1)), float(found.group(2))


def measure(path: Path, ctx: int, threads: int, float_over: float) -> dict:
    common = ["-f", str(TEXT), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    turnkv = [sys.executable, "-m", "turnkv.cli", "perplexity", "-q", "-m", str(path), *common]
    r = {"llama": final([str(BIN / "llama-perplexity"), "-m", str(path), *common]), "turnkv": final(turnkv)}
    if abs(100 * (r["turnkv"][0] / r["llama"][0] - 1)) > float_over:
        r["float"] = final([*turnkv, "--weights", "native", "--kv-cache-mode", "native"])
    return r


def _pct(got: float, ref: float) -> str:
    return f"{100 * (got / ref - 1):+.2f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--float-over", type=float, default=1.0, metavar="PCT",
                    help="run the float32 reference where turnkv is more than PCT%% from llama.cpp (0: always)")
    args = ap.parse_args()
    source = bundled_smollm2()
    print(f"text {TEXT.name}, -c {args.ctx}, {args.threads} threads; PPL +/- llama.cpp's uncertainty")
    print("| type | 2-D tensor types | MB | llama-perplexity | turnkv | turnkv vs llama.cpp "
          "| turnkv float32 | float32 vs llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype in args.types.split(","):
        path = quantized(source, qtype)
        r = measure(path, args.ctx, args.threads, args.float_over)
        ref = r["llama"][0]
        fl = f"{r['float'][0]:.4f} | {_pct(r['float'][0], ref)}" if "float" in r else "- | -"
        print(f"| {qtype} | {tensor_types(path)} | {path.stat().st_size / 1e6:.0f} | {ref:.4f} +/- {r['llama'][1]:.4f} "
              f"| {r['turnkv'][0]:.4f} | {_pct(r['turnkv'][0], ref)} | {fl} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
