"""Who a request is for: its tenant, the principal that authenticated it (docs/security.md).

On a client link without CURVE (loopback or ipc by design, or ``allow_remote`` on a private network) every client
is trusted: a request's ``generate.tenant`` is its tenant, None when it names none. Under CURVE a client is the
tenant of its public key (ZAP's User-Id), and only a gateway (``security.gateway_clients``: the run's own HTTP
server by default) may name another tenant in ``generate.tenant``; anyone else who does is refused
(``unauthorized``). A tenant leaves the verifier only as an opaque id (a hash), never a key or a name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shared.protocol import Generate, ProtocolError


def opaque_id(principal: str) -> str:
    """The id a tenant travels as (``session_start.tenant``, the grammar cache's scope): a hash of its principal."""
    return hashlib.sha256(principal.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class TenantRule:
    """The client link's trust: ``curve`` (it runs CURVE) and ``gateways`` (z85 public keys allowed to name a
    tenant there)."""

    curve: bool = False
    gateways: frozenset[str] = frozenset()

    def tenant_of(self, msg: Generate, user_id: str | None) -> str | None:
        """The opaque tenant id of ``msg`` sent by the peer whose ZAP User-Id is ``user_id`` (None: no tenant)."""
        if not self.curve:
            return None if msg.tenant is None else opaque_id("name:" + msg.tenant)
        if not user_id:  # a CURVE link always has one: refuse rather than guess
            raise ProtocolError("no authenticated client key on a CURVE link", "unauthorized", msg.request_id)
        if msg.tenant is None:
            return opaque_id("key:" + user_id)
        if user_id not in self.gateways:
            raise ProtocolError("generate.tenant may be set only by a gateway client (security.gateway_clients); "
                                "leave it out: your key is your tenant", "unauthorized", msg.request_id)
        return opaque_id("name:" + msg.tenant)
