"""A VerifierServer built from its parts in this process (no from_config, no node processes): a tiny target,
sockets bound here, a client thread. Requests without a drafter take plain steps, batched, and equal ``generate``."""

from __future__ import annotations

import threading

import pytest

from testkit.inproc_verifier import serve_requests, verifier_from_parts
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.unit


def test_a_server_built_from_parts_serves_plain_steps_batched(tiny):
    target = tiny("llama")
    server, endpoint = verifier_from_parts(target)
    prompts = {1: [5, 17, 33, 2, 60, 6, 7, 8], 2: [9, 9, 8, 7, 6, 5, 4, 3]}
    # The server loops in a worker thread, as a node inside an actor does (signal handlers are the entry point's).
    got, pong = serve_requests(server, endpoint, prompts, 6, ping=True)
    for rid, prompt in prompts.items():
        assert got[rid].token_ids == reference_greedy(target, prompt, 6), rid
    assert pong is not None
    assert pong.sessions == 0 and not pong.drafter_connected and pong.forwards >= 1
    assert server.batching and pong.mean_batch_sessions > 1.0  # both requests' plain steps shared forwards


def test_signal_handlers_belong_to_the_entry_point_in_the_main_thread():
    import os
    import signal

    from shared.signals import stop_on_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopped: list[str] = []
    try:
        assert stop_on_signals(lambda: stopped.append("stop"))
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped == ["stop"]
        elsewhere: list[bool] = []
        worker = threading.Thread(target=lambda: elsewhere.append(stop_on_signals(lambda: None)))
        worker.start()
        worker.join()
        assert elsewhere == [False]  # no handler from a worker thread (signal.signal would raise there)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
