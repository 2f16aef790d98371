"""``gguf``: a GGUF model run by llama.cpp drafts for a torch target (``drafter_node/gguf.py``).

``drafter.model`` is a ``.gguf`` file or a named model (whose GGUF file is installed as it is, not converted).
The type needs llama-cpp-python, which ``make setup`` builds for the machine's CPU (``make setup-gguf``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from drafter_node.spec import DrafterSpec, Normalised, SpecError


def gguf_file_problem(path: str) -> str | None:
    """Why ``path`` is not a GGUF file (unreadable, or not starting with the GGUF magic), or None: the one check
    of the config loader and of the drafter node, which may run on another host than the one that loaded it."""
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return f"it is not a readable file: {exc.strerror}"
    return None if magic == b"GGUF" else "it is not a GGUF file (it does not start with 'GGUF')"


def _check(config: Mapping[str, Mapping[str, Any]]) -> Normalised:
    """``drafter.model``: a named model or a readable file that starts with the GGUF magic (returned absolute: the
    node runs in another directory); ``drafter.device``: cpu (llama.cpp's CPU build)."""
    from shared.named_models import NAMED_MODELS

    drafter = config["drafter"]
    value = drafter["model"]
    if not value or not isinstance(value, str):
        raise SpecError("drafter.model: missing model (a .gguf file or a named model)")
    if drafter["device"] != "cpu":
        raise SpecError(f"drafter.device: the gguf type runs llama.cpp's CPU build, got {drafter['device']!r}")
    if value in NAMED_MODELS:
        return {}
    problem = gguf_file_problem(value)
    if problem is not None:
        raise SpecError(f"drafter.model: {value!r} is not a GGUF file or a named model "
                        f"({', '.join(NAMED_MODELS)}): {problem}")
    return {"model": os.path.abspath(os.path.expanduser(value))}


SPEC = DrafterSpec(
    name="gguf",
    cls="drafter_node.gguf:GGUFDrafter",
    title="a GGUF model in llama.cpp",
    model_file=True,
    check=_check,
    requires=(("llama_cpp", "make setup-gguf (builds llama-cpp-python for this CPU; pip install 'pipespec[gguf]' "
                            "with the flags of scripts/build_llama_cpp.py --print-flags)"),),
    profile_skip="gguf measures llama.cpp's forwards at node start-up (pipespec profile measures torch models)",
    transformers="none (llama.cpp's own draft model: `llama-server -md`)",
    drafts_with="a GGUF model in llama.cpp",
    holds="a GGUF model run by llama.cpp (no conversion), one llama.cpp sequence of its KV memory per session",
    conformance="testkit.tiny_gguf:conformance",
)
