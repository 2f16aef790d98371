"""What the numbers of a profile depend on besides the model: the CPU's model and flags, the GPU's name."""

from __future__ import annotations

import contextlib
import platform

import torch


def _cpuinfo_field(name: str) -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    return None


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def hardware_flags() -> dict:
    """What decides whether bfloat16 pays on this CPU, and the GPU's name (None without CUDA)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    gpu = None
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError, AssertionError):
            gpu = torch.cuda.get_device_name(0)
    return {"avx2": "avx2" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": bool(flags & {"amx_bf16", "amx_tile"}), "gpu": gpu}


def is_cpu(device: str) -> bool:
    """Whether ``device`` is the CPU (thread counts matter there; a GPU profile has one curve)."""
    return device == "cpu"


def gpu_name(device: str) -> str | None:
    if device.startswith("cuda") or device == "auto":
        if not torch.cuda.is_available():
            return None
        index = int(device.split(":")[1]) if ":" in device else 0
        with contextlib.suppress(RuntimeError, AssertionError):
            return torch.cuda.get_device_name(index)
    return None
