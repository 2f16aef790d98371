"""Liveness both ways, with real node processes: a killed verifier fails the requests in flight with
``verifier_gone`` within seconds and the same client works again once a verifier is back at the address; the
verifier cancels the sessions of clients that vanished; ``close()`` fails its waiters and frees their sessions; a
request over the verifier's message cap raises ``too_large`` at once, and every error reaches its request."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import peer_socket, tiny_config
from node_entry import node_command, node_entry

from runtime.client import AsyncClient, Chunk, PipespecError
from runtime.launch import REPO_ROOT, cluster
from shared.protocol import MAX_HEADER_BYTES, Error, Generate, Ping, decode, encode
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPT = [5, 17, 33, 2, 60]
LONG = 480  # new tokens: far more than any test lets a request run (the tiny models hold 512 positions)


def _start_verifier(cfg: Path, fresh: bool = False) -> subprocess.Popen:
    """A verifier process forked from the session's zygote (tests/node_entry.py), or ``fresh``: an interpreter of its
    own, where the test signals the node itself (SIGSTOP stops the zygote's proxy, not the node it forked)."""
    command = ["-m", "runtime.launch", "--config", str(cfg), "--role", "verifier"]
    return subprocess.Popen([sys.executable, *command] if fresh else node_command(*command[2:]), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _until_answers(client: AsyncClient, limit_s: float = 90.0) -> float:
    """Seconds until the verifier answers a ping (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            await client.ping(timeout_s=0.5)
            return time.monotonic() - t0
        except TimeoutError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"no verifier answered within {limit_s} s")


async def _until_sessions(client: AsyncClient, n: int, limit_s: float) -> float:
    """Seconds until the verifier reports ``n`` sessions (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if (await client.ping())["sessions"] == n:
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"the verifier did not reach {n} sessions within {limit_s} s")


def test_killed_verifier_fails_in_flight_requests_then_the_client_reconnects(tiny, tmp_path):
    target = tiny("llama")
    config = tiny_config(target, None)
    config["verifier"]["endpoint"] = f"ipc://{tmp_path}/v.ipc"
    config["client"]["endpoint"] = f"ipc://{tmp_path}/c.ipc"
    config["client"]["timeout_s"] = 60  # the old failure: the request waited for this, not for the verifier
    cfg = tmp_path / "verifier.yaml"
    cfg.write_text(yaml.safe_dump(config))
    procs = [_start_verifier(cfg)]

    async def main():
        async with AsyncClient(config["client"]["endpoint"], timeout_s=60) as client:
            await _until_answers(client)
            got_chunk = asyncio.Event()

            async def in_flight():
                async for item in client.stream(token_ids=PROMPT, max_new_tokens=LONG, eos_token_ids=[]):
                    if isinstance(item, Chunk):
                        got_chunk.set()

            tasks = [asyncio.create_task(in_flight()) for _ in range(3)]
            await asyncio.wait_for(got_chunk.wait(), 30)
            procs[0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            learned_s = time.monotonic() - killed
            procs[0].wait(10)

            procs.append(_start_verifier(cfg))  # the same address
            restarted = time.monotonic()
            for _ in range(600):  # bounded: until the new verifier has loaded and answers
                try:
                    result = await client.generate(token_ids=PROMPT, max_new_tokens=12, eos_token_ids=[])
                    break
                except PipespecError as exc:
                    assert exc.code == "verifier_gone"
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("no request succeeded after the restart")
            return results, learned_s, time.monotonic() - restarted, result

    try:
        results, learned_s, back_s, result = asyncio.run(main())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    print(f"\nclient learned of the dead verifier in {learned_s:.2f} s; a request succeeded {back_s:.2f} s after "
          "the restart (model load included)")
    assert all(isinstance(r, PipespecError) and r.code == "verifier_gone" for r in results), results
    assert learned_s < 3.0
    assert result.token_ids == reference_greedy(target, PROMPT, 12)


def test_sessions_of_vanished_clients_are_cancelled(tiny):
    """``max_sessions`` clients send a long generate and vanish; a later client is served once they time out."""
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"))
    config["verifier"]["max_sessions"] = 8
    config["verifier"]["admission_wait_s"] = 0  # refused at once while they hold every slot (no wait for room)
    config["client"]["heartbeat_timeout_s"] = 1.0

    async def vanish(endpoint: str, rid: int) -> None:
        async with peer_socket(endpoint) as sock:
            await sock.send_multipart(encode(Generate(request_id=rid, params={"max_new_tokens": LONG,
                                                                                "eos_token_ids": []},
                                                      token_ids=PROMPT)))
            await sock.send_multipart(encode(Ping()))  # its pong says the generate arrived (linger is 0)
            assert await sock.poll(10_000)

    async def main():
        async with cluster(config) as client:
            endpoint = client.config["client"]["endpoint"]
            await asyncio.gather(*(vanish(endpoint, i + 1) for i in range(8)))
            await _until_sessions(client, 8, 10)
            with pytest.raises(PipespecError) as locked:  # they hold every slot
                await client.generate(token_ids=PROMPT, max_new_tokens=4, eos_token_ids=[])
            t0 = time.monotonic()
            while True:
                assert time.monotonic() - t0 < 20, "the vanished clients still hold the verifier"
                try:
                    result = await client.generate(token_ids=PROMPT, max_new_tokens=10, eos_token_ids=[])
                    break
                except PipespecError as exc:
                    assert "limit of 8 sessions" in str(exc)  # (its code is the crash-proofing part's business)
                    await asyncio.sleep(0.2)
            return locked.value, result, time.monotonic() - t0

    locked, result, waited = asyncio.run(main())
    print(f"\nserved {waited:.2f} s after the vanished clients' sessions filled the verifier")
    assert "limit of 8 sessions" in str(locked)
    assert result.token_ids == reference_greedy(target, PROMPT, 10)


def test_heartbeating_client_keeps_its_session_past_the_timeout(tiny):
    """A live client's long request outlasts ``client.heartbeat_timeout_s``: its pings keep it alive. The verifier
    is slowed (10 ms a forward) so the session itself, not only the reading of its output, lasts past the timeout
    (a reader that sleeps proves nothing: the client's inbox merges unread chunks, and the session ends early)."""
    target = tiny("llama")
    config = tiny_config(target, None)
    config["launch"]["start_drafter"] = False
    config["client"]["heartbeat_timeout_s"] = 1.0
    new_tokens = 250

    async def main():
        async with cluster(config, entry={"verifier": node_entry("forward_delay", "0.01")}) as client:
            t0 = time.monotonic()
            result = await client.generate(token_ids=PROMPT, max_new_tokens=new_tokens, eos_token_ids=[])
            return result, time.monotonic() - t0

    result, took = asyncio.run(main())
    assert result.finish_reason == "length" and len(result.token_ids) == new_tokens
    assert took > 2.0, "the request must outlast the verifier's heartbeat timeout for this test to mean anything"


def test_close_fails_waiters_and_frees_their_sessions(tiny):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"))

    async def main():
        async with cluster(config) as client:
            other = AsyncClient(client.config["client"]["endpoint"], timeout_s=60)
            await other.__aenter__()
            tasks = [asyncio.create_task(other.generate(token_ids=PROMPT, max_new_tokens=LONG, eos_token_ids=[]))
                     for _ in range(2)]
            await _until_sessions(client, 2, 10)
            t0 = time.monotonic()
            await other.close()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2)
            failed_s = time.monotonic() - t0
            # within 2 s: well before the verifier's heartbeat timeout (5 s) would free them
            freed_s = await _until_sessions(client, 0, 2)
            return results, failed_s, freed_s

    results, failed_s, freed_s = asyncio.run(main())
    print(f"\nclose(): waiters failed after {failed_s:.3f} s, sessions freed {freed_s:.2f} s later")
    assert all(isinstance(r, PipespecError) and r.code == "closed" for r in results), results


def test_oversize_request_raises_too_large_and_others_are_unaffected(tiny):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"))
    config["verifier"]["max_message_bytes"] = 4096

    async def main():
        async with cluster(config) as client:
            ok = asyncio.create_task(client.generate(token_ids=PROMPT, max_new_tokens=20, eos_token_ids=[]))
            t0 = time.monotonic()
            with pytest.raises(PipespecError) as big:
                await client.generate(token_ids=[300] * 3000, max_new_tokens=4)
            with pytest.raises(PipespecError) as huge_header:
                await client.generate(prompt="x" * (MAX_HEADER_BYTES + 10), max_new_tokens=4)
            refused_s = time.monotonic() - t0
            result = await asyncio.wait_for(ok, 30)
            limit = (await client.ping())["max_message_bytes"]
            # A peer that sends one anyway gets an error naming its request (it would have hung a client before).
            async with peer_socket(client.config["client"]["endpoint"]) as sock:
                await sock.send_multipart(encode(Generate(request_id=77, params={}, token_ids=[300] * 3000)))
                assert await sock.poll(10_000), "no reply to an over-size message"
                reply = decode(await sock.recv_multipart())
            return big.value, huge_header.value, refused_s, result, limit, reply

    big, huge_header, refused_s, result, limit, reply = asyncio.run(main())
    assert big.code == huge_header.code == "too_large" and "4096" in str(big)
    assert refused_s < 1.0  # refused locally, nothing sent
    assert result.token_ids == reference_greedy(target, PROMPT, 20)
    assert limit == 4096
    assert isinstance(reply, Error) and reply.code == "too_large" and reply.request_id == 77


def test_a_verifier_busy_longer_than_gone_after_s_is_waited_for(tmp_path):
    """A verifier whose Python thread is busy (a long prefill) still holds its connection: ZeroMQ's I/O thread
    answers the heartbeats, so the client waits for the reply instead of calling the verifier gone."""
    import zmq
    import zmq.asyncio

    from shared.protocol import Done, Pong

    endpoint = f"ipc://{tmp_path}/busy.ipc"

    async def fake_verifier(sock) -> None:
        await asyncio.sleep(3.0)  # busy: reads nothing for 2 × gone_after_s
        for _ in range(50):  # bounded: the ping, the heartbeat pings, the generate
            peer, *body = await asyncio.wait_for(sock.recv_multipart(), 10)
            msg = decode(body)
            if isinstance(msg, Ping):
                await sock.send_multipart([peer, *encode(Pong(drafter_connected=False))])
            elif isinstance(msg, Generate):
                await sock.send_multipart([peer, *encode(Done(request_id=msg.request_id, token_ids=[7], text="x",
                                                              metrics={}, finish_reason="length"))])
                return

    async def main():
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.bind(endpoint)
        try:
            serving = asyncio.create_task(fake_verifier(server))
            async with AsyncClient(endpoint, timeout_s=20, gone_after_s=1.5) as client:
                t0 = time.monotonic()
                result = await client.generate(token_ids=PROMPT, max_new_tokens=1)
                waited = time.monotonic() - t0
            await serving
        finally:
            server.close(linger=0)
            ctx.term()
        return result, waited

    result, waited = asyncio.run(main())
    assert result.token_ids == [7]
    assert waited >= 2.9  # the reply came after the busy spell, and the request was not failed meanwhile


def test_a_verifier_gone_silent_fails_requests_within_gone_after_s(tiny, tmp_path):
    """SIGSTOP stands in for a host that went silent (no reset, no reply: its I/O thread stops too): the ZMTP
    heartbeats go unanswered and the requests in flight fail with ``verifier_gone``."""
    config = tiny_config(tiny("llama"), None)
    config["verifier"]["endpoint"] = f"ipc://{tmp_path}/v.ipc"
    config["client"]["endpoint"] = f"ipc://{tmp_path}/c.ipc"
    cfg = tmp_path / "verifier.yaml"
    cfg.write_text(yaml.safe_dump(config))
    proc = _start_verifier(cfg, fresh=True)

    async def main():
        async with AsyncClient(config["client"]["endpoint"], timeout_s=60, gone_after_s=1.5) as client:
            await _until_answers(client)
            got_chunk = asyncio.Event()

            async def in_flight():
                async for item in client.stream(token_ids=PROMPT, max_new_tokens=LONG, eos_token_ids=[]):
                    if isinstance(item, Chunk):
                        got_chunk.set()

            task = asyncio.create_task(in_flight())
            await asyncio.wait_for(got_chunk.wait(), 30)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(PipespecError) as gone:
                await asyncio.wait_for(task, 10)
            return gone.value.code, time.monotonic() - stopped

    try:
        code, learned_s = asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    print(f"\nclient learned of the silent verifier in {learned_s:.2f} s")
    assert code == "verifier_gone"
    assert learned_s < 4.0
