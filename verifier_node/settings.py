"""What a :class:`verifier_node.server.VerifierServer` is built from besides its target: the settings it reads of
the config (:class:`VerifierSettings`, taken once) and its two bound ROUTER sockets with the CURVE authenticator
guarding them (:class:`VerifierSockets`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from shared.config import Config
from shared.config_sections import VerifierConfig
from shared.transport import CLIENT_DOMAIN, DRAFTER_DOMAIN, Authenticator, VerifierLinks, bind_router
from verifier_node.acceptance import check_ensemble_weight
from verifier_node.tenancy import TenantRule

log = logging.getLogger("pipespec.verifier")


@dataclass(frozen=True)
class VerifierSettings:
    """What the running server reads of the config (taken once by :meth:`from_config`)."""

    model_name: str
    draft_timeout_s: float  # the cap on a session's wait for a draft
    max_sessions: int
    max_message_bytes: int
    client_timeout_s: float  # a client silent this long (no heartbeat ping, no message) has gone
    ensemble_weight: float | None  # static ensemble verification (lossy by design), None: off
    drafter_endpoint: str
    client_endpoint: str
    # request preparation and admission (verifier_node.request_prep, verifier_node.admission): the config's
    # defaults (declared in shared/config_sections.py); None: resolved by MemoryAdmission
    max_pending_requests: int = VerifierConfig.max_pending_requests
    grammar_compile_timeout_s: float = VerifierConfig.grammar_compile_timeout_s
    grammar_cache_bytes: int = VerifierConfig.grammar_cache_bytes
    grammar_mask_budget_ms: float = VerifierConfig.grammar_mask_budget_ms
    max_model_len: int | None = None
    max_kv_tokens: int | None = None
    max_sessions_per_tenant: int | None = None  # None: no cap beyond max_sessions (see resolved_tenant_caps)
    max_kv_tokens_per_tenant: int | None = None  # None: resolved by MemoryAdmission (a fair share, or none)
    tenants: int = 1  # tenants sharing the verifier (>= 2: fair per-tenant defaults, verifier_node/admission.py)
    admission_wait_s: float = VerifierConfig.admission_wait_s
    max_waiting_requests: int = VerifierConfig.max_waiting_requests

    @classmethod
    def from_config(cls, config: Config) -> VerifierSettings:
        v = config.verifier
        weight = config.verification.ensemble_weight
        check_ensemble_weight(weight)
        return cls(model_name=v.model, draft_timeout_s=v.draft_timeout_ms / 1000, max_sessions=v.max_sessions,
                   max_message_bytes=v.max_message_bytes, client_timeout_s=float(config.client.heartbeat_timeout_s),
                   ensemble_weight=weight, drafter_endpoint=v.endpoint, client_endpoint=config.client.endpoint,
                   max_pending_requests=v.max_pending_requests, grammar_compile_timeout_s=v.grammar_compile_timeout_s,
                   grammar_cache_bytes=v.grammar_cache_bytes, grammar_mask_budget_ms=v.grammar_mask_budget_ms,
                   max_model_len=v.max_model_len,
                   max_kv_tokens=v.max_kv_tokens, max_sessions_per_tenant=v.max_sessions_per_tenant,
                   max_kv_tokens_per_tenant=v.max_kv_tokens_per_tenant, tenants=v.tenants or 1,
                   admission_wait_s=float(v.admission_wait_s), max_waiting_requests=v.max_waiting_requests)


@dataclass
class VerifierSockets:
    """The verifier's two bound ROUTER sockets (drafters, clients) and the CURVE authenticator guarding them (None:
    no CURVE on either link)."""

    drafter: zmq.Socket
    client: zmq.Socket
    auth: Authenticator | None = None
    tenancy: TenantRule = field(default_factory=TenantRule)  # who may name a request's tenant

    @classmethod
    def bind(cls, config: Config, links: VerifierLinks) -> VerifierSockets:
        """Bind both endpoints of ``config``, each with CURVE where ``links`` says its link runs it."""
        ctx = zmq.Context.instance()
        allow_remote = config.verifier.allow_remote
        keys = links.keys
        auth = Authenticator(ctx, keys, log) if keys else None  # before binding: no key is let in unchecked
        try:
            drafter = bind_router(ctx, config.verifier.endpoint, allow_remote, domain=DRAFTER_DOMAIN,
                                  auth=auth if links.curve_drafters else None)
            client = bind_router(ctx, config.client.endpoint, allow_remote,
                                 auth=auth if links.curve_clients else None, domain=CLIENT_DOMAIN)
        except BaseException:
            if auth is not None:
                auth.close()
            raise
        log.info("CURVE: drafter link %s, client link %s", "on" if links.curve_drafters else "off",
                 "on" if links.curve_clients else "off")
        return cls(drafter, client, auth, TenantRule(links.curve_clients, links.gateways))

    def close(self) -> None:
        for sock in (self.drafter, self.client):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.close()
