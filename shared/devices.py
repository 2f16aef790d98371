"""Where tensors for a loaded model must go, with no dependency on loading or profiling.

Kept apart from ``shared.models`` (which loads models and so needs the profiler) so that ``shared.kv`` and the
profiler can ask for a model's input device without importing the loader back: the layers stay acyclic.
"""

from __future__ import annotations

import torch


def input_device(model: torch.nn.Module) -> torch.device:
    """Where input ids must go (the embedding's device when accelerate spread the model)."""
    return model.get_input_embeddings().weight.device
