"""What machine a benchmark ran on: CPU model and the flags that matter for bf16 (avx512_bf16, amx), usable cores,
memory, GPU, software versions; and the threads and memory budget the benchmarks plan with."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from runtime.launchers.inproc import InprocLauncher
from shared.costs.hardware import cpu_model_name, hardware_flags


def available_threads() -> int:
    """The CPUs this process may run on (the affinity count), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def thread_variants() -> list[tuple[str, int, str]]:
    """(tag, threads, device) of the transformers setups: 1 thread and all threads on a CPU machine (one when they
    are the same), one setup on the GPU of a GPU machine."""
    n = available_threads()
    if gpu_name():
        return [("gpu", n, "cuda")]
    return [(f"{t}t", t, "cpu") for t in sorted({1, n})]


def _meminfo_gib(field_name: str) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 2**20
    return None


def memory_budget_gib(requested: float | None) -> float:
    """``--memory-gib`` if given, else 90 % of the memory available now."""
    if requested:
        return requested
    available = _meminfo_gib("MemAvailable")
    return 0.9 * available if available else 16.0


def peak_rss_gib(pid: int) -> float | None:
    """High-water mark of a process's resident memory (Linux), for checking the planner's estimates."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return None


def node_pids(client: Any) -> list[int]:
    """The node processes' ids of a client from ``runtime.launchers.cluster`` (the process launcher's children; this
    process for ``inproc``; none for Ray, whose actors run elsewhere)."""
    launcher = getattr(client, "cluster", None)
    processes = getattr(launcher, "processes", None)
    if processes is not None:
        return [proc.pid for proc in processes.values()]
    return [os.getpid()] if isinstance(launcher, InprocLauncher) else []


def cpu_topology() -> dict[str, int | None]:
    """Threads per core, cores per socket and sockets as ``lscpu`` reports them (None where it is missing): whether
    the usable cores are physical cores or SMT siblings changes what a thread count means."""
    wanted = {"Thread(s) per core": "threads_per_core", "Core(s) per socket": "cores_per_socket",
              "Socket(s)": "sockets"}
    out: dict[str, int | None] = dict.fromkeys(wanted.values())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}).stdout
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in wanted and value.strip().isdigit():
                out[wanted[name.strip()]] = int(value.strip())
    return out


def machine_info() -> dict[str, Any]:
    """The machine and software a result was measured on (recorded in every result file)."""
    versions = {}
    for pkg in ("torch", "transformers", "pyzmq"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    flags = hardware_flags()
    return {"cpu": cpu_model_name(), "cores": available_threads(), "logical_cpus": os.cpu_count(),
            "flags": {k: bool(flags.get(k)) for k in ("avx2", "avx512_bf16", "amx")}, "gpu": gpu_name(),
            "topology": cpu_topology(), "memory_gib": _meminfo_gib("MemTotal"), "python": platform.python_version(),
            "versions": versions}
