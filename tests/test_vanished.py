"""Clients that vanish free what they hold (issue 43, docs/security.md "Per-tenant shares and vanished clients"), over
real ZeroMQ sockets: 64 hand-played clients each send a 60-token request that holds the verifier's whole KV budget,
then vanish without a cancel — their sockets closed, or silent with the sockets left open. A legitimate request sent
meanwhile waits for room (``verifier.admission_wait_s``) and is served within 2 s of the documented bound
(``CLOSED_GRACE_S`` + ``SWEEP_S`` for a closed connection, ``client.heartbeat_timeout_s`` + ``SWEEP_S`` for
silence), long before the vanished requests would have ended by themselves. Plus: a request over the 1 MiB header
cap is answered ``too_large`` with its request id."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from conftest import start_cluster, tiny_config

from shared.protocol import MAX_HEADER_BYTES, Error, Generate, Ping, Pong, decode, encode
from testkit.tiny_models import reference_greedy
from verifier_node.liveness import CLOSED_GRACE_S, SWEEP_S

pytestmark = pytest.mark.cluster

CLIENTS = 64
PROMPT = [(7 * i) % 200 + 3 for i in range(60)]  # 60 tokens
NEW = 400  # each vanished request's new tokens: at 0.05 s a forward, 20 s or more to end by itself
HEARTBEAT_TIMEOUT_S = 1.0


async def _vanishing_clients(ctx: zmq.asyncio.Context, endpoint: str) -> list[zmq.asyncio.Socket]:
    """``CLIENTS`` raw DEALERs, each with one request in flight (its pong says the generate arrived)."""
    socks = []
    for i in range(CLIENTS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        await sock.send_multipart(encode(Generate(request_id=i + 1, params={"max_new_tokens": NEW,
                                                                            "eos_token_ids": []},
                                                  token_ids=PROMPT)))
        await sock.send_multipart(encode(Ping()))
        socks.append(sock)
    for sock in socks:
        while True:
            assert await sock.poll(20_000), "no pong from the verifier"
            reply = decode(await sock.recv_multipart())
            assert not isinstance(reply, Error), reply
            if isinstance(reply, Pong):
                break
    return socks


async def _too_large(ctx: zmq.asyncio.Context, endpoint: str) -> Error:
    """A generate whose header is past the 1 MiB cap: the verifier's answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        frames = encode(Generate(request_id=4242, params={}, prompt="x" * (MAX_HEADER_BYTES + 10)))
        assert len(frames[0]) > MAX_HEADER_BYTES
        await sock.send_multipart(frames)
        assert await sock.poll(20_000), "no answer to an over-size request"
        return decode(await sock.recv_multipart())
    finally:
        sock.close()


@pytest.mark.parametrize("how", ["closed", "silent"])
def test_a_legitimate_request_is_served_soon_after_64_clients_vanish(tiny, how):
    target = tiny("llama")
    config = tiny_config(target, None)
    config["launch"]["start_drafter"] = False
    config["verifier"]["max_kv_tokens"] = CLIENTS * (len(PROMPT) + NEW)  # the vanished requests hold all of it
    config["verifier"]["admission_wait_s"] = 15.0
    # closed: the default 5 s of silence would come too late, so only the closed connection can free them in time
    config["client"]["heartbeat_timeout_s"] = 5.0 if how == "closed" else HEARTBEAT_TIMEOUT_S
    bound = (CLOSED_GRACE_S if how == "closed" else HEARTBEAT_TIMEOUT_S) + SWEEP_S

    async def main():
        async with start_cluster(config, hooks={"verifier": "forward_delay=0.05"}, launcher="process") as client:
            endpoint = client.config["client"]["endpoint"]
            ctx = zmq.asyncio.Context()
            try:
                too_large = await _too_large(ctx, endpoint) if how == "closed" else None
                socks = await _vanishing_clients(ctx, endpoint)
                assert (await client.ping())["sessions"] == CLIENTS
                t0 = time.monotonic()
                if how == "closed":
                    for sock in socks:
                        sock.close()
                result = await client.generate(token_ids=PROMPT, max_new_tokens=10, eos_token_ids=[])
                served_s = time.monotonic() - t0
                left = (await client.ping())["sessions"]
            finally:
                ctx.destroy(linger=0)
            return too_large, result, served_s, left

    too_large, result, served_s, left = asyncio.run(main())
    print(f"\n{how}: served {served_s:.2f} s after {CLIENTS} clients vanished (bound {bound:.2f} s; busy machine)")
    assert result.token_ids == reference_greedy(target, PROMPT, 10)
    assert served_s < bound + 2.0, f"served {served_s:.2f} s after they vanished: past the bound ({bound} s) + 2 s"
    assert left == 0  # every vanished session ended (the legitimate one is done too)
    if too_large is not None:
        assert too_large.code == "too_large" and too_large.request_id == 4242, too_large
