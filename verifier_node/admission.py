"""Admission by memory: a request is admitted only if its tokens fit the verifier's bounds, so a burst of long
requests gets ``busy`` (HTTP 429) instead of running the target out of memory.

Two bounds (config keys of the ``verifier`` section):

* ``max_model_len``: prompt + ``max_new_tokens`` of one request (null: the target's ``max_position_embeddings``,
  or :data:`DEFAULT_MAX_MODEL_LEN` for a target that states none). The check is never skipped.
* ``max_kv_tokens``: the sum over admitted sessions of prompt + ``max_new_tokens`` — the KV cache they may grow
  to (null: the KV backend's ``capacity_tokens()``, e.g. static slots × slot tokens, where it has a bound, else
  :data:`DEFAULT_KV_TOKENS`).

Per tenant (docs/security.md, "Per-tenant shares and vanished clients"): ``max_kv_tokens_per_tenant``, the most of
that budget one tenant's sessions may hold, so one key cannot fill it for everyone else. Where a keys file names two or
more tenants, it and ``max_sessions_per_tenant`` default to a fair share (:func:`fair_share`), logged at start.

A request that does not fit *now* is refused with ``busy`` (retry later; the intake first lets it wait a bounded time:
:mod:`verifier_node.admission_wait`); one that can never fit (past a bound on its own) is a ``bad_request`` naming
the key. A ``busy`` message names only the caller's own use and limits, never what other tenants hold. Pure: the
verifier passes the tokens its sessions hold.
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
#: A fair share is 1/N of the budget for N tenants, but never less than 1/FAIR_SHARE_FLOOR of it: with many keys,
#: few are busy at once, and a share smaller than one long request would refuse it outright.
FAIR_SHARE_FLOOR = 8


def fair_share(total: int, tenants: int) -> int:
    """One tenant's fair part of ``total`` (tokens or sessions) among ``tenants``: ``total // min(tenants, 8)``, at
    least 1."""
    return max(1, total // max(1, min(tenants, FAIR_SHARE_FLOOR)))


@dataclass(frozen=True)
class MemoryAdmission:
    """The two bounds, resolved (see the module's docstring)."""

    max_model_len: int
    max_kv_tokens: int
    per_tenant: int | None = None  # max_kv_tokens_per_tenant (None: a tenant may hold the whole budget)

    @classmethod
    def resolve(cls, max_model_len: int | None, max_kv_tokens: int | None, max_positions: int | None,
                capacity_tokens: int | None, per_tenant: int | None = None, tenants: int = 1) -> MemoryAdmission:
        """The bounds from the config keys (None: their defaults), the target's context ``max_positions`` (None:
        it states none) and its KV backend's ``capacity_tokens()`` (None: no bound of its own). ``per_tenant``:
        ``max_kv_tokens_per_tenant`` (None: a fair share where ``tenants`` >= 2, else none). A ``max_model_len``
        past the target's context is refused (ValueError: the node does not start)."""
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
        if per_tenant is None and tenants >= 2:
            per_tenant = fair_share(int(max_kv_tokens), tenants)
        if per_tenant is not None:
            per_tenant = min(int(per_tenant), int(max_kv_tokens))
        return cls(int(max_model_len), int(max_kv_tokens), per_tenant)

    def check(self, prompt_len: int, max_new_tokens: int, in_use: int, request_id: int | None = None,
              own: int = 0) -> None:
        """Refuse a request of ``prompt_len`` + ``max_new_tokens`` tokens while sessions hold ``in_use`` tokens, the
        requester's tenant ``own`` of them: a :class:`ParamError` if it can never fit, ``busy`` if it does not fit
        now (its message names ``own`` and the limits, never the other tenants' use)."""
        need = prompt_len + max_new_tokens
        if need > self.max_model_len:
            raise ParamError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the context this verifier serves, verifier.max_model_len ({self.max_model_len})")
        if need > self.max_kv_tokens:
            raise ParamError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"verifier's whole KV budget, verifier.max_kv_tokens ({self.max_kv_tokens})")
        cap = self.per_tenant
        if cap is not None and need > cap:
            raise ParamError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds one "
                             f"tenant's share of the KV budget, verifier.max_kv_tokens_per_tenant ({cap})")
        if cap is not None and own + need > cap:
            raise ProtocolError(f"your requests hold {own} of your {cap} tokens (verifier.max_kv_tokens_per_tenant); "
                                f"this request needs {need}: retry later", "busy", request_id)
        if in_use + need > self.max_kv_tokens:
            raise ProtocolError(f"the verifier's KV budget (verifier.max_kv_tokens) is taken (your requests hold "
                                f"{own} tokens; this request needs {need}): retry later", "busy", request_id)
