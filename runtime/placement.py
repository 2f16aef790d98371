"""Where a node runs on a Ray cluster: a node's ``placement`` key, parsed and checked without importing Ray.

``verifier.placement`` and ``drafter.placement`` (``launch.backend: ray``) say what the node's actor asks of a
host, in Ray's own terms::

    placement: {num_cpus: 2, num_gpus: 1, resources: {gpu_host: 1}, labels: {zone: a}}

``resources`` are the custom resources hosts declare with ``ray start --resources='{"gpu_host": 1}'``; ``labels``
the labels they declare with ``ray start --labels=zone=a`` (an actor goes only to a host with every label). The
launcher turns each node's placement into one bundle of a placement group (``launch.placement_strategy``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: The keys a placement may have.
PLACEMENT_KEYS = ("num_cpus", "num_gpus", "resources", "labels")
#: Ray's resource names are free-form, but ours go into YAML, env and log lines: keep them plain.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]{0,63}")
#: Ray names these resources itself; they are num_cpus / num_gpus / memory, not custom resources.
_BUILT_IN = {"CPU", "GPU", "memory", "object_store_memory"}


class PlacementError(ValueError):
    """A placement that Ray could not place or that names something wrongly; the message names the key."""


@dataclass(frozen=True)
class Placement:
    """What one node's actor needs of its host."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        """This placement as a placement group bundle (Ray's resource dict)."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle

    def describe(self) -> str:
        parts = [f"{self.num_cpus:g} CPU"] + ([f"{self.num_gpus:g} GPU"] if self.num_gpus else [])
        parts += [f"{name} {amount:g}" for name, amount in self.resources.items()]
        parts += [f"label {key}={value}" for key, value in self.labels.items()]
        return ", ".join(parts)


def _amount(dotted: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PlacementError(f"{dotted}: must be a number ≥ 0, got {value!r}")
    return float(value)


def parse_placement(value: Any, dotted: str, device: str = "cpu") -> Placement:
    """A node's ``placement`` value (None: the default for ``device``: 1 CPU, plus 1 GPU on a cuda device)."""
    gpu = isinstance(device, str) and device.startswith(("cuda", "auto"))
    if value is None:
        return Placement(num_gpus=1.0 if gpu and device != "auto" else 0.0)
    if not isinstance(value, dict):
        raise PlacementError(f"{dotted}: a mapping of {', '.join(PLACEMENT_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(PLACEMENT_KEYS))
    if unknown:
        raise PlacementError(f"{dotted}.{unknown[0]}: unknown placement key (known: {', '.join(PLACEMENT_KEYS)})")
    num_cpus = _amount(f"{dotted}.num_cpus", value.get("num_cpus", 1))
    num_gpus = _amount(f"{dotted}.num_gpus", value.get("num_gpus", 1 if gpu and device != "auto" else 0))
    resources: dict[str, float] = {}
    for key in ("resources", "labels"):
        if not isinstance(value.get(key, {}), dict):
            raise PlacementError(f"{dotted}.{key}: a mapping of NAME: VALUE, got {value[key]!r}")
    for name, amount in (value.get("resources") or {}).items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _BUILT_IN:
            raise PlacementError(f"{dotted}.resources: {name!r} is not a custom resource name (use letters, digits, "
                                 "'_', '.', ':', '/', '-'; CPU and GPU go in num_cpus and num_gpus)")
        resources[name] = _amount(f"{dotted}.resources.{name}", amount)
    labels: dict[str, str] = {}
    for key, label in (value.get("labels") or {}).items():
        if not isinstance(key, str) or not _NAME.fullmatch(key) or not isinstance(label, (str, int)) \
                or isinstance(label, bool) or not _NAME.fullmatch(str(label)):
            raise PlacementError(f"{dotted}.labels: {key!r}: {label!r} is not a label (plain names and values)")
        labels[key] = str(label)
    if num_cpus == 0 and num_gpus == 0 and not resources:
        raise PlacementError(f"{dotted}: asks for nothing (num_cpus 0, no GPU, no resources): Ray could place it "
                             "anywhere; give it num_cpus or a resource")
    return Placement(num_cpus, num_gpus, resources, labels)
