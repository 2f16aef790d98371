"""Tenants end to end (docs/security.md): one cluster on tiny models with the ``suffix`` drafter and the HTTP server
in this process, two tenants. Tenant B is not offered tenant A's responses while A's next request is; requests
without a tenant have a scope of their own; an API key names its tenant through HTTP, up to
``verifier.max_sessions_per_tenant`` sessions each. Plus the keys file's rules (unit). The CURVE side (only a gateway
key may name a tenant) is in tests/test_security.py."""

from __future__ import annotations

import asyncio
import os
import time

import openai
import pytest
from conftest import start_cluster, tiny_config

from benchmarks.http_overhead import free_port
from runtime.client import PipespecError
from runtime.config import ConfigError, load_config
from runtime.keys import KeysError, read_api_keys
from runtime.launch import cluster, serve_http
from testkit.tiny_models import reference_greedy

KEY_A, KEY_B, KEY_DEFAULT = "a" * 20, "b" * 20, "d" * 20


def _keys_file(folder, text: str, mode: int = 0o600):
    path = folder / "api-keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.mark.cluster
def test_suffix_cache_and_sessions_are_kept_per_tenant(tiny, tmp_path):
    target = tiny("gpt2")  # the tiny GPT-2 falls into no loop its own history would predict
    prompt = [9, 8, 7]
    expected = reference_greedy(target, prompt, 32)
    config = tiny_config(target, None, type="suffix", suffix_num_draft_tokens=8)
    del config["drafter"]["model"]
    config["verifier"]["max_sessions_per_tenant"] = 1
    config["verifier"]["admission_wait_s"] = 0  # busy at once, not after A's stream ends
    keys = _keys_file(tmp_path, f"# tenant:key\nA:{KEY_A}\nB\t{KEY_B}\n")
    config["http"] = {"host": "127.0.0.1", "port": free_port(), "api_keys_file": str(keys),
                      "api_key": KEY_DEFAULT, "request_metrics": True}
    config = load_config(config)

    async def main():
        out = {}
        async with cluster(config) as client:
            def run(tenant):
                return client.generate(token_ids=prompt, max_new_tokens=32, eos_token_ids=[], tenant=tenant)

            # A, then B and no tenant (both on A's prompt, so A's response would predict theirs), then A again
            out["A1"], out["B"], out["none"], out["A2"] = [await run(t) for t in ("A", "B", None, "A")]
            # one session per tenant: A holds one (a long stream), so an HTTP request with A's key is busy (the
            # server started first, so the stream still runs when the request comes)
            async with serve_http(client, config) as http:
                stream = client.stream(token_ids=prompt, max_new_tokens=400, eos_token_ids=[], tenant="A")
                await asyncio.wait_for(stream.__anext__(), 60)
                for name, key in (("http A", KEY_A), ("http B", KEY_B), ("http default", KEY_DEFAULT)):
                    async with openai.AsyncOpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0) as c:
                        try:
                            out[name] = await c.completions.create(prompt=prompt, max_tokens=4, temperature=0,
                                                                   model=http.model_name)
                        except openai.RateLimitError as exc:
                            out[name] = exc
            await stream.aclose()
        return out

    out = asyncio.run(main())
    assert all(out[k].token_ids == expected for k in ("A1", "B", "none", "A2"))
    accepted = {k: out[k].metrics["accepted_tokens"] for k in ("A1", "B", "none", "A2")}
    print("accepted tokens:", accepted)
    # A's second request drafts from A's first response; B and the tenant-less request do no better than A's first
    assert accepted["A2"] >= 16 and accepted["A2"] > 2 * max(accepted["B"], accepted["none"]), accepted
    assert abs(accepted["B"] - accepted["A1"]) <= 2 and abs(accepted["none"] - accepted["A1"]) <= 2, accepted
    busy = out["http A"]
    assert isinstance(busy, openai.RateLimitError) and "verifier.max_sessions_per_tenant" in busy.message
    for name in ("http B", "http default"):
        assert out[name].usage.completion_tokens >= 1
        assert out[name].model_extra["metrics"]["speculative_decoding"]["num_drafts"] is not None


