"""Faults cost speed, never correctness: stale and duplicated drafts, a drafter killed mid-request, malformed and
oversized messages, a drafter with the wrong tokenizer. Real node processes and real sockets throughout."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio
from conftest import hand_played, peer_socket, tiny_config, wait_for_drafter

from runtime.client import AsyncClient, Chunk, PipespecError
from runtime.launch import LaunchError, cluster
from shared.protocol import (
    SCHEMA_VERSION,
    Capabilities,
    Commit,
    Draft,
    Generate,
    Heartbeat,
    Hello,
    SessionStart,
    decode,
    encode,
)
from testkit.tiny_models import build_model, build_small_vocab_tokenizer, reference_greedy

pytestmark = pytest.mark.cluster

PROMPT = [5, 17, 33, 2, 60]


async def hostile_drafter(endpoint: str, tok_id: str, vocab: int, stop: asyncio.Event) -> dict:
    """A drafter that answers every state with a stale draft, then the same random draft twice."""
    rng = random.Random(0)
    sent = {"stale": 0, "dup": 0}
    async with peer_socket(endpoint) as sock:
        await sock.send_multipart(encode(Hello(drafter_type="hostile", tokenizer_id=tok_id,
                                               capabilities=Capabilities(sends_q=False))))
        while not stop.is_set():
            if not await sock.poll(50):
                await sock.send_multipart(encode(Heartbeat()))
                continue
            msg = decode(await sock.recv_multipart())
            if isinstance(msg, SessionStart):
                sid, base = msg.session, len(msg.token_ids)
            elif isinstance(msg, Commit):
                sid, base = msg.session, msg.new_len
            else:
                continue
            await sock.send_multipart(encode(Draft(session=sid, base_len=base - 1, epoch=0, tokens=[3, 4])))
            sent["stale"] += 1
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
            for _ in range(2):
                await sock.send_multipart(encode(Draft(session=sid, base_len=base, epoch=0, tokens=tokens)))
            sent["dup"] += 1
    return sent


def test_stale_and_duplicate_drafts_do_not_change_output(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 30)
    config, tok_id = hand_played(target)

    async def main():
        async with cluster(config) as client:
            stop = asyncio.Event()
            drafter = asyncio.create_task(
                hostile_drafter(client.config["verifier"]["endpoint"], tok_id, 160, stop))
            await wait_for_drafter(client)
            result = await client.generate(token_ids=PROMPT, max_new_tokens=30, eos_token_ids=[])
            stop.set()
            sent = await drafter
        return result, sent

    result, sent = asyncio.run(main())
    assert result.token_ids == expected
    assert sent["stale"] > 0 and result.metrics["stale_drafts"] > 0
    assert result.metrics["drafts"] > 0


def test_drafter_killed_mid_request_still_completes(tiny):
    target = tiny("qwen2")
    expected = reference_greedy(target, PROMPT, 150)
    config = tiny_config(target, tiny("qwen2", "random"), num_draft_tokens=2)
    config["verifier"]["draft_timeout_ms"] = 300

    async def main():
        async with cluster(config) as client:
            got = []
            result = None
            async for item in client.stream(token_ids=PROMPT, max_new_tokens=150, eos_token_ids=[],
                                            include_result=True):
                if isinstance(item, Chunk):
                    if not got:
                        client.cluster.processes["drafter"].kill()
                    got += item.token_ids
                else:
                    result = item
            for _ in range(100):  # the request no longer waits out the drafter: it may end before 3 s of silence
                pong = await client.ping()
                if not pong["drafter_connected"]:
                    break
                await asyncio.sleep(0.1)
        return got, result, pong

    got, result, pong = asyncio.run(main())
    assert result.token_ids == expected == got
    assert result.metrics["fallback_rounds"] > 0
    assert not pong["drafter_connected"]


async def raw_exchange(endpoint: str, frames: list) -> dict:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(frames)
        assert await sock.poll(10_000), "no reply to a malformed message"
        reply = decode(await sock.recv_multipart())
        return {"type": reply.TYPE, **reply.to_dict()}
    finally:
        sock.close()
        ctx.term()


BAD_MESSAGES = {
    "garbage": ([b"\xff\x00garbage"], "bad_message"),
    "unknown type": (None, "unknown_type"),
    "old version": (None, "bad_version"),
    "oversized": ([b"x" * 20_000], "too_large"),
    "missing field": (None, "bad_message"),
}


def _bad_frames(name: str) -> list:
    import msgpack

    if name == "unknown type":
        return [msgpack.packb({"v": SCHEMA_VERSION, "type": "explode"})]
    if name == "old version":
        return [msgpack.packb({"v": 0, "type": "ping"})]
    if name == "missing field":
        return [msgpack.packb({"v": SCHEMA_VERSION, "type": "generate", "request_id": 9})]
    return BAD_MESSAGES[name][0]


def test_malformed_messages_get_error_replies_and_nodes_keep_serving(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 12)
    config = tiny_config(target, tiny("llama", "random"))
    config["verifier"]["max_message_bytes"] = 16_384

    async def main():
        async with cluster(config) as client:
            replies = {}
            for endpoint in (client.config["client"]["endpoint"], client.config["verifier"]["endpoint"]):
                for name in BAD_MESSAGES:
                    replies[(endpoint, name)] = await raw_exchange(endpoint, _bad_frames(name))
            # a drafter-only message on the client socket, and a draft from a drafter that never said hello
            replies["draft from client"] = await raw_exchange(
                client.config["client"]["endpoint"],
                encode(Draft(session=1, base_len=1, epoch=0, tokens=[1])))
            replies["draft before hello"] = await raw_exchange(
                client.config["verifier"]["endpoint"],
                encode(Draft(session=1, base_len=1, epoch=0, tokens=[1])))
            bad_request = await raw_exchange(client.config["client"]["endpoint"],
                                             encode(Generate(request_id=3, params={"temperature": -1},
                                                             token_ids=[1, 2])))
            result = await client.generate(token_ids=PROMPT, max_new_tokens=12, eos_token_ids=[])
            pong = await client.ping()
        return replies, bad_request, result, pong

    replies, bad_request, result, pong = asyncio.run(main())
    for (endpoint, name), reply in ((k, v) for k, v in replies.items() if isinstance(k, tuple)):
        assert reply["type"] == "error", (endpoint, name)
        assert reply["code"] == BAD_MESSAGES[name][1], (endpoint, name, reply)
    assert replies["draft from client"]["code"] == "unexpected"
    assert replies["draft before hello"]["code"] == "not_connected"
    assert bad_request["type"] == "error" and bad_request["request_id"] == 3
    assert "temperature" in bad_request["message"]
    assert result.token_ids == expected
    assert pong["drafter_connected"], "the real drafter must have survived the noise"


def test_drafter_with_another_tokenizer_is_refused(tiny, tmp_path):
    build_small_vocab_tokenizer(tmp_path / "tok")
    other = build_model(tmp_path / "other", "llama", tmp_path / "tok", seed=3)
    config = tiny_config(tiny("llama"), other)

    async def main():
        async with cluster(config):
            pass

    with pytest.raises(LaunchError, match="tokenizer mismatch"):
        asyncio.run(main())


def test_client_times_out_instead_of_hanging(tmp_path):
    async def main():
        async with AsyncClient(f"ipc://{tmp_path}/nobody.ipc", timeout_s=0.5) as client:
            with pytest.raises(PipespecError) as gone:  # no verifier answers the client's first ping
                await client.generate(token_ids=[1, 2], max_new_tokens=2)
            assert gone.value.code == "verifier_gone"
            with pytest.raises(TimeoutError):
                await client.ping(timeout_s=0.3)

    asyncio.run(main())


def test_drafter_file_errors_become_one_clear_message(monkeypatch):
    """A drafter whose files cannot be read or fetched (hub id without hub access) fails with one line naming them."""
    import drafter_node.node as node
    from drafter_node.settings import DrafterConfig
    from shared.models import ModelLoadError

    def broken(settings, own, profile):  # a drafter type is built as cls(settings, own, profile)
        raise OSError("couldn't connect to the hub, and the files are not cached")

    monkeypatch.setattr(node, "drafter_class", lambda name: broken)
    with pytest.raises(ModelLoadError, match=r"drafter type 'mtp_drafter' cannot load its files \(model='org/x', "
                                             r"target_model='org/t'\): couldn't connect"):
        node.load_drafter(DrafterConfig(type="mtp_drafter", model="org/x", target_model="org/t"))
