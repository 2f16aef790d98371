"""``mtp``: the multi-token-prediction layers shipped in the target checkpoint (``drafter_node/mtp.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drafter_node.spec import DrafterSpec, LocalFolder


def _check_model(config: Mapping[str, Mapping[str, Any]], local: LocalFolder) -> None:
    folder = local(config["drafter"]["model"])
    if folder is None:
        return
    from drafter_node.mtp import check_mtp_checkpoint

    check_mtp_checkpoint(str(folder))


SPEC = DrafterSpec(
    name="mtp",
    cls="drafter_node.mtp:MTPDrafter",
    title="multi-token prediction",
    model_defaults_to_target=True,  # the MTP layers ship inside the target checkpoint
    check_model=_check_model,
    fixed_k="mtp drafts one token per MTP layer of the checkpoint",
    profile_skip="mtp drafts with modules fed by the target's hidden states (not profiled)",
    transformers="`use_mtp=True`",
    drafts_with="the multi-token-prediction layers shipped in the target checkpoint (DeepSeek-V3, GLM-4.5)",
    holds="only the MTP layers shipped in the target checkpoint (`model.layers.{L+j}.*`: enorm, hnorm, eh_proj, "
          "the block, shared_head norm) + embeddings + LM head, read tensor by tensor; fed with the target's "
          "final-norm hidden states that the verifier sends with each commit; K = `num_nextn_predict_layers` "
          "drafts per round",
    conformance="testkit.conformance:mtp",
)
