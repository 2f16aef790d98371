"""The client's reading of replies: a reply it cannot decode (a ``done`` whose header is over the 1 MiB cap) ends its
own request at once with the reason, instead of leaving it to wait for its timeout; other requests go on. A fake
verifier on a real ZeroMQ ROUTER socket sends the replies."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from runtime.client import AsyncClient, PipespecError
from shared.protocol import MAX_HEADER_BYTES, Done, Generate, Ping, Pong, decode, encode

pytestmark = pytest.mark.unit


async def _fake_verifier(sock: zmq.asyncio.Socket) -> None:
    """Answers pings; a generate for "huge" gets a ``done`` whose header is over the cap, any other a plain one."""
    while True:
        peer, *body = await sock.recv_multipart()
        msg = decode(body)
        if isinstance(msg, Ping):
            await sock.send_multipart([peer, *encode(Pong(drafter_connected=True))])
        elif isinstance(msg, Generate):
            text = "x" * (MAX_HEADER_BYTES + 10) if msg.prompt == "huge" else "ok"
            await sock.send_multipart([peer, *encode(Done(request_id=msg.request_id, token_ids=[1], text=text,
                                                          metrics={}, finish_reason="length"))])


async def test_an_unreadable_reply_fails_its_request_at_once(tmp_path):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/verifier.ipc"
    sock.bind(address)
    server = asyncio.create_task(_fake_verifier(sock))
    try:
        async with AsyncClient(address, timeout_s=60) as client:
            start = time.monotonic()
            with pytest.raises(PipespecError, match=r"could not be read.*exceeds the limit") as info:
                await client.generate("huge", max_new_tokens=1)
            assert info.value.code == "too_large"
            assert time.monotonic() - start < 10  # not the 60 s timeout
            assert (await client.generate("fine", max_new_tokens=1)).text == "ok"  # the client goes on
    finally:
        server.cancel()
        sock.close(linger=0)
        ctx.term()
