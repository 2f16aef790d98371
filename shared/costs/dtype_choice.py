"""``dtype: auto``: on a GPU the half type the device supports, on a CPU whichever of float32 / bfloat16 is faster
here, measured (bfloat16 only wins on CPUs with native bf16 support, and the memory it saves does not always make
up for the conversion elsewhere); both candidates' profiles are cached, so a later start loads only the winner.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.costs.cache import profile_key, read_cached
from shared.costs.curve import NodeProfile, profile_score
from shared.costs.hardware import hardware_flags
from shared.costs.measure import ProgressFn, load_or_measure

#: The candidates ``dtype: auto`` compares on a CPU.
AUTO_CPU_DTYPES = ("float32", "bfloat16")


def _auto_gpu_dtype(device: str) -> str | None:
    if device.startswith("cuda") or device == "auto":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    if device == "mps":
        return "float16"
    return None


def _collect() -> None:
    """Free what the last dropped model held (call it after its last reference is gone)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    release_freed_memory()


def release_freed_memory() -> None:
    """Hand memory freed by Python back to the system (glibc keeps freed heap pages; the next model would otherwise
    be counted on top of the last one's)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resolve_auto_dtype(load: Callable[[str], Any], model_path: str, device: str, threads: list[int],
                       sizes: list[int], budget_s: float = 20.0, progress: ProgressFn | None = None, *,
                       variant: str = "", fresh: bool = False,
                       score: Callable[[NodeProfile, list[int]], float] | None = None,
                       load_probe: Callable[[str], Any] | None = None) -> tuple[Any, NodeProfile]:
    """``dtype: auto``: pick the dtype for this node and return ``(model loaded in it, its profile)``.

    ``load(dtype_name)`` loads the model. A GPU takes bfloat16 where supported, else float16 (MPS: float16). A CPU
    measures float32 and bfloat16 (half the budget each) and keeps the one with the lower ``score`` (default
    :func:`profile_score`; a verifier passes :func:`verify_score`);
    both profiles are cached, so a later start looks both up and loads only the winner. At most one candidate is
    in memory at a time. ``profile.candidates`` holds the scores.

    ``load_probe(dtype_name)``: the model cut to a few of its layers (``shared.models.probe_config``). Given, the
    CPU candidates are measured on it (profiles cached under ``variant + "|probe"``) and only the winner is loaded
    whole, so the peak memory is the winner's, not the larger candidate's; the profile returned is then the
    probe's (the node measures the whole model's next, ``shared.models.profile_node``)."""
    score = score or profile_score
    full_load = load
    gpu_dtype = _auto_gpu_dtype(device)
    if gpu_dtype is not None:
        model = load(gpu_dtype)
        profile = load_or_measure(model, model_path, device, gpu_dtype, threads, sizes, budget_s, progress,
                                  variant=variant, fresh=fresh)
        profile.candidates = {gpu_dtype: score(profile, sizes)}
        return model, profile

    probe = load_probe is not None
    if probe:
        load, variant = load_probe, f"{variant}|probe"
    profiles = _cached_profiles(model_path, device, threads, sizes, variant, fresh, progress)
    held = _measure_missing(profiles, load, model_path, device, threads, sizes, budget_s / 2, progress, variant, fresh)
    scores = {dtype: score(p, sizes) for dtype, p in profiles.items() if p is not None}
    winner = min(scores, key=lambda d: (scores[d], d != "bfloat16"))  # a tie goes to the smaller footprint
    if held is not None and held[0] == winner and not probe:
        model = held[1]
    else:  # the probes were cut models: the winner is loaded whole, after the last one held is freed
        held = None
        _collect()
        model = full_load(winner)
    profile = profiles[winner]
    assert profile is not None
    profile.candidates = scores
    if progress:
        listed = ", ".join(f"{d} {s * 1e3:.1f} ms" for d, s in scores.items())
        progress(f"dtype auto for {Path(model_path).name}: {winner} (score {listed})")
    return model, profile


def _cached_profiles(model_path: str, device: str, threads: list[int], sizes: list[int], variant: str, fresh: bool,
                     progress: ProgressFn | None) -> dict[str, NodeProfile | None]:
    """Each CPU candidate's cached profile (None: to be measured; all None with ``fresh``)."""
    profiles: dict[str, NodeProfile | None] = {}
    for dtype in AUTO_CPU_DTYPES:
        cached = None
        if not fresh:
            cached = read_cached(profile_key(model_path, device, dtype, threads, sizes, variant=variant))
            if cached is not None and progress:
                progress(f"profile of {Path(model_path).name} {dtype} on {device}: cached")
        profiles[dtype] = cached
    return profiles


def _measure_missing(profiles: dict[str, NodeProfile | None], load: Callable[[str], Any], model_path: str,
                     device: str, threads: list[int], sizes: list[int], budget_s: float, progress: ProgressFn | None,
                     variant: str, fresh: bool) -> tuple[str, Any] | None:
    """Measure the candidates without a profile (into ``profiles``), one model in memory at a time; returns the
    last one measured, ``(dtype, model)``, still loaded (None when all were cached)."""
    # Measure the likelier loser first, so the model in memory at the end is most often the winner.
    flags = hardware_flags()
    native_bf16 = flags["avx512_bf16"] or flags["amx"]
    order = ["float32", "bfloat16"] if native_bf16 else ["bfloat16", "float32"]
    held: tuple[str, Any] | None = None
    for dtype in order:
        if profiles[dtype] is not None:
            continue
        if held is not None:
            held = None
            _collect()
        model = load(dtype)
        profiles[dtype] = load_or_measure(model, model_path, device, dtype, threads, sizes, budget_s, progress,
                                          variant=variant, fresh=fresh)
        held = (dtype, model)
        del model
    return held


def dtype_reason(profile: NodeProfile) -> str:
    """Why a node runs in ``profile.dtype``, in words: measured against the other candidate (``dtype: auto`` on a
    CPU: the scores, seconds per token), the device's half type (``auto`` on a GPU), or as configured."""
    scores = profile.candidates
    if len(scores) >= 2:
        others = ", ".join(f"{d} {s * 1e3:.0f} ms" for d, s in sorted(scores.items(), key=lambda kv: kv[1])
                           if d != profile.dtype)
        return f"dtype auto: measured faster here, {profile.dtype} {scores.get(profile.dtype, 0) * 1e3:.0f} ms vs " \
               f"{others} per token"
    if len(scores) == 1:
        return f"dtype auto: the half type {profile.device} supports"
    return "as configured"
