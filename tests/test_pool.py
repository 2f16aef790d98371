"""The drafter pool with real node processes and real sockets: several drafters share one verifier's sessions, a
drafter killed under load hands its sessions over with the same greedy output, a second hello joins instead of
replacing, a silent drafter costs no fixed stall per round, a request may name a drafter type, and a drafter rejoins
by itself after a verifier restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import peer_socket, tiny_config
from node_entry import node_command
from test_client import _free_port

from runtime.client import AsyncClient, PipespecError
from runtime.launch import REPO_ROOT, cluster
from shared.models import load_tokenizer, tokenizer_id
from shared.protocol import Capabilities, Heartbeat, Hello, SessionStart, decode, encode
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [9, 9, 9, 8], [150, 3], [77, 78, 79, 80, 81, 82], [40, 41]]


async def until(predicate, what: str, tries: int = 200, every: float = 0.05):
    """Poll an async predicate (bounded: ``tries`` × ``every`` plus the calls themselves)."""
    for _ in range(tries):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def live_drafters(pong: dict) -> list[dict]:
    return [d for d in pong["drafters"] if d["alive"]]


def test_two_drafters_share_sessions_and_a_killed_one_hands_them_over(tiny):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["launch"]["drafters"] = 2
    short = {i: reference_greedy(target, p, 20) for i, p in enumerate(PROMPTS[:4])}
    long = {i: reference_greedy(target, p, 150) for i, p in enumerate(PROMPTS)}

    async def main():
        async with cluster(config) as client:
            pong = await client.ping()
            first = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=20, eos_token_ids=[])
                                           for p in PROMPTS[:4]))
            tasks = [asyncio.create_task(client.generate(token_ids=p, max_new_tokens=150, eos_token_ids=[]))
                     for p in PROMPTS]

            async def both_busy():
                pong = await client.ping()
                return len([d for d in live_drafters(pong) if d["sessions"] > 0]) == 2 and pong

            busy = await until(both_busy, "both drafters to hold sessions")
            client.cluster.processes["drafter2"].kill()
            results = await asyncio.gather(*tasks, return_exceptions=True)

            async def one_dead():
                pong = await client.ping()
                return len(live_drafters(pong)) == 1 and pong

            after = await until(one_dead, "the killed drafter to be reported dead")  # after 3 s of silence
        return pong, first, busy, results, after

    pong, first, busy, results, after = asyncio.run(main())
    assert len(live_drafters(pong)) == 2 and {d["type"] for d in pong["drafters"]} == {"assistant"}
    assert all(d["host"] for d in pong["drafters"])
    assert [r.token_ids for r in first] == list(short.values())
    assert {r.metrics["drafter_ids"][0] for r in first} == {"d1", "d2"}, "both drafters must have served"
    assert all(r.metrics["drafts"] > 0 for r in first)
    completed = [r for r in results if not isinstance(r, BaseException)]
    loads = {d["id"]: d["sessions"] for d in busy["drafters"]}
    (alive,) = [d["id"] for d in live_drafters(after)]
    (killed,) = [d["id"] for d in after["drafters"] if not d["alive"]]
    print(f"\nkilled drafter {killed} (sessions per drafter then: {loads}) under {len(PROMPTS)} concurrent requests: "
          f"{len(completed)}/{len(PROMPTS)} completed; drafters per request "
          f"{[r.metrics['drafter_ids'] for r in completed]}")
    assert len(completed) == len(PROMPTS), results
    assert [r.token_ids for r in completed] == list(long.values())
    moved = [r for r in completed if r.metrics["drafter_ids"][:2] == [killed, alive]]
    assert moved, "the killed drafter's sessions must have moved to the live one"
    assert all(r.metrics["drafts"] > 0 for r in moved)
    assert after["drafter_connected"] and {alive, killed} == {"d1", "d2"}


async def silent_drafter(endpoint: str, tok_id: str, stop: asyncio.Event, seen: dict) -> None:
    """A peer that says hello and heartbeats, reads everything and never drafts; at its first session it says hello
    once more on the same connection (it must stay the same pool member and learn its session again)."""
    hello = encode(Hello(drafter_type="silent", tokenizer_id=tok_id, capabilities=Capabilities(sends_q=False),
                         host="nowhere"))
    async with peer_socket(endpoint) as sock:
        await sock.send_multipart(hello)
        last = time.monotonic()
        while not stop.is_set():
            if await sock.poll(50):
                msg = decode(await sock.recv_multipart())
                seen[msg.TYPE] = seen.get(msg.TYPE, 0) + 1
                if isinstance(msg, SessionStart) and seen[msg.TYPE] == 1:
                    await sock.send_multipart(hello)
            if time.monotonic() - last > 0.1:
                await sock.send_multipart(encode(Heartbeat()))
                last = time.monotonic()


def _start_drafter(config_path: Path, log_path: Path) -> subprocess.Popen:
    """A drafter started on its own (``--role drafter``) against a verifier that is already running."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(node_command("--config", str(config_path), "--role", "drafter"), cwd=REPO_ROOT,
                                stdout=log, stderr=subprocess.STDOUT)


