"""Reading single tensors out of a safetensors checkpoint (a local folder or a hub id) without loading the model:
for drafters that hold a part of the target's checkpoint (MTP layers, the input embeddings).
"""

from __future__ import annotations

import json
import os

import torch


def checkpoint_file(path: str, name: str) -> str | None:
    """A local copy of file ``name`` of the checkpoint at ``path`` (a folder, or a hub id: only that file is
    fetched), or None when the checkpoint has no such file."""
    if os.path.isdir(path):
        local = os.path.join(path, name)
        return local if os.path.exists(local) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path, name)
    except EntryNotFoundError:
        return None


def weight_map(path: str) -> dict[str, str] | None:
    """Tensor name → the safetensors file (name inside the checkpoint) holding it, from the shard index or the single
    file's header; None when the checkpoint has no safetensors weights."""
    index = checkpoint_file(path, "model.safetensors.index.json")
    if index is not None:
        with open(index, encoding="utf-8") as f:
            return dict(json.load(f)["weight_map"])
    single = checkpoint_file(path, "model.safetensors")
    if single is None:
        return None
    from safetensors import safe_open  # looked up at call time: tests record which tensors are read

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def read_tensors(path: str, files: dict[str, str], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of the checkpoint at ``path`` (``files``: its :func:`weight_map`), opening each file
    that holds some of them once and reading nothing else."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(files[key], []).append(key)
    out = {}
    for name, names in by_file.items():
        with safe_open(checkpoint_file(path, name), "pt") as f:
            for key in names:
                out[key] = f.get_tensor(key)
    return out
