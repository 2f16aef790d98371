"""Admission by memory: a request is admitted only if its tokens fit the verifier's bounds, so a burst of long
requests gets ``busy`` (HTTP 429) instead of running the target out of memory.

Two bounds (config keys of the ``verifier`` section):

* ``max_model_len``: prompt + ``max_new_tokens`` of one request (null: the target's ``max_position_embeddings``,
  or :data:`DEFAULT_MAX_MODEL_LEN` for a target that states none). The check is never skipped.
* ``max_kv_tokens``: the sum over admitted sessions of prompt + ``max_new_tokens`` — the KV cache they may grow
  to (null: the KV backend's ``capacity_tokens()``, e.g. static slots × slot tokens, where it has a bound, else
  :data:`DEFAULT_KV_TOKENS`).

A request that does not fit *now* is refused with ``busy`` (retry later); one that can never fit (past either bound
on its own) is a ``bad_request`` naming the key. Pure: the verifier passes the tokens its sessions hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.protocol import ProtocolError
from shared.sampling import ParamError

log = logging.getLogger("pipespec.verifier")

#: ``max_model_len`` for a target whose config has no ``max_position_embeddings`` (state-space models, …).
DEFAULT_MAX_MODEL_LEN = 32768
#: ``max_kv_tokens`` where the backend has no bound of its own (dynamic caches).
DEFAULT_KV_TOKENS = 65536


@dataclass(frozen=True)
class MemoryAdmission:
    """The two bounds, resolved (see the module's docstring)."""

    max_model_len: int
    max_kv_tokens: int

    @classmethod
    def resolve(cls, max_model_len: int | None, max_kv_tokens: int | None, max_positions: int | None,
                capacity_tokens: int | None) -> MemoryAdmission:
        """The bounds from the config keys (None: their defaults), the target's context ``max_positions`` (None:
        it states none) and its KV backend's ``capacity_tokens()`` (None: no bound of its own). A
        ``max_model_len`` past the target's context is refused (ValueError: the node does not start)."""
        if max_model_len is None:
            if max_positions:
                max_model_len = int(max_positions)
            else:
                max_model_len = DEFAULT_MAX_MODEL_LEN
                log.warning("verifier: the target states no max_position_embeddings; max_model_len defaults to %d "
                            "(set verifier.max_model_len)", max_model_len)
        elif max_positions and max_model_len > max_positions:
            raise ValueError(f"verifier.max_model_len ({max_model_len}) exceeds the target's context "
                             f"(max_position_embeddings = {max_positions})")
        if max_kv_tokens is None:
            max_kv_tokens = int(capacity_tokens) if capacity_tokens else DEFAULT_KV_TOKENS
        return cls(int(max_model_len), int(max_kv_tokens))

    def check(self, prompt_len: int, max_new_tokens: int, in_use: int, request_id: int | None = None) -> None:
        """Refuse a request of ``prompt_len`` + ``max_new_tokens`` tokens while sessions hold ``in_use``: a
        :class:`ParamError` if it can never fit, ``busy`` if it does not fit now."""
        need = prompt_len + max_new_tokens
        if need > self.max_model_len:
            raise ParamError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the context this verifier serves, verifier.max_model_len ({self.max_model_len})")
        if need > self.max_kv_tokens:
            raise ParamError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"verifier's whole KV budget, verifier.max_kv_tokens ({self.max_kv_tokens})")
        if in_use + need > self.max_kv_tokens:
            raise ProtocolError(f"verifier's KV budget is taken ({in_use} of verifier.max_kv_tokens = "
                                f"{self.max_kv_tokens} tokens held; this request needs {need}): retry later",
                                "busy", request_id)
