"""A VerifierServer built from its parts in this process (no from_config, no node processes): a tiny target,
sockets bound here, a client thread. Requests without a drafter take plain steps, batched, and equal ``generate``."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.batch import can_batch
from shared.kv import CachedLM
from shared.models import ThreadPlan
from shared.protocol import Done, Generate, Ping, Pong, decode, encode
from testkit.tiny_models import reference_greedy
from verifier_node.scheduler import BatchLimits
from verifier_node.server import VerifierServer, VerifierSettings, VerifierSockets

pytestmark = pytest.mark.unit

_names = itertools.count()


def _server(target) -> tuple[VerifierServer, str]:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    ctx = zmq.Context.instance()
    name = f"inproc://verifier-parts-{next(_names)}"
    drafter, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    drafter.bind(f"{name}-drafters")
    client.bind(f"{name}-clients")
    settings = VerifierSettings(model_name=str(target), draft_timeout_s=3.0, max_sessions=8,
                                max_message_bytes=1 << 20, client_timeout_s=60.0, ensemble_weight=None,
                                drafter_endpoint=f"{name}-drafters", client_endpoint=f"{name}-clients")
    limits = BatchLimits(can_batch(CachedLM(model)), 8, 1024, 2048)
    server = VerifierServer(settings, model, tokenizer, None, ThreadPlan(share=1, full=1), limits,
                            VerifierSockets(drafter, client))
    return server, f"{name}-clients"


def test_a_server_built_from_parts_serves_plain_steps_batched(tiny):
    target = tiny("llama")
    server, endpoint = _server(target)
    prompts = {1: [5, 17, 33, 2, 60, 6, 7, 8], 2: [9, 9, 8, 7, 6, 5, 4, 3]}
    got: dict[int, object] = {}
    failure: list[BaseException] = []

    def client() -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            for rid, prompt in prompts.items():
                sock.send_multipart(encode(Generate(request_id=rid, token_ids=prompt,
                                                    params={"max_new_tokens": 6, "eos_token_ids": []})))
            while len(got) < len(prompts):
                if not sock.poll(60_000):
                    raise TimeoutError("no answer from the verifier")
                msg = decode(sock.recv_multipart())
                if isinstance(msg, Done):
                    got[msg.request_id] = msg
            sock.send_multipart(encode(Ping()))
            while not isinstance(msg := decode(sock.recv_multipart()), Pong):
                pass
            got["pong"] = msg
        except BaseException as exc:  # reported by the test, not lost in the thread
            failure.append(exc)
        finally:
            sock.close(linger=0)
            server.stop()

    # The server loops in a worker thread, as a node inside an actor does (signal handlers are the entry point's).
    serving = threading.Thread(target=server.serve)
    serving.start()
    client()  # stops the server when done
    serving.join(timeout=120)
    assert not serving.is_alive() and not failure, failure
    for rid, prompt in prompts.items():
        assert got[rid].token_ids == reference_greedy(target, prompt, 6), rid
    pong = got["pong"]
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
