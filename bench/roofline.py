"""What this CPU can issue, and how much of it the prefill kernels use.

    .venv/bin/python bench/roofline.py [--threads 1 2]

Builds bench/roofline.cpp with g++ (a few seconds) and runs it: per core, with 12 independent
accumulators in registers, 256-bit FMAs per ns and vpmaddubsw + vpaddw pairs per ns (the int8 dot
step of the GGUF kernels without VNNI); where the CPU has AVX-512, the same two 512 bits wide and
vpdpbusd per ns (AVX-512 VNNI); and the cost of an OpenMP parallel region and of a barrier. Then
times, per thread count, compute-bound kernel calls of the bundled models' shapes (GGUF matmuls with
512 activation rows, and the attention of a 72-token prefill chunk over 1100 keys of float16 K/V and
of a 256-token chunk over 9496 keys, an agent step's global layer) and prints each in multiply-adds
per ns and as a share of the rate of the instruction the dispatched path uses: the matmul's against
vpdpbusd zmm (avx512vnni, 64 each), vpmaddubsw zmm (avx512, 64) or vpmaddubsw ymm (avx2, 32); the
attention's (q.k and p.v per head, query and visible key, d each) against the FMA rate at its path's
width (avx512: 16 lanes, avx2: 8). A share far below 1 means the kernel's own instructions (loads,
conversions, stores, spills), not the CPU, set its speed. Timings are the best of repeated calls
(this shared VM's noise is large). See docs/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script from anywhere

from bench.machine import cpu_model  # noqa: E402

HERE = Path(__file__).resolve().parent


def build_probe(folder: Path) -> Path:
    """bench/roofline.cpp compiled into ``folder`` (once for every thread count)."""
    exe = folder / "roofline"
    try:
        subprocess.run(["g++", "-O2", "-fopenmp", "-o", str(exe), str(HERE / "roofline.cpp")], check=True)
    except FileNotFoundError:
        raise SystemExit("bench/roofline.py needs g++ (apt-get install g++)") from None
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"building bench/roofline.cpp failed (g++ exit status {err.returncode})") from None
    return exe


def probe(exe: Path, threads: int) -> dict[str, float]:
    """The probe's numbers with ``threads`` OpenMP threads."""
    run = subprocess.run([str(exe)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if run.returncode != 0:
        raise SystemExit(f"the probe failed: {(run.stdout + run.stderr).strip()}")
    vals = {}
    for line in run.stdout.splitlines():
        k, v = line.split()
        vals[k] = float(v)
    return vals


def peaks(peak: dict[str, float], threads: int) -> tuple[str, float, str, float]:
    """(matmul instruction, its multiply-adds per ns, attention instruction, its multiply-adds per
    ns) on ``threads`` cores for the paths the kernels dispatch to on this CPU."""
    import turnkv.kernels as tk
    from turnkv.kernels.attention import attention_isas

    mm = tk.ISAS[tk._isa_index(None)]
    if mm == "avx512vnni":
        mm_ins, mm_rate = "vpdpbusd zmm", 64 * peak["dpbusd_zmm_per_ns"]
    elif mm == "avx512":
        mm_ins, mm_rate = "vpmaddubsw zmm", 64 * peak["maddubs_zmm_per_ns"]
    else:
        mm_ins, mm_rate = "vpmaddubsw ymm", 32 * peak["maddubs_ymm_per_ns"]
    if attention_isas()[-1] == "avx512" and os.environ.get("TURNKV_KERNEL_ISA", "") not in ("avx2", "scalar"):
        at_ins, at_rate = "FMA zmm", 16 * peak["fma_zmm_per_ns"]
    else:
        at_ins, at_rate = "FMA ymm", 8 * peak["fma_ymm_per_ns"]
    return mm_ins, mm_rate * threads, at_ins, at_rate * threads


def kernel_rows(threads: int, peak: dict[str, float]) -> list[tuple[str, float, float]]:
    """(what, multiply-adds per ns, share of the issue rate) for the kernel calls, at ``threads``."""
    from gguf import GGMLQuantizationType as Q

    import turnkv.kernels as tk
    from bench.gguf_matmul import best_time, random_weight
    from turnkv.kernels import attention as A

    torch.set_num_threads(threads)
    rows = []
    ext, isa = tk._ext, tk._isa_index(None)
    mm_ins, mm_peak, at_ins, at_peak = peaks(peak, threads)
    for name, qt, n, k in (("Q4_1 [3072, 576] (SmolLM2 gate/up)", Q.Q4_1, 3072, 576),
                           ("Q5_0 [4096, 640] (Gemma 3 gate/up)", Q.Q5_0, 4096, 640),
                           ("Q4_K [640, 2048] (Gemma 3 down)", Q.Q4_K, 640, 2048)):
        w, x = random_weight(qt, n, k), torch.randn(512, k)
        s = best_time(lambda: ext.gguf_matmul(x, w.raw, int(w.qtype), n, k, isa), budget=1.0)
        rate = 512 * n * k / s / 1e9
        rows.append((f"matmul {name}, M=512 (against {mm_ins})", rate, rate / mm_peak))
    # the last: one global layer of an agent step's prefill (bench/step_ttft.py: a 256-row chunk at ~9.5k)
    for name, hq, hk, d, t, keys in (("SmolLM2 9q/3kv x 64", 9, 3, 64, 72, 1100),
                                     ("Gemma 3 4q/1kv x 256", 4, 1, 256, 72, 1100),
                                     ("Gemma 3 4q/1kv x 256", 4, 1, 256, 256, 9496)):
        q, kk, v = torch.randn(hq, t, d), torch.randn(hk, keys, d).half(), torch.randn(hk, keys, d).half()
        s = best_time(lambda: A.attend_native(q, kk, v, keys - t, 0, "full", 0, 0.125, None), budget=1.0)
        visible = sum(keys - t + i + 1 for i in range(t))
        rate = 2 * hq * visible * d / s / 1e9
        rows.append((f"attention {name}, {t} q / {keys} keys (against {at_ins})", rate, rate / at_peak))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    a = ap.parse_args()
    import turnkv.kernels as tk
    from turnkv.kernels.attention import native_attention_available

    if tk._ext is None or not native_attention_available():
        raise SystemExit("the native kernels are not built: run `make setup` (or `.venv/bin/python -m turnkv.kernels.build`)")
    print(f"CPU: {cpu_model()}; kernels: {tk.kernel_info()}")
    with tempfile.TemporaryDirectory() as d:
        exe = build_probe(Path(d))
        peaks_by_threads = {threads: probe(exe, threads) for threads in a.threads}
    for threads, peak in peaks_by_threads.items():
        wide = (f", {peak['fma_zmm_per_ns']:.2f} FMA zmm/ns, {peak['maddubs_zmm_per_ns']:.2f} vpmaddubsw+vpaddw zmm/ns"
                if "fma_zmm_per_ns" in peak else "")
        if "dpbusd_zmm_per_ns" in peak:
            wide += f", {peak['dpbusd_zmm_per_ns']:.2f} vpdpbusd zmm/ns"
        print(f"\n{threads} thread(s): per core {peak['fma_ymm_per_ns']:.2f} FMA ymm/ns, "
              f"{peak['maddubs_ymm_per_ns']:.2f} vpmaddubsw+vpaddw ymm/ns{wide}; OpenMP region "
              f"{peak['omp_region_us']:.2f} us, barrier {peak['omp_barrier_us']:.2f} us")
        print(f"{'kernel call':80s} {'MA/ns':>8s} {'share':>6s}")
        for what, rate, share in kernel_rows(threads, peak):
            print(f"{what:80s} {rate:8.1f} {share:6.0%}")

if __name__ == "__main__":
    main()
