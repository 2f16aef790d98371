"""Fuzz both verifier sockets with more than 10,000 mutated messages (seeded, tests/fuzz_messages.py) against one real
cluster of tiny models, then check that the nodes are alive, that every reply had the right code, that no reply
was lost, and that a normal greedy request still equals transformers' ``generate``.

Four raw DEALER peers play at once:

- a *stranger* on the drafter socket (its hellos lack the run secret): every message gets exactly the reply the
  local ``decode`` predicts (its error code; ``unauthorized`` for a valid hello, ``not_connected`` for any other
  schema-valid message), in order;
- a *fake drafter* on the drafter socket that says hello (it joins the pool beside the real drafter, and may be
  given sessions) and sends mutated drafts built on the live sessions it is told of: codes from a known set, and
  every message ``decode`` refuses answered with its code;
- a *misc client* on the client socket (every type but generate): the exact predicted replies, in order (``pong`` for
  a valid ping, nothing for a valid cancel, ``unexpected`` for a valid message of another direction);
- a *generate client*: mutated generate requests (every field, every ``params`` key, chat turns); each gets exactly
  one final reply (``done`` or ``error``), bounded waits, valid long ones cancelled.

A batch ends with a barrier (a message of an unknown type with a numbered name), so replies are matched batch by
batch without a wait per message.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass, field

import msgpack
import pytest
from conftest import peer_socket, tiny_config, wait_for_drafter
from fuzz_messages import Mutator, samples

from runtime.launch import cluster
from shared.models import load_tokenizer, tokenizer_id
from shared.protocol import (
    SCHEMA_VERSION,
    Cancel,
    Capabilities,
    Commit,
    Done,
    Error,
    Generate,
    Hello,
    Ping,
    ProtocolError,
    SessionStart,
    decode,
    encode,
)
from shared.sampling import GenerationParams, ParamError
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

SEED = 20261201
MAX_BYTES = 1 << 20
PROMPT = [5, 17, 33, 2, 60]
COUNTS = {"stranger": 3600, "drafter": 1600, "misc": 3400, "generate": 1600}  # 10,200 messages
BATCH = 200
GEN_BATCH = 40  # generate requests run rounds: smaller batches, so that max_sessions (64) is rarely hit
WAIT_S = 60.0  # the longest wait for one batch's replies
DECODE_CODES = {"bad_message", "bad_version", "unknown_type", "too_large", "bad_request"}


def expect(frames: list[bytes]) -> tuple[str, object]:
    """What the local codec says of these frames: ("error", code) or ("valid", message)."""
    try:
        return "valid", decode(frames, MAX_BYTES)
    except ProtocolError as exc:
        return "error", exc.code


def barrier(n: int, peer: str) -> list[bytes]:
    return [msgpack.packb({"v": SCHEMA_VERSION, "type": f"barrier-{peer}-{n}"})]


def is_barrier(msg, n: int, peer: str) -> bool:
    return isinstance(msg, Error) and f"barrier-{peer}-{n}" in msg.message


@dataclass
class Tally:
    sent: collections.Counter = field(default_factory=collections.Counter)
    replies: collections.Counter = field(default_factory=collections.Counter)

    def reply(self, peer: str, msg) -> None:
        self.replies[f"{msg.TYPE}:{msg.code}" if isinstance(msg, Error) else msg.TYPE] += 1


async def until_barrier(sock, n: int, peer: str, keep=lambda m: True) -> list:
    """Replies up to this batch's barrier (bounded)."""
    got = []
    deadline = time.monotonic() + WAIT_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and await sock.poll(int(1000 * left)), f"{peer}: lost replies (batch {n}, {len(got)} seen)"
        msg = decode(await sock.recv_multipart())
        if is_barrier(msg, n, peer):
            return got
        if keep(msg):
            got.append(msg)


def code_of(msg) -> str:
    return msg.code if isinstance(msg, Error) else msg.TYPE