@pytest.mark.cluster
def test_one_tenant_cannot_take_the_kv_budget_from_another(tiny, tmp_path):
    """Issue 43, measured before over the ZeroMQ wire: with two tenants' keys, A's three long streams held 4,011 of
    verifier.max_kv_tokens = 4096 and B's request was refused. A keys file naming A and B now gives each half the
    budget by default: A's first stream runs, its next two wait (``admission_wait_s``) and get ``busy`` naming
    only A's own numbers, and B is served at once while A's stream still runs."""
    target = tiny("llama")
    prompt = [(3 * i) % 200 + 5 for i in range(100)]
    config = tiny_config(target, None)
    config["launch"]["start_drafter"] = False
    config["verifier"].update(max_kv_tokens=1200, admission_wait_s=1.0)  # 400 tokens a stream of A's: 3 fill it
    config["http"] = {"api_keys_file": str(_keys_file(tmp_path, f"A:{KEY_A}\nB:{KEY_B}\n"))}
    config = load_config(config)
    assert config["verifier"]["tenants"] == 2  # from the keys file: fair shares (600 tokens each)

    async def main():
        async with start_cluster(config, hooks={"verifier": "forward_delay=0.02"}) as client:
            first = client.stream(token_ids=prompt, max_new_tokens=300, eos_token_ids=[], tenant="A")
            await asyncio.wait_for(first.__anext__(), 60)
            more = [asyncio.create_task(client.generate(token_ids=prompt, max_new_tokens=300, eos_token_ids=[],
                                                        tenant="A")) for _ in range(2)]
            t0 = time.monotonic()
            b = await client.generate(token_ids=prompt, max_new_tokens=8, eos_token_ids=[], tenant="B")
            b_s = time.monotonic() - t0
            refused = await asyncio.gather(*more, return_exceptions=True)
            sessions = (await client.ping())["sessions"]  # A's first stream still runs
            await first.aclose()
            return b, b_s, refused, sessions

    b, b_s, refused, sessions = asyncio.run(main())
    print(f"\nB served in {b_s:.2f} s while A held its share (busy machine)")
    assert b.token_ids == reference_greedy(target, prompt, 8)
    assert b_s < 5.0 and sessions == 1
    for exc in refused:
        assert isinstance(exc, PipespecError) and exc.code == "busy", exc
        assert str(exc).startswith("your requests hold 400 of your 600 tokens (verifier.max_kv_tokens_per_tenant); "
                                   "this request needs 400: retry later (after waiting 1 s for room"), str(exc)
        assert "1200" not in str(exc) and "108" not in str(exc)  # not the budget's total, nor what B holds


@pytest.mark.unit
def test_the_api_keys_file_names_tenants_and_must_be_private(tmp_path):
    path = _keys_file(tmp_path, f"A:{KEY_A}\n\n# a comment\nB\t{KEY_B}\nA:{KEY_DEFAULT}\n")
    assert read_api_keys(path) == {KEY_A: "A", KEY_B: "B", KEY_DEFAULT: "A"}  # a tenant may have two keys
    for text, words in ((f"A:{KEY_A}\nB:{KEY_A}\n", "also tenant 'A'"), ("A:short\n", "at least 16"),
                        (f"{KEY_A}\n", "TENANT:KEY"), (f"a b:{KEY_A}\n", "tenant key name"), ("# none\n", "no key")):
        with pytest.raises(KeysError, match=words):
            read_api_keys(_keys_file(tmp_path, text))
    with pytest.raises(KeysError, match="readable by other users"):
        read_api_keys(_keys_file(tmp_path, f"A:{KEY_A}\n", 0o640))
    # the config check reads it at load time: a bad file stops the start with its line
    with pytest.raises(ConfigError, match=r"http\.api_keys_file: .*line 1"):
        load_config("cpu.yaml", {"http.api_keys_file": str(_keys_file(tmp_path, "A:short\n"))})
    # a keys file is enough to serve off loopback (with allow_remote)
    good = str(_keys_file(tmp_path, f"A:{KEY_A}\n"))
    config = load_config("cpu.yaml", {"http.api_keys_file": good, "http.host": "0.0.0.0", "http.allow_remote": True})
    assert config["http"]["api_keys_file"] == good
