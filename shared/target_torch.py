"""The torch side of the target seam that every torch backend shares: :class:`TorchBackend` (handles are
:class:`~shared.kv.CachedLM` over one transformers model), :class:`DynamicBackend` (each handle a ``DynamicCache``),
and the :class:`~shared.target.Target` of a loaded model (:func:`torch_target`, :func:`as_target`). Import-light
(no loaders, no cost measurements), so the profiles can measure a bare model through it; the static and compiled
backends and the registered loader live in :mod:`shared.backend`."""

from __future__ import annotations

from typing import Any

import torch

from shared.batch import feed_rows
from shared.devices import input_device
from shared.kv import CachedLM
from shared.model_facts import default_eos_ids, logits_vocab_size, model_dtype
from shared.target import Row, RowOutput, Target, TargetBackend


class TorchBackend(TargetBackend):
    """What the torch backends share: handles are :class:`~shared.kv.CachedLM` over one transformers model."""

    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """One forward over every row (see :func:`shared.batch.feed_rows`)."""
        return feed_rows(self.model, rows, want_hidden=want_hidden, logits=logits)

    def can_batch(self) -> bool:
        """Whether this model can run ragged batched forwards with a custom mask."""
        return CachedLM(self.model).batchable

    def feed_tree(self, lm: CachedLM, tokens: list[int], positions: list[int], visible: torch.Tensor,
                  want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return lm.feed_masked(tokens, positions, visible, want_hidden)

    def keep_positions(self, lm: CachedLM, prefix: int, positions: list[int]) -> None:
        lm.keep_positions(prefix, positions)

    @property
    def recurrent(self) -> bool:
        return CachedLM(self.model).recurrent

    def check_kv_layers(self, layers: list[int]) -> None:
        CachedLM(self.model).check_kv_layers(layers)


class DynamicBackend(TorchBackend):
    """Today's layout: each handle a :class:`~shared.kv.CachedLM` over a ``DynamicCache``."""

    name = "dynamic"

    def open(self, tokens: int | None = None) -> CachedLM:
        return CachedLM(self.model)


def torch_target(model: Any, tokenizer: Any = None, backend: TargetBackend | None = None, *, name: str = "",
                 profile: Any = None) -> Target:
    """The :class:`~shared.target.Target` of a loaded transformers ``model``: its facts, ``backend`` (None: dynamic
    caches; the one place that default is written) and ``tokenizer`` (None: a target only measured or tested; its
    end tokens then come from the model's generation config alone)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    return Target(
        backend=backend or DynamicBackend(model), tokenizer=tokenizer, end_token_ids=default_eos_ids(model, tokenizer),
        vocab_size=logits_vocab_size(model), dtype=model_dtype(model), device=str(input_device(model)), name=name,
        max_positions=int(positions) if isinstance(positions, int) and positions > 0 else None, profile=profile,
        kind=type(model).__name__, input_vocab_size=int(model.get_input_embeddings().weight.shape[0]))


def as_target(what: Any) -> Target:
    """``what`` if it is a :class:`~shared.target.Target`, else the target of the loaded torch model ``what`` on
    dynamic caches (profiling, benchmarks and tests that hold a bare model)."""
    return what if isinstance(what, Target) else torch_target(what)
