"""Prometheus metrics of the HTTP server, in a registry of its own (not prometheus_client's global one, so several
apps in one process — tests — do not collide). Names follow vLLM's ``spec_decode`` counters with a ``pipespec_``
prefix; counters are declared without ``_total``, which prometheus_client appends."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.client import live_drafters
from shared.spec_rates import SpecCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class HttpMetrics:
    """Counters fed by each finished request (:meth:`record`), gauges refreshed from the verifier's ``pong`` on
    every scrape (:meth:`render`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.drafts = Counter("pipespec_spec_decode_num_drafts", "Drafts verified", registry=r)
        self.draft_tokens = Counter("pipespec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("pipespec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("pipespec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0: the first)", ["position"],
                                        registry=r)
        self.requests = Counter("pipespec_requests", "Requests finished over HTTP, by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("pipespec_request_errors", "Requests failed over HTTP, by error code", ["code"],
                              registry=r)
        self.generated = Counter("pipespec_generated_tokens", "Tokens generated for HTTP requests", registry=r)
        self.ttft = Histogram("pipespec_time_to_first_token_seconds",
                              "Request received → first text from the verifier, seconds", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.latency = Histogram("pipespec_request_latency_seconds", "Request received → response complete, seconds",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("pipespec_running_sessions", "Sessions running on the verifier (at the last scrape)",
                             registry=r)
        self.drafters = Gauge("pipespec_drafters_connected", "Live drafters in the verifier's pool, by type",
                              ["type"], registry=r)
        self.verifier_up = Gauge("pipespec_verifier_up", "1 when the verifier answered the scrape's ping in time",
                                 registry=r)

    def record(self, finish_reason: str, metrics: dict[str, Any] | None, ttft_s: float | None,
               latency_s: float) -> None:
        """One finished request (``metrics``: the verifier's, None when it gave none)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if not metrics:
            return
        counts = SpecCounts.of(metrics)  # Prometheus takes α and τ as ratios of these counters' rates
        self.drafts.inc(counts.drafts)
        self.draft_tokens.inc(counts.draft_tokens)
        self.accepted_tokens.inc(counts.accepted_tokens)
        self.generated.inc(metrics.get("new_tokens") or 0)
        for position, count in enumerate(metrics.get("per_position_accepted") or []):
            self.accepted_per_pos.labels(position=str(position)).inc(count)

    def record_error(self, code: str | None) -> None:
        self.errors.labels(code=code or "error").inc()

    async def render(self, client: Any, timeout_s: float) -> bytes:
        """The exposition text, after asking the verifier for its state (at most ``timeout_s``)."""
        try:
            pong = await asyncio.wait_for(client.ping(timeout_s=timeout_s), timeout_s + 0.5)
        except (TimeoutError, asyncio.TimeoutError, Exception):  # a scrape must answer, whatever the verifier does
            self.verifier_up.set(0)
        else:
            self.verifier_up.set(1)
            self.running.set(pong.get("sessions") or 0)
            live = Tally(d.get("type") or "unknown" for d in live_drafters(pong))
            with contextlib.suppress(Exception):
                self.drafters.clear()  # types that left the pool drop out
            for kind, count in live.items():
                self.drafters.labels(type=kind).set(count)
        return generate_latest(self.registry)