def test_silent_drafter_costs_no_fixed_stall_and_a_second_hello_joins(tiny, tmp_path):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["launch"]["start_drafter"] = False
    cap = config["verifier"]["draft_timeout_ms"] / 1000
    tok_id = tokenizer_id(load_tokenizer(str(target)))
    n = 40
    expected = {i: reference_greedy(target, p, n) for i, p in enumerate(PROMPTS[:3])}

    async def main():
        async with cluster(config) as client:
            stop, seen = asyncio.Event(), {}
            peer = asyncio.create_task(silent_drafter(client.config["verifier"]["endpoint"], tok_id, stop, seen))
            await until(lambda: _connected(client), "the silent drafter to join")
            silent = await client.generate(token_ids=PROMPTS[0], max_new_tokens=n, eos_token_ids=[])
            seen_then = dict(seen)
            extra = _start_drafter(client.cluster.config_path, tmp_path / "extra-drafter.log")
            try:
                pong = await until(lambda: _n_live(client, 2), "the second drafter to join", tries=1200)
                typed = await client.generate(token_ids=PROMPTS[1], max_new_tokens=n, eos_token_ids=[],
                                              drafter_type="assistant")
                # no type asked: the least loaded is the silent one (a tie goes to the earlier); demoted, the
                # session moves to the drafter that drafts
                moved = await client.generate(token_ids=PROMPTS[2], max_new_tokens=n, eos_token_ids=[])
                none_live = await client.generate(token_ids=PROMPTS[0], max_new_tokens=n, eos_token_ids=[],
                                                  drafter_type="prompt_lookup")
                with pytest.raises(PipespecError, match="drafter_type must be one of") as bad:
                    await client.generate(token_ids=PROMPTS[0], max_new_tokens=4, drafter_type="nope")
                still = await client.ping()
            finally:
                extra.terminate()
                code = extra.wait(30)
            stop.set()
            await peer
        return silent, seen_then, pong, typed, moved, none_live, bad.value, still, code

    silent, seen, pong, typed, moved, none_live, bad, still, code = asyncio.run(main())
    m = silent.metrics
    print(f"\nsilent drafter: {m['rounds']} rounds, waited {m['draft_wait_s']:.2f} s in all "
          f"(a fixed {cap:.0f} s per round would be {m['rounds'] * cap:.0f} s), misses {m['draft_misses']}, "
          f"demotions {m['demotions']}, elapsed {m['elapsed_s']:.2f} s")
    assert silent.token_ids == expected[0]
    assert m["drafter_ids"] == ["d1"] and m["drafts"] == 0
    assert seen["welcome"] == 2 and seen["session_start"] == 2, "a hello again re-announces the drafter's session"
    assert m["draft_wait_s"] < 0.2 * m["rounds"] * cap, "the rounds were stalled for the cap"
    assert m["demotions"] >= 1 and m["draft_misses"] >= 3
    # the second hello joined; the first drafter is still there
    assert [(d["id"], d["type"], d["alive"]) for d in pong["drafters"]] == [("d1", "silent", True),
                                                                          ("d2", "assistant", True)]
    assert pong["drafters"][0]["host"] == "nowhere" and pong["drafter_type"] == "silent"
    assert typed.token_ids == expected[1] and typed.metrics["drafter_ids"] == ["d2"]
    assert typed.metrics["drafts"] > 0 and typed.metrics["drafter_type"] == "assistant"
    assert moved.token_ids == expected[2] and moved.metrics["drafter_ids"] == ["d1", "d2"]
    assert moved.metrics["drafts"] > 0 and moved.metrics["demotions"] >= 1
    assert none_live.token_ids == expected[0] and none_live.metrics["drafter_ids"] == []
    assert none_live.metrics["drafts"] == 0
    assert bad.code == "bad_request" and "'nope'" in str(bad)
    assert len(live_drafters(still)) == 2
    assert code == 0, "the extra drafter must exit cleanly on SIGTERM"


