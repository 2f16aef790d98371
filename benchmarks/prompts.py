"""Prompts as the benchmarks send them: token ids from the target's chat template, as the verifier templates the
same messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def prompt_dir() -> Path:
    """The prompt files (``code_prompts.json``, ``edit_prompts.json``): package data ``benchmarks/prompt_files/``
    in an installed package (pyproject.toml maps the checkout's ``scripts/prompts/`` there), else the checkout's."""
    from importlib.resources import files

    packaged = Path(str(files("benchmarks") / "prompt_files"))
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "scripts" / "prompts"


def chat_prompts(tokenizer: Any, messages: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """``{"ids", "messages"}`` per prompt: the target's chat template with the generation prompt, as the verifier
    templates ``messages``."""
    return [{"messages": m, "ids": list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=True)["input_ids"])}
            for m in messages]
