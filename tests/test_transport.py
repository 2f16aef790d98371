"""Fast tests of shared.transport: endpoint checks and a real ROUTER/DEALER pair over ipc. No models, no nodes."""

from __future__ import annotations

import pytest
import torch
import zmq

from shared import transport
from shared.protocol import Commit, Draft, Error, ProtocolError, State, decode, encode, error_frames
from shared.transport import (
    HARD_FRAME_LIMIT,
    EndpointError,
    bind_router,
    check_endpoint,
    connect_dealer,
    is_local_endpoint,
)

pytestmark = pytest.mark.unit

LOCAL = [
    "ipc:///tmp/pipespec/verifier.ipc",
    "ipc://relative/path.ipc",
    "inproc://verifier",
    "tcp://127.0.0.1:5555",
    "tcp://127.0.0.2:5555",
    "tcp://localhost:1",
    "tcp://[::1]:5",
]
REMOTE = [
    "tcp://0.0.0.0:5555",
    "tcp://10.1.2.3:1",
    "tcp://192.168.0.10:65535",
    "tcp://*:5555",
    "tcp://[::]:5555",
    "tcp://example.com:80",
    "tcp://localhost.example.com:80",
    "tcp://eth0:5555",
]
MALFORMED = [
    "127.0.0.1:5555",  # no scheme
    "localhost",
    "",
    "tcp://127.0.0.1",  # no port
    "tcp://localhost",
    "tcp://127.0.0.1:",
    "tcp://:5555",  # no host
    "tcp://127.0.0.1:99999",  # port out of range
    "tcp://127.0.0.1:port",
    "ipc://",  # no path
    "http://127.0.0.1:80",  # unknown scheme
    "udp://127.0.0.1:5555",
    "pgm://eth0;239.192.1.1:5555",
    None,
    5555,
]


@pytest.mark.parametrize("endpoint", LOCAL)
def test_local_endpoints_are_accepted(endpoint):
    assert is_local_endpoint(endpoint)
    check_endpoint(endpoint)
    check_endpoint(endpoint, allow_remote=True)


@pytest.mark.parametrize("endpoint", REMOTE)
def test_remote_endpoints_need_allow_remote(endpoint):
    assert not is_local_endpoint(endpoint)
    with pytest.raises(EndpointError, match="allow_remote"):
        check_endpoint(endpoint)
    check_endpoint(endpoint, allow_remote=True)


@pytest.mark.parametrize("endpoint", MALFORMED, ids=repr)
def test_malformed_endpoints_are_rejected_even_with_allow_remote(endpoint):
    for allow_remote in (False, True):
        with pytest.raises(EndpointError) as info:
            check_endpoint(endpoint, allow_remote=allow_remote)
        assert isinstance(info.value, ValueError)
        assert repr(endpoint) in str(info.value)


def test_is_local_endpoint_rejects_unknown_schemes():
    with pytest.raises(EndpointError):
        is_local_endpoint("http://127.0.0.1:80")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[zmq.Frame]:
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart(copy=False)


def test_bind_router_refuses_remote_endpoint_before_binding(ctx):
    with pytest.raises(EndpointError):
        bind_router(ctx, "tcp://0.0.0.0:5555")
    with pytest.raises(EndpointError):
        bind_router(ctx, "tcp://127.0.0.1")


def test_sockets_get_safety_options(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/opts.ipc"
    router = bind_router(ctx, endpoint)
    dealer = connect_dealer(ctx, endpoint)
    for sock in (router, dealer):
        assert sock.getsockopt(zmq.LINGER) == 0
        assert sock.getsockopt(zmq.MAXMSGSIZE) == HARD_FRAME_LIMIT
    assert router.type == zmq.ROUTER and dealer.type == zmq.DEALER
    assert router.getsockopt_string(zmq.LAST_ENDPOINT) == endpoint


def test_a_peer_announcing_anothers_routing_id_does_not_take_over_its_pipe(ctx, tmp_path):
    """Replies stay with the peer that owns the pipe: a second connection naming the same routing id is ignored,
    not handed the first one's messages (ROUTER_HANDOVER off)."""
    endpoint = f"ipc://{tmp_path}/h.ipc"
    router = bind_router(ctx, endpoint)
    victim = transport.make_dealer(ctx)
    victim.setsockopt(zmq.ROUTING_ID, b"victim")
    victim.connect(endpoint)
    victim.send_multipart(encode(Error(message="hello", code="x")))
    peer, *_ = _recv(router)
    assert peer.bytes == b"victim"
    thief = transport.make_dealer(ctx)
    thief.setsockopt(zmq.ROUTING_ID, b"victim")
    thief.connect(endpoint)
    thief.send_multipart(encode(Error(message="steal", code="x")))
    assert not router.poll(500)  # the newcomer's messages are dropped with its pipe
    router.send_multipart([b"victim", *encode(Error(message="for the victim", code="x"))])
    assert decode(_recv(victim)).message == "for the victim"
    assert not thief.poll(500)
    for sock in (thief, victim, router):
        sock.close(linger=0)


def test_router_dealer_exchange_over_ipc(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/v.ipc"
    router = bind_router(ctx, endpoint)
    dealer = connect_dealer(ctx, endpoint)
    q = torch.rand(3, 7)
    dealer.send_multipart(encode(Draft(session=1, base_len=4, tokens=[5, 6, 7], tensors={"q": q})))
    peer, *body = _recv(router)
    msg = decode(body)
    assert isinstance(msg, Draft) and (msg.session, msg.tokens) == (1, [5, 6, 7])
    assert torch.equal(msg.tensors["q"], q)

    router.send_multipart([peer, *encode(Commit(session=1, base_len=4, tokens=[5, 9], accepted=1))])
    reply = decode(_recv(dealer))
    assert isinstance(reply, Commit) and (reply.tokens, reply.base_len, reply.accepted) == ([5, 9], 4, 1)

    # a malformed message gets an addressed error reply, and the pair keeps working
    dealer.send_multipart([b"\xc1not msgpack"])
    peer, *body = _recv(router)
    with pytest.raises(ProtocolError) as info:
        decode(body)
    router.send_multipart([peer, *error_frames(str(info.value), info.value.code)])
    err = decode(_recv(dealer))
    assert isinstance(err, Error) and err.code == "bad_message"


def test_frame_over_maxmsgsize_is_dropped(ctx, tmp_path, monkeypatch):
    monkeypatch.setattr(transport, "HARD_FRAME_LIMIT", 4096)  # read by bind_router when it configures the socket
    endpoint = f"ipc://{tmp_path}/cap.ipc"
    router = bind_router(ctx, endpoint)
    assert router.getsockopt(zmq.MAXMSGSIZE) == 4096
    dealer = connect_dealer(ctx, endpoint)
    dealer.send_multipart(encode(State(session=1, base_len=1, end=1,
                                       tensors={"big": torch.zeros(8192, dtype=torch.uint8)})))
    assert not router.poll(300), "a frame over MAXMSGSIZE reached the router"
    # the dealer reconnects by itself; a message under the cap then goes through
    dealer.send_multipart(encode(State(session=1, base_len=1, end=1,
                                       tensors={"small": torch.zeros(16, dtype=torch.uint8)})))
    _, *body = _recv(router)
    assert set(decode(body).tensors) == {"small"}
