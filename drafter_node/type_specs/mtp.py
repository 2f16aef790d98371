"""``mtp``: the multi-token-prediction layers shipped in the target checkpoint (``drafter_node/mtp.py``)."""

from __future__ import annotations

from typing import Any

from drafter_node.spec import DrafterSpec, LocalFolder


def _check_model(config: dict[str, Any], local: LocalFolder) -> None:
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
    conformance="testkit.conformance:mtp",
)