async def _connected(client) -> bool:
    return (await client.ping())["drafter_connected"]


async def _n_live(client, n: int):
    pong = await client.ping()
    return len(live_drafters(pong)) >= n and pong


def test_drafter_rejoins_after_the_verifier_restarts(tiny, tmp_path):
    """Roles started separately over tcp; the verifier is killed (SIGKILL, no goodbye) and started again at the same
    address: the drafter notices by itself and speculation resumes."""
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["verifier"]["endpoint"] = f"tcp://127.0.0.1:{_free_port()}"
    config["client"]["endpoint"] = f"tcp://127.0.0.1:{_free_port()}"
    config["drafter"]["verifier_endpoint"] = config["verifier"]["endpoint"]
    cfg = tmp_path / "multi.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def start(role: str) -> subprocess.Popen:
        # interpreters of their own: the killed verifier must be gone, its port free, before the new one binds (a
        # node forked from the zygote dies after its killed proxy, a moment later)
        with open(tmp_path / f"{role}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "runtime.launch", "--config", str(cfg), "--role", role],
                                    cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    procs = {"drafter": start("drafter"), "verifier": start("verifier")}
    expected = reference_greedy(target, PROMPTS[0], 15)

    async def ready(client, need_drafter: bool) -> bool:
        try:
            pong = await client.ping(timeout_s=0.5)
        except TimeoutError:
            return False
        return pong["drafter_connected"] or not need_drafter

    async def main():
        async with AsyncClient(config["client"]["endpoint"], timeout_s=60) as client:
            await until(lambda: ready(client, True), "the first start", tries=1200, every=0.1)
            before = await client.generate(token_ids=PROMPTS[0], max_new_tokens=15, eos_token_ids=[])
            procs["verifier"].send_signal(signal.SIGKILL)
            procs["verifier"].wait(20)
            launched = time.monotonic()
            procs["verifier"] = start("verifier")
            await until(lambda: ready(client, False), "the restarted verifier", tries=1200, every=0.05)
            up = time.monotonic()
            await until(lambda: ready(client, True), "the drafter to rejoin", tries=400, every=0.05)
            rejoined = time.monotonic()
            after = await client.generate(token_ids=PROMPTS[0], max_new_tokens=15, eos_token_ids=[])
            return before, after, (up - launched, rejoined - up)

    try:
        before, after, (start_s, rejoin_s) = asyncio.run(main())
    finally:
        for p in procs.values():
            p.terminate()
        codes = {role: p.wait(20) for role, p in procs.items()}
    print(f"\nrestarted verifier answered {start_s:.2f} s after its launch; the drafter was back {rejoin_s:.2f} s "
          "after that")
    assert before.token_ids == expected == after.token_ids
    assert before.metrics["drafts"] > 0 and after.metrics["drafts"] > 0, "speculation must resume by itself"
    assert codes == {"drafter": 0, "verifier": 0}
    assert "rejoining the verifier" in (tmp_path / "drafter.log").read_text()
