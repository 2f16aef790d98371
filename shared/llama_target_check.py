"""Config-time checks of ``verifier.backend: llama_cpp`` (the backend itself is :mod:`shared.llama_target`).

Light on purpose (no torch, no transformers, no llama.cpp): the config loader (``runtime.config``) imports it for
every config, llama.cpp target or not.
"""

from __future__ import annotations

import os
from typing import Any

from shared.llama_engine import gguf_file_problem

#: The backend's ``verifier.backend`` name.
NAME = "llama_cpp"


def check_config(config: dict[str, Any], target_states: str) -> None:
    """Config-time checks (ValueError naming the key): ``drafter.backend`` is not ``llama_cpp`` (a target backend);
    with ``verifier.backend: llama_cpp``, ``verifier.model`` is a named model or a GGUF file (made absolute),
    ``verifier.device`` is cpu or cuda, llama-cpp-python is installed and the drafter type does not need the
    target's torch forward (``target_states``: its spec's reason why it does, or "")."""
    import importlib.util

    from shared.named_models import NAMED_MODELS

    v, d = config["verifier"], config["drafter"]
    if d.get("backend") == NAME:
        raise ValueError("drafter.backend: llama_cpp is a target backend (verifier.backend); a llama.cpp drafter is "
                         "drafter.type: gguf")
    if v["backend"] != NAME:
        return
    model = v["model"]
    if not model or not isinstance(model, str):
        raise ValueError("verifier.model: missing model (backend llama_cpp: a .gguf file or a named model)")
    if model not in NAMED_MODELS:
        problem = gguf_file_problem(model)
        if problem is not None:
            raise ValueError(f"verifier.model: backend llama_cpp loads a GGUF file or a named model "
                             f"({', '.join(NAMED_MODELS)}); {model!r}: {problem}")
        v["model"] = os.path.abspath(os.path.expanduser(model))
    if not isinstance(v["device"], str) or not (v["device"] == "cpu" or v["device"].startswith("cuda")):
        raise ValueError(f"verifier.device: backend llama_cpp runs on cpu or cuda, got {v['device']!r}")
    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("verifier.backend: llama_cpp needs llama-cpp-python, which is not installed: make setup-gguf")
    if target_states:
        raise ValueError(f"drafter.type: {d['type']} cannot draft for a llama_cpp target: {target_states}; "
                         "llama.cpp runs the target with no torch forward to share: no hidden states, K/V rows or "
                         "layers (use gguf, assistant, prompt_lookup, suffix or universal)")
