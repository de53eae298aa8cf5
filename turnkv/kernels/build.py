"""Build the native GGUF kernels into turnkv/kernels/_build (run at install: `python -m turnkv.kernels.build`).

Idempotent: a stamp of the sources, flags, compiler and torch version skips an up-to-date build.
One binary serves every x86 CPU (per-function target attributes, run-time dispatch), so no
-march flag is used. Prints one line; exits non-zero only if the compiler fails (the package
still works then, on the PyTorch reference).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "csrc"
BUILD_DIR = HERE / "_build"
EXT_NAME = "turnkv_gguf_kernels"
SOURCES = [SRC / "gguf_matmul.cpp", SRC / "attention.cpp", SRC / "norm.cpp"]
# -ffp-contract=off: no a*b+c -> fma fusion, so the float ops are exactly reference.py's
# -fopenmp: at::parallel_for is header-inline OpenMP; libgomp.so.1 resolves to torch's own copy
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


def _stamp() -> str:
    import torch

    h = hashlib.sha256()
    for p in sorted(SRC.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return h.hexdigest()


def _compile(out_dir: Path, verbose: bool) -> None:
    """torch.utils.cpp_extension.load in a child process that imports only torch: load() also
    imports the new module, and this process may already hold the old one (importing
    turnkv.kernels loads it), whose op registrations must not run twice in one process."""
    import json
    import subprocess

    env = dict(os.environ)
    # ninja comes with the venv (pyproject); make sure the venv's bin is on PATH
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    kwargs = dict(name=EXT_NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                  extra_include_paths=[str(SRC)], build_directory=str(out_dir), verbose=verbose)
    code = "import json, sys\nfrom torch.utils.cpp_extension import load\nload(**json.loads(sys.argv[1]))\n"
    r = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], env=env, text=True,
                       stdout=None if verbose else subprocess.PIPE, stderr=None if verbose else subprocess.STDOUT)
    if r.returncode != 0:
        tail = "\n".join((r.stdout or "").splitlines()[-15:])
        raise RuntimeError(f"compiler failed (exit {r.returncode}):\n{tail}")


def build(force: bool = False, verbose: bool = False) -> str:
    """Compile into a fresh temporary folder, then move the .so into place (os.replace: a
    process that has the old one loaded keeps it); a file lock serializes concurrent builds."""
    import fcntl
    import tempfile

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    stamp_file = BUILD_DIR / "stamp"
    target = BUILD_DIR / f"{EXT_NAME}.so"
    with open(BUILD_DIR / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _stamp()
        if not force and target.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
            return f"turnkv.kernels: native kernels up to date ({target})"
        for stale in BUILD_DIR.glob("tmp-*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        for stale in [*BUILD_DIR.glob("*.o"), *(BUILD_DIR / n for n in ("build.ninja", ".ninja_deps", ".ninja_log"))]:
            stale.unlink(missing_ok=True)  # an in-place build's leftovers
        tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=BUILD_DIR))
        try:
            _compile(tmp, verbose)
            os.replace(tmp / f"{EXT_NAME}.so", target)
            stamp_file.write_text(stamp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return f"turnkv.kernels: built native kernels ({target})"


def main() -> int:
    force = "--force" in sys.argv
    try:
        print(build(force=force, verbose="-v" in sys.argv), flush=True)
    except Exception as e:  # keep the install going: the reference path still works
        print(f"turnkv.kernels: native build FAILED ({type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}); "
              "the PyTorch reference will be used", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
