"""Who a request is for: its tenant, the principal that authenticated it (docs/security.md).

On a client link without CURVE (loopback or ipc by design, or ``allow_remote`` on a private network) every client
is trusted: a request's ``generate.tenant`` is its tenant, None when it names none. Under CURVE a client is the
tenant of its public key (ZAP's User-Id), and only a gateway (``security.gateway_clients``: the run's own HTTP
server by default) may name another tenant in ``generate.tenant``; anyone else who does is refused
(``unauthorized``). A tenant leaves the verifier only as an opaque id, never a key or a name: an HMAC keyed with a
secret this verifier drew at start, so a drafter (or anyone who sees the id) cannot test a guessed name against it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from shared.protocol import Generate, ProtocolError


def opaque_id(principal: str, key: bytes) -> str:
    """The id a tenant travels as (``session_start.tenant``, the grammar cache's scope): HMAC-SHA256 of its
    principal under ``key`` (unsalted, a tenant named ``alice`` would travel as a hash anyone can recompute)."""
    return hmac.new(key, principal.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class TenantRule:
    """The client link's trust: ``curve`` (it runs CURVE) and ``gateways`` (z85 public keys allowed to name a
    tenant there)."""

    curve: bool = False
    gateways: frozenset[str] = frozenset()
    #: The HMAC key of tenant ids: drawn per verifier run, never sent anywhere.
    id_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def tenant_of(self, msg: Generate, user_id: str | None) -> str | None:
        """The opaque tenant id of ``msg`` sent by the peer whose ZAP User-Id is ``user_id`` (None: no tenant)."""
        if not self.curve:
            return None if msg.tenant is None else opaque_id("name:" + msg.tenant, self.id_key)
        if not user_id:  # a CURVE link always has one: refuse rather than guess
            raise ProtocolError("no authenticated client key on a CURVE link", "unauthorized", msg.request_id)
        if msg.tenant is None:
            return opaque_id("key:" + user_id, self.id_key)
        if user_id not in self.gateways:
            raise ProtocolError("generate.tenant may be set only by a gateway client (security.gateway_clients); "
                                "leave it out: your key is your tenant", "unauthorized", msg.request_id)
        return opaque_id("name:" + msg.tenant, self.id_key)
