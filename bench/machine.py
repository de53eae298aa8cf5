"""What every benchmark prints first: the CPU it ran on (numbers only compare within one machine)."""

from __future__ import annotations

import subprocess


def cpu_model() -> str:
    """``lscpu``'s "Model name" (e.g. "AMD EPYC"), or "unknown CPU"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"