async def strict_peer(endpoint: str, peer: str, make, predict, tally: Tally) -> None:
    """Send ``COUNTS[peer]`` mutated messages in batches; the replies must be exactly the predicted ones, in order."""
    async with peer_socket(endpoint) as sock:
        for n in range(COUNTS[peer] // BATCH):
            batch = [make() for _ in range(BATCH)]
            predicted = [p for p in (predict(frames) for frames, _ in batch) if p is not None]
            for frames, _ in batch:
                await sock.send_multipart(frames)
            tally.sent[peer] += len(batch)
            await sock.send_multipart(barrier(n, peer))
            got = await until_barrier(sock, n, peer)
            for msg in got:
                tally.reply(peer, msg)
            seen = [code_of(m) for m in got]
            if seen != predicted:
                for (_frames, what), p in zip(batch, (predict(f) for f, _ in batch)):
                    print(peer, what, "->", p)
            assert seen == predicted, f"{peer} batch {n}: replies differ from the prediction"


async def fake_drafter(endpoint: str, mutator: Mutator, tok_id: str, secret: str | None, tally: Tally,
                       vocab: int) -> None:
    """Say hello, then send mutated drafter-side messages built on the sessions the verifier announces."""
    peer = "drafter"
    live: dict[int, int] = {}  # session -> committed length, as the verifier told us
    hello = encode(Hello(drafter_type="fuzz", tokenizer_id=tok_id, capabilities=Capabilities(sends_q=True),
                         run_secret=secret))
    allowed = DECODE_CODES | {"not_connected", "unexpected", "welcome", "tokenizer_mismatch", "unsupported",
                              "unauthorized", "tree_refused"}

    def keep(msg) -> bool:
        if isinstance(msg, SessionStart):
            live[msg.session] = len(msg.token_ids)
        elif isinstance(msg, Commit):
            live[msg.session] = msg.new_len
        elif isinstance(msg, Error) or msg.TYPE == "welcome":
            return True
        return False  # verifier traffic to a connected drafter, not a reply

    async with peer_socket(endpoint) as sock:
        rng = random.Random(SEED + 1)
        for n in range(COUNTS[peer] // BATCH):
            await sock.send_multipart(hello)
            batch = []
            for _ in range(BATCH - 1):
                sid, base = rng.choice(list(live.items())) if live else (1, 5)
                base_msgs = [m for m in samples(vocab, sid, base, run_secret=secret or "")
                             if m.TYPE in ("draft", "hello", "heartbeat")]
                frames, _ = mutator.mutate(rng.choice(base_msgs))
                batch.append(frames)
            for frames in batch:
                await sock.send_multipart(frames)
            tally.sent[peer] += len(batch) + 1
            await sock.send_multipart(barrier(n, peer))
            got = await until_barrier(sock, n, peer, keep)
            codes = collections.Counter(code_of(m) for m in got)
            for msg in got:
                tally.reply(peer, msg)
            assert set(codes) <= allowed, codes
            refused = collections.Counter(p[1] for p in map(expect, batch) if p[0] == "error")
            assert not refused - codes, f"{peer} batch {n}: refused messages without their error reply"
            await asyncio.sleep(0.05)  # let the verifier run rounds on the drafts


async def generate_client(endpoint: str, mutator: Mutator, tally: Tally) -> None:
    """Mutated generate requests: one final reply each (done or error), chunks in between."""
    peer = "generate"
    rng = random.Random(SEED + 2)
    finals = 0
    codes = collections.Counter()
    allowed = DECODE_CODES | {"busy"}
    async with peer_socket(endpoint) as sock:

        async def read(until: int, n: int | None) -> None:
            nonlocal finals
            deadline = time.monotonic() + WAIT_S
            while finals < until or n is not None:
                left = deadline - time.monotonic()
                assert left > 0 and await sock.poll(int(1000 * left)), \
                    f"{peer}: {tally.sent[peer] - finals} requests got no final reply"
                msg = decode(await sock.recv_multipart())
                if n is not None and is_barrier(msg, n, peer):
                    n = None
                    continue
                tally.reply(peer, msg)
                if isinstance(msg, (Done, Error)):
                    finals += 1
                    codes[code_of(msg)] += 1

        rid = 0
        for n in range(COUNTS[peer] // GEN_BATCH):
            for _ in range(GEN_BATCH):
                rid += 1
                base = rng.choice([m for m in samples(request_id=rid) if isinstance(m, Generate)])
                frames, _ = mutator.mutate(base)
                await sock.send_multipart(frames)
                kind, msg = expect(frames)
                if kind == "valid" and isinstance(msg, Generate) and _long(msg):
                    await sock.send_multipart(encode(Cancel(request_id=msg.request_id)))
            tally.sent[peer] += GEN_BATCH
            await sock.send_multipart(barrier(n, peer))
            await read(tally.sent[peer] - 8, n)  # a few requests in flight: most valid ones run rather than get busy
        await read(tally.sent[peer], None)
    assert set(codes) <= allowed | {"done"}, codes
    assert finals == tally.sent[peer]


def _long(msg: Generate) -> bool:
    """A request that stays valid with a budget larger than the fuzz wants to run (cancelled at once)."""
    try:
        return GenerationParams.from_dict(msg.params).max_new_tokens > 8
    except (ParamError, TypeError):
        return False


def test_fuzz_both_sockets(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 16)
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["verifier"]["max_message_bytes"] = MAX_BYTES
    config["verifier"]["draft_timeout_ms"] = 100
    tok_id = tokenizer_id(load_tokenizer(str(target)))
    tally = Tally()
    rng = random.Random(SEED)
    all_types = samples()

    def stranger_make():
        return stranger_mutator.mutate(rng.choice(all_types))

    def stranger_predict(frames):
        kind, got = expect(frames)
        if kind == "error":
            return got
        # without this run's secret a hello is refused (checked first), so the stranger never connects
        return "unauthorized" if isinstance(got, Hello) else "not_connected"

    others = [m for m in all_types if not isinstance(m, Generate)]

    def misc_make():
        return misc_mutator.mutate(rng.choice(others))

    def misc_predict(frames):
        kind, got = expect(frames)
        if kind == "error":
            return got
        if isinstance(got, Ping):
            return "pong"
        if isinstance(got, Cancel):
            return None  # nothing of this client's is running: no reply
        return "unexpected"

    stranger_mutator = Mutator(SEED + 10, MAX_BYTES)
    misc_mutator = Mutator(SEED + 11, MAX_BYTES)

    async def main():
        async with cluster(config) as client:
            drafter_ep, client_ep = client.config["verifier"]["endpoint"], client.config["client"]["endpoint"]
            t0 = time.monotonic()
            await asyncio.gather(
                strict_peer(drafter_ep, "stranger", stranger_make, stranger_predict, tally),
                fake_drafter(drafter_ep, Mutator(SEED + 12, MAX_BYTES), tok_id, client.cluster.run_secret, tally,
                             160),
                strict_peer(client_ep, "misc", misc_make, misc_predict, tally),
                generate_client(client_ep, Mutator(SEED + 13, MAX_BYTES), tally),
            )
            elapsed = time.monotonic() - t0
            alive = {role: p.poll() is None for role, p in client.cluster.processes.items()}
            await wait_for_drafter(client)  # a live drafter (the real one) after the fake one fell silent
            pong = await client.ping()
            after = await asyncio.wait_for(client.generate(token_ids=PROMPT, max_new_tokens=16, eos_token_ids=[]),
                                           60)
            log = client.cluster.log_tail("verifier", 100_000)
        return elapsed, alive, pong, after, log

    elapsed, alive, pong, after, log = asyncio.run(main())
    total = sum(tally.sent.values())
    print(f"\nfuzz: {total} messages in {elapsed:.1f} s, sent per peer {dict(tally.sent)}")
    print("fuzz: replies by type:code", dict(sorted(tally.replies.items())))
    crashes = log.count("Traceback")
    print(f"fuzz: internal errors (tracebacks in the verifier log): {crashes}")
    assert total >= 10_000
    assert alive == {"verifier": True, "drafter": True}
    assert pong["drafter_connected"] and pong["sessions"] == 0
    assert after.token_ids == expected
    assert not any(k.endswith(("internal_error", "numerical_error")) for k in tally.replies), tally.replies
    assert crashes == 0, "the verifier logged an internal error (see its log)"


if __name__ == "__main__":  # python tests/test_fuzz.py: the same run, outside pytest
    pytest.main([__file__, "-s", "-q"])
