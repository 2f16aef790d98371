"""The registry of drafter types: config name → implementing class (imported only when used)."""

from __future__ import annotations

import importlib

DRAFTER_TYPES: dict[str, str] = {
    "assistant": "drafter_node.assistant:AssistantDrafter",
    "prompt_lookup": "drafter_node.prompt_lookup:PromptLookupDrafter",
    "early_exit": "drafter_node.early_exit:EarlyExitDrafter",
    "mtp": "drafter_node.mtp:MTPDrafter",
    "mtp_drafter": "drafter_node.mtp_drafter:AssistantMTPDrafter",
    "universal": "drafter_node.universal:UniversalDrafter",
}


def drafter_class(name: str):
    module, _, cls = DRAFTER_TYPES[name].partition(":")
    return getattr(importlib.import_module(module), cls)
