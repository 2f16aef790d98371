"""Prompts as the benchmarks send them: token ids from the target's chat template, as the verifier templates the
same messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def prompt_dir() -> Path:
    """The prompt files (``code_prompts.json``, ``edit_prompts.json``, the public sets ``humaneval_prompts.json`` and
    ``mt_bench_prompts.json``): package data ``benchmarks/prompt_files/`` in an installed package (pyproject.toml maps
    the checkout's ``scripts/prompts/`` there), else the checkout's."""
    from importlib.resources import files

    packaged = Path(str(files("benchmarks") / "prompt_files"))
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "scripts" / "prompts"


def chat_prompts(tokenizer: Any, messages: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """``{"ids", "messages"}`` per prompt: the target's chat template with the generation prompt, as the verifier
    templates ``messages``."""
    return [{"messages": m, "ids": list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=True)["input_ids"])}
            for m in messages]


def load_prompts(path: Path) -> list[dict[str, Any]]:
    """The prompts of a prompt file: a JSON list of ``{"id", "messages", "category"?}``, or (the vendored public sets,
    which carry their source and license) an object whose ``"prompts"`` is that list."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not all(isinstance(p, dict) and isinstance(p.get("messages"), list)
                                                for p in prompts):
        raise ValueError(f"{path}: expected a list of {{id, messages}} prompts, or an object with one as 'prompts'")
    return prompts
