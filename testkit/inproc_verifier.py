"""A verifier built from parts in the test's own process (no node process, no start-up profile): the target loaded
with transformers, inproc ZeroMQ sockets, settings given per test; and a client that sends token-id requests and
collects their ``done`` messages while the server loops in a worker thread, as a node inside an actor does."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.backend import torch_target
from shared.models import ThreadPlan
from shared.protocol import Done, Generate, Ping, Pong, decode, encode
from verifier_node.scheduler import BatchLimits
from verifier_node.server import VerifierServer, VerifierSettings, VerifierSockets

_names = itertools.count()


def verifier_from_parts(target: Any, *, model: Any = None, **kwargs: Any) -> tuple[VerifierServer, str]:
    """A :class:`VerifierServer` on ``target`` (float32; ``model``: already loaded) and its client endpoint.
    ``kwargs``: :class:`VerifierSettings` fields over the tests' defaults, and ``backend``, ``prep_hook``,
    ``forward_delay_s`` for the server itself. Batching where the target can (8 sessions, 1024 / 2048 tokens)."""
    server_args = {k: kwargs.pop(k) for k in ("prep_hook", "forward_delay_s") if k in kwargs}
    backend = kwargs.pop("backend", None)
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ctx = zmq.Context.instance()
    name = f"inproc://verifier-parts-{next(_names)}"
    drafter, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    drafter.bind(f"{name}-drafters")
    client.bind(f"{name}-clients")
    settings = {"model_name": str(target), "draft_timeout_s": 3.0, "max_sessions": 8, "max_message_bytes": 1 << 20,
                "client_timeout_s": 60.0, "ensemble_weight": None, "drafter_endpoint": f"{name}-drafters",
                "client_endpoint": f"{name}-clients", **kwargs}
    parts = torch_target(model, AutoTokenizer.from_pretrained(target), backend, name=str(target))
    limits = BatchLimits(parts.backend.can_batch(), 8, 1024, 2048)
    server = VerifierServer(VerifierSettings(**settings), parts, ThreadPlan(share=1, full=1), limits,
                            VerifierSockets(drafter, client), **server_args)
    return server, f"{name}-clients"


def serve_requests(server: VerifierServer, endpoint: str, prompts: dict[int, list[int]], max_new_tokens: int,
                   *, ping: bool = False) -> tuple[dict[int, Done], Pong | None]:
    """Serve ``server`` in a worker thread while one client sends each of ``prompts`` (greedy, no EOS) and waits for
    every ``done``; then, with ``ping``, asks for a pong (returned). The server is stopped at the end; a failure in
    either thread is raised here."""
    got: dict[int, Done] = {}
    after: list[Pong] = []
    failure: list[BaseException] = []

    def client() -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            for rid, prompt in prompts.items():
                sock.send_multipart(encode(Generate(request_id=rid, token_ids=prompt,
                                                    params={"max_new_tokens": max_new_tokens, "eos_token_ids": []})))
            while len(got) < len(prompts):
                if not sock.poll(60_000):
                    raise TimeoutError("no answer from the verifier")
                msg = decode(sock.recv_multipart())
                if isinstance(msg, Done):
                    got[msg.request_id] = msg
            if ping:
                sock.send_multipart(encode(Ping()))
                while not isinstance(msg := decode(sock.recv_multipart()), Pong):
                    pass
                after.append(msg)
        except BaseException as exc:  # reported to the test, not lost in the thread
            failure.append(exc)
        finally:
            sock.close(linger=0)
            server.stop()

    serving = threading.Thread(target=server.serve)
    serving.start()
    client()
    serving.join(timeout=120)
    if failure:
        raise failure[0]
    if serving.is_alive():
        raise TimeoutError("the verifier did not stop")
    return got, after[0] if after else None
