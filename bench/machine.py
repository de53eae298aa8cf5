"""What every benchmark prints first: the CPU it ran on (numbers only compare within one machine)."""

from __future__ import annotations

import subprocess


def cpu_model() -> str:
    """``lscpu``'s "Model name" with /proc/cpuinfo's family and model beside it, and for AMD the core
    they name (cloud VMs report only "AMD EPYC" for Zen 2 and Zen 4 alike, whose kernel paths differ):
    e.g. "AMD EPYC (family 25 model 17, Zen 4)"; "unknown CPU" when lscpu says nothing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown CPU")
    fam, model = _cpuinfo_family_model()
    if fam is None:
        return name
    core = _amd_core(fam, model) if "AMD" in name.upper() else ""
    return f"{name} (family {fam} model {model}{', ' + core if core else ''})"


def _cpuinfo_family_model() -> tuple[int | None, int | None]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None, None
    got = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in got and val.strip().isdigit():
            got[key] = int(val)
        if len(got) == 2:
            return got["cpu family"], got["model"]
    return None, None


def _amd_core(family: int, model: int) -> str:
    """The Zen generation of an AMD family / model (AMD's published model ranges), or ""."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen / Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return ""


# --- what the kernel did during a timed step (a load: issue 45's 7.4-7.9 s loads of files that load
# in 0.5-0.9 s alone). The process's own CPU seconds (all threads), major faults (file pages read
# from disk) and seconds its threads waited for a CPU (runnable while another task ran: on a
# 2-core machine a busy neighbour or the kernel's reclaim thread); and the machine-wide
# /proc/vmstat counters over the same window: direct compaction stalls (a 2 MiB page or a large
# page-cache folio waiting for the kernel to assemble it), huge-page faults, direct reclaims (an
# allocation waiting for memory to be freed), file pages read again after they were evicted, and
# steal (the hypervisor running something else). Those count every process's activity.
VMSTAT_KEYS = ("compact_stall", "thp_fault_alloc", "allocstall_movable", "allocstall_normal",
               "workingset_refault_file")


def kernel_counters() -> dict:
    """A snapshot for ``kernel_delta`` (Linux; elsewhere the fields it cannot read are absent)."""
    import os
    import resource
    import time

    out = {"cpu_s": time.process_time(), "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
    try:
        with open("/proc/vmstat") as f:
            out.update({k: int(v) for k, v in (line.split() for line in f) if k in VMSTAT_KEYS})
        with open("/proc/stat") as f:
            out["steal_s"] = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
        out["runq_wait_s"] = sum(_runq_wait_ns(t) for t in os.listdir("/proc/self/task")) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return out


def _runq_wait_ns(tid: str) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):      # a thread that ended meanwhile
        return 0


def kernel_delta(before: dict, after: dict) -> dict:
    """What changed between two ``kernel_counters`` snapshots (direct reclaims summed, refaulted
    pages in MB)."""
    d = {k: after[k] - before[k] for k in after if k in before}
    d["direct_reclaim"] = d.pop("allocstall_movable", 0) + d.pop("allocstall_normal", 0)
    d["refault_mb"] = d.pop("workingset_refault_file", 0) * 4096 / 1e6
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}


def describe_kernel(d: dict) -> str:
    """One line for a ``kernel_delta``."""
    g = lambda k: d.get(k, 0)  # noqa: E731
    return (f"CPU {g('cpu_s'):.2f} s, waiting for a CPU {g('runq_wait_s'):.2f} s, {g('majflt')} major faults, "
            f"{g('compact_stall')} compaction stalls, {g('thp_fault_alloc')} huge-page faults, "
            f"{g('direct_reclaim')} direct reclaims, {g('refault_mb'):.0f} MB of file pages read again "
            f"(machine-wide), steal {g('steal_s'):.2f} s")
