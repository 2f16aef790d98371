"""The async client and the launcher from a user's side: concurrency from one and several clients, streaming,
cancellation, text and chat prompts, the one-shot CLI, and nodes started one by one with --role over tcp."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config
from node_entry import node_command

from runtime.client import AsyncClient, Chunk, PipespecError
from runtime.launch import REPO_ROOT, cluster
from shared.models import load_tokenizer
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [9, 9, 9, 8], [150, 3], [77, 78, 79, 80, 81, 82]]


def test_many_concurrent_requests_from_several_clients(tiny):
    target = tiny("llama")
    expected = [reference_greedy(target, p, 20 + i) for i, p in enumerate(PROMPTS)]
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)

    async def one_client(address: str):
        async with AsyncClient(address) as c:
            return await asyncio.gather(*(
                c.generate(token_ids=p, max_new_tokens=20 + i, eos_token_ids=[]) for i, p in enumerate(PROMPTS)
            ))

    async def main():
        async with cluster(config) as client:
            address = client.config["client"]["endpoint"]
            bad = client.generate(token_ids=PROMPTS[0], max_new_tokens=5, top_p=7.0, do_sample=True)
            return await asyncio.gather(one_client(address), one_client(address), one_client(address), bad,
                                        return_exceptions=True)

    *per_client, bad = asyncio.run(main())
    for results in per_client:
        assert [r.token_ids for r in results] == expected
    assert isinstance(bad, PipespecError) and bad.code == "bad_request" and "top_p" in str(bad)


def test_stream_text_prompt_chat_and_cancel(tiny):
    target = tiny("gpt2")
    tokenizer = load_tokenizer(str(target))
    prompt = "def add(a, b):"
    prompt_ids = tokenizer(prompt)["input_ids"]
    messages = [{"role": "user", "content": "print hello"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    config = tiny_config(target, tiny("gpt2", "random"))

    async def main():
        async with cluster(config) as client:
            chunks, final = [], None
            async for item in client.stream(prompt, max_new_tokens=25, eos_token_ids=[], include_result=True):
                if isinstance(item, Chunk):
                    chunks.append(item)
                else:
                    final = item
            chat = await client.generate(messages=messages, max_new_tokens=10, eos_token_ids=[])
            async for _ in client.stream(prompt, max_new_tokens=400, eos_token_ids=[]):
                break  # leaving early cancels the request on the verifier
            for _ in range(50):
                if (await client.ping())["sessions"] == 0:
                    break
                await asyncio.sleep(0.05)
            pong = await client.ping()
            with pytest.raises(PipespecError, match="exactly one"):
                await client.generate(prompt, token_ids=[1, 2])
        return chunks, final, chat, pong

    chunks, final, chat, pong = asyncio.run(main())
    assert final.token_ids == reference_greedy(target, prompt_ids, 25)
    assert [t for c in chunks for t in c.token_ids] == final.token_ids
    assert "".join(c.text for c in chunks) == final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert len(chunks) == final.metrics["rounds"]
    assert chat.token_ids == reference_greedy(target, chat_ids, 10)
    assert pong["sessions"] == 0
    for key in ("draft_tokens", "accepted_tokens", "rounds", "acceptance_rate", "mean_accepted_length",
                "tokens_per_second"):
        assert key in final.metrics


def _write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_one_shot_json(tiny, tmp_path):
    target = tiny("qwen2")
    cfg = _write_config(tmp_path / "tiny.yaml", tiny_config(target, tiny("qwen2", "random")))
    out = subprocess.run(
        node_command("--config", str(cfg), "--prompt", "for i in", "--json", "--max-new-tokens", "9", "--set",
                     "drafter.num_draft_tokens=2"),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    ids = load_tokenizer(str(target))("for i in")["input_ids"]
    assert result["token_ids"] == reference_greedy(target, ids, 9, eos=[0])
    assert set(result) == {"text", "token_ids", "metrics"}
    assert result["metrics"]["new_tokens"] == len(result["token_ids"])

    messages = [{"role": "user", "content": "print hello"}]
    (tmp_path / "chat.json").write_text(json.dumps(messages))
    out = subprocess.run(
        node_command("--config", str(cfg), "--messages", str(tmp_path / "chat.json"), "--max-new-tokens", "6"),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    tokenizer = load_tokenizer(str(target))
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    expected = tokenizer.decode(reference_greedy(target, chat_ids, 6, eos=[0]), skip_special_tokens=True)
    assert out.stdout == expected + "\n"  # streamed text, then a newline; metrics go to stderr
    assert "acceptance" in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_roles_started_separately_over_tcp(tiny, tmp_path):
    """What multi_node.yaml does across hosts, on loopback: each role is its own launcher invocation."""
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"))
    config["verifier"]["endpoint"] = f"tcp://127.0.0.1:{_free_port()}"
    config["client"]["endpoint"] = f"tcp://127.0.0.1:{_free_port()}"
    config["drafter"]["verifier_endpoint"] = config["verifier"]["endpoint"]
    cfg = _write_config(tmp_path / "multi.yaml", config)
    procs = [
        subprocess.Popen(node_command("--config", str(cfg), "--role", role), cwd=REPO_ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for role in ("drafter", "verifier")  # the drafter first: it must wait for the verifier by itself
    ]

    async def main():
        async with AsyncClient(config["client"]["endpoint"], timeout_s=60) as client:
            for _ in range(600):
                try:
                    if (await client.ping(timeout_s=0.5))["drafter_connected"]:
                        break
                except TimeoutError:
                    pass
                await asyncio.sleep(0.1)
            return await client.generate(token_ids=PROMPTS[0], max_new_tokens=15, eos_token_ids=[])

    try:
        result = asyncio.run(main())
    finally:
        for p in procs:
            p.terminate()
        codes = [p.wait(20) for p in procs]
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 15)
    assert result.metrics["drafts"] > 0
    assert codes == [0, 0], "both roles must exit cleanly on SIGTERM"


def test_serve_mode_prints_the_address_serves_and_stops_cleanly(tiny, tmp_path):
    """``python -m runtime.launch --config X`` without --prompt: ready line, client address, Ctrl-C shuts down."""
    import signal

    target = tiny("llama")
    cfg = _write_config(tmp_path / "serve.yaml", tiny_config(target, tiny("llama", "random")))
    proc = subprocess.Popen(node_command("--config", str(cfg)), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for _ in range(20):  # the launcher prints three lines once both nodes are ready
            line = proc.stdout.readline()
            if line.startswith("client address:"):
                address = line.split(":", 1)[1].strip()
                break
        assert address, "no client address printed"

        async def main():
            async with AsyncClient(address, timeout_s=60) as client:
                return await client.generate(token_ids=PROMPTS[1], max_new_tokens=9, eos_token_ids=[])

        result = asyncio.run(main())
        assert result.token_ids == reference_greedy(target, PROMPTS[1], 9)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "pipespec stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
