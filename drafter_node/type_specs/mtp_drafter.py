"""``mtp_drafter``: a drafter checkpoint that reads the target's state, Gemma 4 ``-assistant``
(``drafter_node/mtp_drafter.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drafter_node.spec import DrafterSpec, LocalFolder


def _check_model(config: Mapping[str, Mapping[str, Any]], local: LocalFolder) -> None:
    target, assistant = local(config["drafter"]["target_model"]), local(config["drafter"]["model"])
    if target is None or assistant is None:
        return
    from transformers import AutoConfig

    from drafter_node.mtp_drafter import kv_layers_for

    kv_layers_for(AutoConfig.from_pretrained(str(target)), AutoConfig.from_pretrained(str(assistant)))


SPEC = DrafterSpec(
    name="mtp_drafter",
    cls="drafter_node.mtp_drafter:AssistantMTPDrafter",
    title="an MTP drafter checkpoint",
    reads_target=True,  # the target's config and input embeddings
    check_model=_check_model,
    profile_skip="mtp_drafter drafts from the target's state (not profiled)",
    transformers="`assistant_model=` a Gemma 4 `-assistant`",
    drafts_with="a drafter checkpoint that reads the target's state (Gemma 4 `-assistant`)",
    holds="a separate drafter checkpoint that reads the target's state (Gemma 4 `-assistant`, "
          "`Gemma4AssistantForCausalLM`) + the target's input embedding table (read alone; no target layer is "
          "loaded)",
    conformance="testkit.conformance:mtp_drafter",
)
