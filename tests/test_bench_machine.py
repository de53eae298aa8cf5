"""bench/machine.py's CPU naming: every benchmark prints it beside its numbers, and cloud VMs call
Zen 2 and Zen 4 alike "AMD EPYC" (their kernel paths differ: AVX2 against AVX-512 VNNI)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import _amd_core, cpu_model  # noqa: E402


def test_amd_family_and_model_name_the_core():
    # AMD's ranges: Rome (23, 49), Milan (25, 1), Vermeer (25, 33), Genoa (25, 17), Raphael (25, 97),
    # Bergamo (25, 160), Turin (26, 2)
    assert [_amd_core(23, 49), _amd_core(23, 1)] == ["Zen 2", "Zen / Zen+"]
    assert [_amd_core(25, 1), _amd_core(25, 33)] == ["Zen 3", "Zen 3"]
    assert [_amd_core(25, 17), _amd_core(25, 97), _amd_core(25, 160)] == ["Zen 4"] * 3
    assert _amd_core(26, 2) == "Zen 5" and _amd_core(6, 143) == ""


def test_cpu_model_carries_this_machines_family_and_model():
    text = Path("/proc/cpuinfo").read_text()
    family = int(re.search(r"^cpu family\s*:\s*(\d+)", text, re.M).group(1))
    model = int(re.search(r"^model\s*:\s*(\d+)", text, re.M).group(1))
    assert f"(family {family} model {model}" in cpu_model()
