"""``gguf``: a GGUF model run by llama.cpp drafts for a torch target (``drafter_node/gguf.py``).

``drafter.model`` is a ``.gguf`` file or a named model (whose GGUF file is installed as it is, not converted);
``drafter.gguf_sha256`` pins the file's hash. A GGUF file is as dangerous as code (docs/security.md).
The type needs llama-cpp-python, which ``make setup`` builds for the machine's CPU (``make setup-gguf``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drafter_node.spec import DrafterSpec, Normalised, SpecError
from shared.gguf_header import VOCAB_SLACK, GGUFHeaderError, check_gguf_header
from shared.gguf_vet import sha256_problem
from shared.llama_engine import gguf_file_problem
from shared.settings import setting


@dataclass(frozen=True)
class GGUFSettings:
    """``gguf``'s own ``drafter`` keys."""

    gguf_sha256: Any = setting(
        None, "SHA-256 (hex) the GGUF file must have; checked before llama.cpp reads it (null: not checked).",
        kind="str")
    gguf_sequence_tokens: Any = setting(
        None, "Most positions one session may hold in the shared llama.cpp KV memory (null: a quarter of it, at "
        "least kv_slot_tokens); a longer session is not drafted for.", kind="int", bounds=(1, None))


def target_vocab(verifier: Mapping[str, Any]) -> int | None:
    """The target's vocabulary size where the config loader can read it cheaply: a GGUF target's header, or a local
    model folder's ``config.json`` (``vocab_size``, or its ``text_config``'s); None otherwise (a hub id or a named
    model not installed yet: the verifier still refuses a longer vocabulary at connect)."""
    model = verifier.get("model")
    if not isinstance(model, str) or not model:
        return None
    path = os.path.expanduser(model)
    try:
        if os.path.isfile(path):
            return check_gguf_header(path).vocab_size
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            facts = json.load(fh)
    except (OSError, ValueError):
        return None
    size = facts.get("vocab_size") or (facts.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def _check(config: Mapping[str, Mapping[str, Any]]) -> Normalised:
    """``drafter.model``: a named model or a readable file that starts with the GGUF magic (returned absolute: the
    node runs in another directory); ``drafter.device``: cpu (llama.cpp's CPU build)."""
    from shared.named_models import NAMED_MODELS

    drafter = config["drafter"]
    value = drafter["model"]
    if not value or not isinstance(value, str):
        raise SpecError("drafter.model: missing model (a .gguf file or a named model)")
    if drafter.get("gguf_sha256") is not None and sha256_problem(drafter["gguf_sha256"]):
        raise SpecError(f"drafter.gguf_sha256: {sha256_problem(drafter['gguf_sha256'])}")
    if drafter["device"] != "cpu":
        raise SpecError(f"drafter.device: the gguf type runs llama.cpp's CPU build, got {drafter['device']!r}")
    if value in NAMED_MODELS:
        return {}
    problem = gguf_file_problem(value)
    if problem is not None:
        raise SpecError(f"drafter.model: {value!r} is not a GGUF file or a named model "
                        f"({', '.join(NAMED_MODELS)}): {problem}")
    target = target_vocab(config.get("verifier", {}))
    try:  # the header's bounds, early (the node reads it again before its llama.cpp does: it may be another host)
        check_gguf_header(value, None if target is None else target + VOCAB_SLACK)
    except GGUFHeaderError as exc:
        where = "" if target is None else f" (the target's vocabulary: {target:,} tokens, + {VOCAB_SLACK} slack)"
        raise SpecError(f"drafter.model: {value!r} is refused: {exc}{where}") from None
    return {"model": os.path.abspath(os.path.expanduser(value))}


SPEC = DrafterSpec(
    name="gguf",
    cls="drafter_node.gguf:GGUFDrafter",
    title="a GGUF model in llama.cpp",
    model_file=True,
    settings=GGUFSettings,
    check=_check,
    requires=(("llama_cpp", "make setup-gguf (builds llama-cpp-python for this CPU; pip install 'pipespec[gguf]' "
                            "with the flags of scripts/build_llama_cpp.py --print-flags)"),),
    profile_skip="gguf measures llama.cpp's forwards at node start-up (pipespec profile measures torch models)",
    transformers="none (llama.cpp's own draft model: `llama-server -md`)",
    drafts_with="a GGUF model in llama.cpp",
    holds="a GGUF model run by llama.cpp (no conversion), one llama.cpp sequence of its KV memory per session",
    conformance="testkit.tiny_gguf:conformance",
)
