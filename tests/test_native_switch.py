"""TURNKV_REQUIRE_NATIVE=1 (set by CI) turns the "native kernels not built" skips of tests/native.py
into failures: a probe suite with a missing kernel, run by pytest in a subprocess with and without
the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROBE = '''
import pytest

import native


@native.needs(False, "the probe kernel")
def test_marked():
    pass


@native.needs(False, "the probe kernel")
@pytest.mark.skipif(True, reason="a skip that a missing build would also trigger")
def test_marked_and_skipif():
    pass


def test_inside():
    native.missing("the probe kernel")


@native.needs(True, "a built kernel")
def test_built():
    pass
'''


def run_probe(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TURNKV_REQUIRE_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if require is not None:
        env["TURNKV_REQUIRE_NATIVE"] = require
    # -p native: the hooks tests/conftest.py takes from tests/native.py, without the suite's conftest
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "native", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_missing_kernels_skip_by_default(tmp_path):
    out = run_probe(tmp_path, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped" in out.stdout, out.stdout
    assert "the probe kernel not built (python -m turnkv.kernels.build)" in out.stdout


def test_missing_kernels_fail_under_require_native(tmp_path):
    out = run_probe(tmp_path, "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed, 2 errors" in out.stdout, out.stdout
    assert "skipped" not in out.stdout
    for name in ("test_marked", "test_marked_and_skipif", "test_inside"):
        assert f"test_probe.py::{name} - " in out.stdout, out.stdout
    assert "TURNKV_REQUIRE_NATIVE=1 requires it" in out.stdout
    assert "PASSED test_probe.py::test_built" in out.stdout
