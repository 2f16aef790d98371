"""A verifier no message can crash (issue 8, item 4): each measured failure reproduced against real node processes.

Parameters that would make the scores non-finite get ``bad_request``; what validation cannot foresee (a model whose
scores turn NaN) ends that session with ``numerical_error``; a chat template that raises, a draft whose ``stats`` hold
the wrong types, and a full verifier (``busy``) each reach the one client or peer concerned, with the right code, and
the node goes on serving: a normal greedy request afterwards equals transformers' ``generate``. The drafter node, fed
schema-valid but unusable messages by a hand-played verifier, drops the session concerned and goes on drafting.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from conftest import peer_socket, tiny_config, wait_for_drafter
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from runtime.client import PipespecError
from runtime.config import load_config
from runtime.launch import Cluster, cluster
from shared.models import load_tokenizer, tokenizer_id
from shared.protocol import (
    Capabilities,
    Commit,
    Draft,
    Error,
    Heartbeat,
    Hello,
    SessionEnd,
    SessionStart,
    State,
    Welcome,
    decode,
    encode,
)
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPT = [5, 17, 33, 2, 60]
POISON = 150  # the token whose embedding is NaN in the poisoned model


def alive(client) -> bool:
    return all(p.poll() is None for p in client.cluster.processes.values())


async def expect_error(coro, code: str) -> PipespecError:
    with pytest.raises(PipespecError) as info:
        await asyncio.wait_for(coro, 60)
    assert info.value.code == code, (info.value.code, str(info.value))
    return info.value


# Sampled requests whose parameters would overflow the scores, and extremes that are refused outright.
REFUSED = [
    {"temperature": 1e-30}, {"temperature": 1e-8}, {"temperature": 1e-40}, {"temperature": 1e30},
    {"temperature": math.inf}, {"temperature": math.nan},
    {"repetition_penalty": 1e-30}, {"repetition_penalty": 1e-8}, {"repetition_penalty": 1e30},
    {"repetition_penalty": math.nan}, {"top_p": 0.0}, {"top_p": 1.0000001}, {"top_p": math.nan},
    {"top_k": 2**40}, {"top_k": -1}, {"min_new_tokens": 2**40}, {"max_new_tokens": 2**62}, {"seed": 2**64 - 1},
    {"eos_token_ids": [2**40]}, {"eos_token_ids": list(range(2000))},
]
# Edge values inside the documented bounds: they must run (and give finite scores).
ACCEPTED = [
    {"temperature": 0.01}, {"temperature": 100.0}, {"repetition_penalty": 0.01, "temperature": 0.01},
    {"repetition_penalty": 100.0}, {"top_p": 1e-300}, {"top_p": 1.0}, {"top_k": 1}, {"top_k": 2**31 - 1},
]


def test_extreme_sampling_params_are_refused_and_the_node_keeps_serving(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 12)
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)

    async def main():
        async with cluster(config) as client:
            for extra in REFUSED:
                params = {"max_new_tokens": 4, "do_sample": True, "seed": 1, **extra}
                err = await expect_error(client.generate(token_ids=PROMPT, **params), "bad_request")
                assert next(iter(extra)) in str(err), (extra, str(err))
                assert alive(client), f"a node died on {extra}"
            for extra in ACCEPTED:
                r = await asyncio.wait_for(client.generate(token_ids=PROMPT, max_new_tokens=6, do_sample=True,
                                                           seed=2, eos_token_ids=[], **extra), 60)
                assert len(r.token_ids) == 6, extra
            # greedy ignores temperature: a tiny one stays valid there, as before
            r = await client.generate(token_ids=PROMPT, max_new_tokens=12, eos_token_ids=[], temperature=1e-30)
            assert r.token_ids == expected
            after = await client.generate(token_ids=PROMPT, max_new_tokens=12, eos_token_ids=[])
            assert alive(client)
        return after

    assert asyncio.run(main()).token_ids == expected


@pytest.fixture(scope="module")
def poisoned(tiny, tmp_path_factory):
    """The tiny Llama target with token POISON's input embedding set to NaN: any prompt holding it makes the scores
    NaN, a case no parameter check can foresee; every other prompt runs exactly as on the clean model."""
    folder = tmp_path_factory.mktemp("poisoned")
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[POISON] = math.nan
    model.save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(tiny("llama")).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("do_sample", [False, True])
def test_non_finite_scores_end_the_session_with_numerical_error(tiny, poisoned, do_sample):
    expected = reference_greedy(tiny("llama"), PROMPT, 10)
    config = tiny_config(poisoned, poisoned, num_draft_tokens=2)  # the drafter meets the NaN scores too

    async def main():
        async with cluster(config) as client:
            bad = [client.generate(token_ids=[5, POISON, 7], max_new_tokens=5, do_sample=do_sample, seed=i,
                                   eos_token_ids=[]) for i in range(3)]
            good = client.generate(token_ids=PROMPT, max_new_tokens=10, eos_token_ids=[])
            results = await asyncio.wait_for(asyncio.gather(*bad, good, return_exceptions=True), 90)
            after = await client.generate(token_ids=PROMPT, max_new_tokens=10, eos_token_ids=[])
            await wait_for_drafter(client)
            pong = await client.ping()
            assert alive(client)
        return results, after, pong

    results, after, pong = asyncio.run(main())
    for r in results[:3]:
        assert isinstance(r, PipespecError) and r.code == "numerical_error", r
    assert results[3].token_ids == expected, "a session beside the failing ones was disturbed"
    assert after.token_ids == expected
    assert pong["drafter_connected"] and pong["sessions"] == 0


def test_a_chat_template_that_raises_fails_that_request_only(tiny, tmp_path):
    folder = tmp_path / "raising-template"
    shutil.copytree(tiny("llama"), folder)
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    tok.save_pretrained(folder)
    expected = reference_greedy(folder, PROMPT, 8)

    async def main():
        async with cluster(tiny_config(folder, tiny("llama", "random"))) as client:
            err = await expect_error(client.generate(messages=[{"role": "user", "content": "hi"}],
                                                     max_new_tokens=4), "bad_request")
            assert "chat template" in str(err) and "roles must alternate" in str(err)
            assert alive(client)
            return await client.generate(token_ids=PROMPT, max_new_tokens=8, eos_token_ids=[])

    assert asyncio.run(main()).token_ids == expected


def test_a_draft_with_bad_stats_gets_an_error_and_the_request_completes(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 40)
    config = tiny_config(target, None)
    config["launch"]["start_drafter"] = False
    config["verifier"]["draft_timeout_ms"] = 500  # each refused draft costs one wait
    tok_id = tokenizer_id(load_tokenizer(str(target)))
    bad_stats = ["a string", {"busy_s": "x"}, {"plans": ["sync"]}, {"blocks": math.nan}, {"dtype": 3}]

    async def fake_drafter(endpoint: str, stop: asyncio.Event) -> list[Error]:
        """On every session_start / commit: the next bad-stats draft not yet refused, then a good draft (so the
        verifier keeps waiting for this drafter's blocks); a bad one that came too late is sent again."""
        errors: list[Error] = []
        async with peer_socket(endpoint) as sock:
            await sock.send_multipart(encode(Hello(drafter_type="fake", tokenizer_id=tok_id,
                                                   capabilities=Capabilities())))
            while not stop.is_set():
                if not await sock.poll(50):
                    await sock.send_multipart(encode(Heartbeat()))  # stay live, so the verifier waits for drafts
                    continue
                msg = decode(await sock.recv_multipart())
                if isinstance(msg, Error):
                    errors.append(msg)
                elif isinstance(msg, (SessionStart, Commit)):
                    base = len(msg.token_ids) if isinstance(msg, SessionStart) else msg.base_len + len(msg.tokens)
                    good = encode(Draft(session=msg.session, base_len=base, tokens=[3]))
                    if len(errors) < len(bad_stats):
                        header = msgpack.unpackb(good[0])
                        header["stats"] = bad_stats[len(errors)]
                        await sock.send_multipart([msgpack.packb(header)])
                    await sock.send_multipart(good)
        return errors

    async def main():
        async with cluster(config) as client:
            stop = asyncio.Event()
            task = asyncio.create_task(fake_drafter(client.config["verifier"]["endpoint"], stop))
            await wait_for_drafter(client)
            result = await asyncio.wait_for(client.generate(token_ids=PROMPT, max_new_tokens=40,
                                                            eos_token_ids=[]), 60)
            stop.set()
            errors = await task
            assert alive(client)
        return result, errors

    result, errors = asyncio.run(main())
    assert result.token_ids == expected
    assert len(errors) == len(bad_stats), [e.message for e in errors]
    assert all(e.code == "bad_message" and "stats" in e.message for e in errors), errors


def test_busy_reaches_the_client_as_busy(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 8)
    config = tiny_config(target, tiny("llama", "random"))
    config["verifier"]["max_sessions"] = 1
    config["verifier"]["admission_wait_s"] = 0  # busy at once (the wait for room: tests/test_intake.py)

    async def main():
        async with cluster(config) as client:
            stream = client.stream(token_ids=PROMPT, max_new_tokens=400, eos_token_ids=[])
            await asyncio.wait_for(stream.__anext__(), 60)  # the one session is running
            err = await expect_error(client.generate(token_ids=PROMPT, max_new_tokens=4), "busy")
            assert "limit of 1 sessions" in str(err)
            await stream.aclose()  # cancels the running session
            for _ in range(100):  # bounded: the cancel frees the slot
                if (await client.ping())["sessions"] == 0:
                    break
                await asyncio.sleep(0.05)
            return await client.generate(token_ids=PROMPT, max_new_tokens=8, eos_token_ids=[])

    assert asyncio.run(main()).token_ids == expected


# ------------------------------------------------------------------------------------------- the drafter node
def test_drafter_drops_sessions_it_cannot_use_and_keeps_drafting(tiny):
    """A hand-played verifier sends the drafter schema-valid messages it cannot use; it must stay up, drop the
    session concerned and still draft for a good one."""
    target = tiny("llama")
    raw = tiny_config(target, tiny("llama", "random"), num_draft_tokens=2)
    nodes = Cluster(load_config(raw))
    endpoint = nodes.config["verifier"]["endpoint"]
    vocab = 160

    async def main():
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        proc = nodes.start_node("drafter")
        try:
            peer = None
            deadline = time.monotonic() + 90
            while peer is None:
                assert time.monotonic() < deadline and proc.poll() is None, nodes.log_tail("drafter")
                if await sock.poll(200):
                    frames = await sock.recv_multipart()
                    if isinstance(decode(frames[1:]), Hello):
                        peer = frames[0]

            async def send(msg) -> None:
                await sock.send_multipart([peer, *encode(msg)])

            await send(Welcome(target="fake", vocab_size=vocab, want_q=False))
            bad = [
                SessionStart(session=1, token_ids=PROMPT, params={"temperature": "hot"}),
                SessionStart(session=2, token_ids=PROMPT, params={"nonsense": 1}),
                SessionStart(session=3, token_ids=PROMPT, params={"do_sample": True, "temperature": 1e-30}),
                Commit(session=99, base_len=5, tokens=[1]),
                SessionStart(session=4, token_ids=[10**9, 3], params={}),
                SessionStart(session=5, token_ids=PROMPT, params={}),
                State(session=5, base_len=5, end=4, tensors={"hidden": torch.zeros(3, 7)}),
                Commit(session=5, base_len=5, tokens=[vocab + 50],
                       tensors={"kv.0": torch.zeros(2, 1, 1, 1)}),
                SessionEnd(session=12345),
            ]
            for msg in bad:
                await send(msg)
            await send(SessionStart(session=7, token_ids=PROMPT, params={"max_new_tokens": 8}))
            got = None
            deadline = time.monotonic() + 60
            while got is None and time.monotonic() < deadline:
                if await sock.poll(200):
                    msg = decode((await sock.recv_multipart())[1:])
                    if isinstance(msg, Draft) and msg.session == 7:
                        got = msg
            assert got is not None, "no draft for the good session: " + nodes.log_tail("drafter")
            assert got.base_len == len(PROMPT) and got.tokens and all(0 <= t < vocab for t in got.tokens)
            assert proc.poll() is None
        finally:
            sock.close()
            ctx.term()

    try:
        asyncio.run(main())
        log = nodes.log_tail("drafter", 400)
    finally:
        nodes.stop()
    assert "Traceback" in log  # the failures were logged, not silent
