"""One thread's k-quant decode matmul against a plain read of the same bytes (bench/kdecode.cpp).

    flock /tmp/turnkv-bench.lock .venv/bin/python bench/kdecode.py [--csrc DIR ...] [--types Q4_K,Q5_K,Q6_K]
        [--shapes 9728x2560,2560x9728] [--m 1] [--rounds 3] [--pf 8192] [--l2] [--isa avx2|avx512vnni]

Builds bench/kdecode.cpp against each csrc/ folder given (default: this checkout's; give two for
an A/B, e.g. another worktree's), the extension's flags, then runs every (type, shape) for each
folder in turn, `--rounds` times (variants alternated): cycles per 8-row x 32-value block of the
kernel (thread CPU time, best of the passes) beside a read of the same bytes with the same software
prefetch (the floor one core streams at), the kernel's share of that read rate, and the outputs'
hash (equal hashes: the same bits). From DRAM by default: copies of the weight past 64 MB (the
shapes: Qwen3-4B's FFN); `--l2`: one [256, 1024] weight kept in L2. Run it under the lock on a
shared machine; one thread, so its cycles hold at any load that leaves a core free.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # run as a script from anywhere

from bench.machine import cpu_model  # noqa: E402

QTYPES = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210), "IQ4_XS": (23, 136)}
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17"]


def build(csrc: Path, out: Path, isa: str = "avx2") -> Path:
    """bench/kdecode.cpp compiled against ``csrc`` (its lowbit_grids.h written as the build does) for
    ``isa``: avx2, or avx512vnni (the avx512vnni_t8 namespace an AVX-512 VNNI CPU decodes with)."""
    from turnkv.kernels.build import grids_header

    out.mkdir(parents=True, exist_ok=True)
    (out / "lowbit_grids.h").write_text(grids_header())
    exe = out / "kdecode"
    extra = ["-DKD_AVX512VNNI"] if isa == "avx512vnni" else []
    subprocess.run(["g++", *FLAGS, *extra, "-I", str(csrc), "-I", str(out), "-o", str(exe), str(HERE / "kdecode.cpp")],
                   check=True)
    return exe


def run(exe: Path, qtype: str, n: int, k: int, m: int, l2: bool, pf: int) -> dict[str, str]:
    qt, bb = QTYPES[qtype]
    if l2:
        n, k, copies, reps = 256, 1024, 1, 2000
    else:
        mb = n * k / 256 * bb / 2**20
        copies, reps = max(2, int(64 / mb) + 1), 7
    out = subprocess.run([str(exe), str(qt), str(n), str(k), str(m), str(copies), str(reps), str(pf)],
                         capture_output=True, text=True, check=True).stdout.split()
    return dict(zip(out[::2], out[1::2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csrc", action="append", type=Path, help="csrc/ folders to compare (default: this checkout's)")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--shapes", default="9728x2560,2560x9728", help="NxK weights (out x in)")
    ap.add_argument("--m", type=int, default=1, help="activation rows (1..8: the fused decode path)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pf", type=int, default=8192, help="the fused path's prefetch distance (bytes; 0 off)")
    ap.add_argument("--l2", action="store_true", help="one small weight from L2 instead of DRAM")
    ap.add_argument("--isa", choices=("avx2", "avx512vnni"), default="avx2",
                    help="the kernels' path (avx512vnni: what a Zen 4 / Ice Lake+ CPU decodes with)")
    args = ap.parse_args()
    folders = args.csrc or [HERE.parent / "turnkv" / "kernels" / "csrc"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"CPU: {cpu_model()}, load average {os.getloadavg()[0]:.1f}, M = {args.m}, "
          f"{'L2' if args.l2 else 'DRAM'}, prefetch {args.pf}, {args.isa}")
    with tempfile.TemporaryDirectory() as tmp:
        exes = [build(f, Path(tmp) / str(i), args.isa) for i, f in enumerate(folders)]
        print("round variant type shape ghz kernel_cyc read_cyc share hash load")
        for r in range(args.rounds):
            for i, exe in enumerate(exes):
                for qtype in args.types.split(","):
                    for n, k in shapes:
                        v = run(exe, qtype, n, k, args.m, args.l2, args.pf)
                        share = float(v["read_cyc"]) / float(v["kernel_cyc"])
                        print(f"{r} {i} {qtype} {n}x{k} {v['ghz']} {v['kernel_cyc']} {v['read_cyc']} {share:.2f} "
                              f"{v['hash'][:8]} {os.getloadavg()[0]:.1f}", flush=True)
                        time.sleep(0.1)


if __name__ == "__main__":
    main()
