"""The config keys both nodes have (``verifier`` and ``drafter``): device, dtype, threads, profile budget, memory
map and KV backend, declared once. Each section's dataclass calls these (a dataclass needs a field object of its
own)."""

from __future__ import annotations

from typing import Any

from shared.models import AUTO, DTYPES
from shared.settings import setting

#: ``backend``: where a node's KV caches live (:mod:`shared.backend`; ``llama_cpp``: the verifier's target is a
#: GGUF in llama.cpp, :mod:`shared.llama_target`).
BACKEND_CHOICES = ("auto", "dynamic", "static", "compiled", "llama_cpp")
#: ``compiled_max_tokens``' default: ``backend: compiled`` builds a decode step for 1, 2, 4, … up to this many new
#: tokens (a forward of T tokens runs in the smallest bucket ≥ T, padded; longer ones take the eager static path).
DEFAULT_COMPILED_TOKENS = 16


def compiled_buckets(max_tokens: int) -> tuple[int, ...]:
    """The compiled step's token buckets: the powers of two below ``max_tokens``, and ``max_tokens``."""
    buckets, size = [], 1
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return (*buckets, max_tokens)


COMPILED_BUCKETS = compiled_buckets(DEFAULT_COMPILED_TOKENS)
#: ``kv_slot_tokens``' default: a static KV slot's length (capped by the model's ``max_position_embeddings``).
DEFAULT_SLOT_TOKENS = 4096
#: ``kv_slots: null``: the smaller of max_sessions and max_batch_sessions, but at most this many (the pool is
#: allocated whole at start-up: slots × slot tokens × the model's K/V bytes per token).
DEFAULT_KV_SLOTS = 8


def kv_slots(configured: int | None, *limits: int) -> int:
    """A node's KV slot count: ``kv_slots`` as configured, else the smallest of the node's session ``limits`` and
    :data:`DEFAULT_KV_SLOTS` (the pool is allocated whole at start-up)."""
    return int(configured or min(*(int(n) for n in limits), DEFAULT_KV_SLOTS))

#: ``dtype``: auto or a torch dtype's name.
DTYPE_CHOICES = (AUTO, *DTYPES)


def node_device() -> Any:
    return setting("cpu", "cpu, cuda, cuda:N, mps or auto (spread over GPUs with accelerate's device_map).", kind="str")


def node_dtype() -> Any:
    return setting("auto", "Weights dtype; auto: the fastest for its shapes, measured at start-up.", kind="str",
                   choices=DTYPE_CHOICES)


def node_threads() -> Any:
    return setting("auto", "Torch threads; auto: every core while the other node idles, half while both work.",
                   kind="int", bounds=(1, None), also=(AUTO,))


def node_profile_s() -> Any:
    return setting(20, "Start-up cost profile budget in seconds, cached on disk (0: none, learned online).",
                   kind="number", bounds=(0, 600), unit="seconds", hint="0: no profile")


def node_backend() -> Any:
    return setting(
        "auto",
        "Where sessions' KV caches live: static (preallocated slots), dynamic (growing caches), auto (static where "
        "the model allows it), compiled (static slots whose single-session steps run torch.compile'd; opt-in, never "
        "chosen by auto: it compiles at start-up), llama_cpp (verifier only: the target is a GGUF run by llama.cpp, "
        "docs/backends.md).",
        kind="str",
        choices=BACKEND_CHOICES,
    )


def node_kv_slot_tokens() -> Any:
    return setting(
        DEFAULT_SLOT_TOKENS,
        "Static backend: tokens per session's slot (capped by the model's context); longer sessions get a dynamic "
        "cache.",
        kind="int",
        bounds=(1, None),
    )


def node_kv_slots(null: str) -> Any:
    """``kv_slots``; ``null``: what a null value means for this node."""
    return setting(
        None,
        f"Static backend: slots preallocated (null: {null}); sessions beyond them get dynamic caches.",
        kind="int",
        bounds=(1, None),
    )


def node_max_memory() -> Any:
    return setting(None, "With device: auto, e.g. {0: 20GiB, 1: 20GiB}.")


def node_placement() -> Any:
    return setting(
        None,
        "launch.backend ray: what this node's actor asks of a host: {num_cpus, num_gpus, resources: {NAME: N}, "
        "labels: {KEY: VALUE}} (null: 1 CPU, or 1 GPU with a cuda device).",
    )
