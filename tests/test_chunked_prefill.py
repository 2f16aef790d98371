"""Chunked prefill and the batched forward's rollback on failure.

A prompt longer than ``verifier.max_prefill_tokens`` is cached in chunks of at most that many tokens, and the running
sessions' rounds come between two chunks (counted in the order of a client's messages, not in time). Greedy output
stays equal to transformers' ``generate`` on the target alone, on a plain transformer and on hybrid targets (whose
recurrent state the cache carries from one chunk to the next), and the hidden states and K/V rows a drafter needs are
those of the whole prompt. A batched round whose forward fails after the rows' caches grew is rolled back before the
per-session forwards, so their output is still the reference's."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
import zmq
from conftest import tiny_config
from node_entry import node_entry
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter_node import node_session
from drafter_node.lm_drafter import LMDraftSession
from drafter_node.node_session import NodeSession
from drafter_node.schedule import DraftLengthSchedule
from runtime.launch import cluster
from shared.backend import DynamicBackend
from shared.kv import CachedLM
from shared.protocol import Chunk, Done, Generate, Ping, Pong, decode, encode
from shared.sampling import GenerationParams
from testkit.inproc_verifier import serve_requests, verifier_from_parts
from testkit.tiny_hybrid import HYBRID_FAMILIES, build_hybrid
from testkit.tiny_models import reference_greedy
from verifier_node.session import Session

CHUNK = 16
LONG = torch.randint(2, 150, (150,), generator=torch.Generator().manual_seed(3)).tolist()  # 149 cached: 10 chunks
SHORT = [5, 17, 33, 2, 60, 6, 7, 8]


@pytest.fixture(scope="module")
def targets(tiny, model_dir, tokenizer_dir):
    """A plain transformer and every hybrid family (built once per module)."""
    found = {"llama": tiny("llama")}
    for family in HYBRID_FAMILIES:
        found[family] = build_hybrid(model_dir / f"chunked-{family}", family, tokenizer_dir, seed=4)
    return found


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _session(model, folder, prompt, new_tokens, backend=None) -> Session:
    params = GenerationParams.from_dict({"max_new_tokens": new_tokens, "eos_token_ids": []}, model.config.vocab_size)
    return Session(1, backend or DynamicBackend(model), AutoTokenizer.from_pretrained(folder), prompt, params, b"c", 1)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["llama", *HYBRID_FAMILIES])
def test_a_prompt_cached_in_chunks_gives_the_reference_greedy_output(targets, name):
    """Chunks of 16 over a 150-token prompt: the cache holds the prompt as one forward would, and plain steps after
    it equal ``generate`` (hybrids: the recurrent state carried across chunks)."""
    folder = targets[name]
    model = _load(folder)
    s = _session(model, folder, LONG, 12)
    assert s.prefill_chunk(CHUNK) == LONG[:CHUNK]
    s.prefill(chunk_tokens=CHUNK)
    assert s.prefilled and s.cached_prompt == len(LONG) - 1 and s.lm.length == len(LONG) - 1
    while not s.finished:
        s.verify([], None)
    assert s.generated == reference_greedy(folder, LONG, 12)


@pytest.mark.unit
def test_the_state_a_drafter_needs_is_collected_over_the_chunks(tiny):
    """Hidden states and K/V rows (what MTP and early-exit drafters are announced with) of a chunked prefill are
    those of the one-forward prefill, over every prompt position."""
    folder = tiny("llama")
    model = _load(folder)
    whole = _session(model, folder, LONG, 4).prefill(True, [0, 1])
    chunked = _session(model, folder, LONG, 4).prefill(True, [0, 1], chunk_tokens=CHUNK)
    assert whole[0].shape == chunked[0].shape == (len(LONG) - 1, model.config.hidden_size)
    assert torch.allclose(whole[0], chunked[0], atol=1e-5)
    assert whole[1].keys() == chunked[1].keys() == {"kv.0", "kv.1"}
    for name, rows in whole[1].items():
        assert rows.shape == chunked[1][name].shape and rows.shape[2] == len(LONG) - 1
        assert torch.allclose(rows, chunked[1][name], atol=1e-5)


@pytest.mark.unit
def test_restore_cuts_every_layer_that_grew_whatever_the_length_says(tiny):
    """A batched forward that failed part-way may leave layers grown that ``length`` does not count: ``restore``
    cuts them, and the next forward equals one on a fresh cache."""
    model = _load(tiny("llama"))
    lm, fresh = CachedLM(model), CachedLM(model)
    lm.feed(SHORT)
    fresh.feed(SHORT)
    layer = lm.cache.layers[0]
    lm.cache.update(layer.keys[:, :, :3].clone(), layer.values[:, :, :3].clone(), 0)  # layer 0 grew, length did not
    lm.restore(len(SHORT))
    assert [layer.get_seq_length() for layer in lm.cache.layers] == [len(SHORT)] * len(lm.cache.layers)
    assert torch.equal(lm.feed([9, 10])[0].argmax(-1), fresh.feed([9, 10])[0].argmax(-1))
    lm.restore(2)  # a row that grew in full: cut back like crop
    assert lm.length == 2 and lm.cache.layers[1].get_seq_length() == 2


class FailsAfterGrowing(DynamicBackend):
    """A backend whose batched verification forwards (logits over several rows) raise after every row's cache grew:
    a numerical or KV error raised late in the forward."""

    def __init__(self, model, failures: int):
        super().__init__(model)
        self.failures = failures

    def feed_rows(self, rows, want_hidden=False, logits=True):
        out = super().feed_rows(rows, want_hidden=want_hidden, logits=logits)
        if logits and len(rows) > 1 and self.failures:
            self.failures -= 1
            raise RuntimeError("injected: the batched forward failed after the rows' caches grew")
        return out


@pytest.mark.unit
def test_a_batched_round_that_failed_after_the_caches_grew_is_rolled_back(tiny):
    """Two sessions batched; their first batched forwards fail after growing both caches. The per-session forwards
    that follow start from the committed length again: outputs equal ``generate`` (before the rollback they were
    fed on top of the failed forward's positions and came back wrong, finished)."""
    target = tiny("llama")
    model = _load(target)
    backend = FailsAfterGrowing(model, failures=3)
    assert CachedLM(model).batchable
    server, endpoint = verifier_from_parts(target, model=model, backend=backend)
    prompts = {1: SHORT, 2: [9, 9, 8, 7, 6, 5, 4, 3]}
    got, _ = serve_requests(server, endpoint, prompts, 8)
    assert backend.failures == 0  # the failures were met (the two rounds were batched)
    for rid, prompt in prompts.items():
        assert got[rid].finish_reason == "length"
        assert got[rid].token_ids == reference_greedy(target, prompt, 8), rid


def _interleaved(address: str, new_tokens: tuple[int, int]) -> tuple[list[tuple[int, object]], Pong]:
    """Request 1 (SHORT, plain steps: no drafter of its type) streams; after its first chunk request 2 (LONG) is
    sent. Every message in the order the verifier sent them, then a pong."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send_multipart(encode(Generate(request_id=1, token_ids=SHORT, drafter_type="assistant",
                                            params={"max_new_tokens": new_tokens[0], "eos_token_ids": []})))
        seen: list[tuple[int, object]] = []
        done = 0
        while done < 2:
            if not sock.poll(60_000):
                raise TimeoutError("no answer from the verifier")
            msg = decode(sock.recv_multipart())
            if not isinstance(msg, Chunk | Done):
                raise AssertionError(f"unexpected {msg}")
            seen.append((msg.request_id, msg))
            if isinstance(msg, Done):
                done += 1
            elif len(seen) == 1:  # request 1 runs: the long prompt arrives while it streams
                sock.send_multipart(encode(Generate(request_id=2, token_ids=LONG, params={
                    "max_new_tokens": new_tokens[1], "eos_token_ids": []})))
        sock.send_multipart(encode(Ping()))
        while not isinstance(pong := decode(sock.recv_multipart()), Pong):
            pass
        return seen, pong
    finally:
        sock.close(linger=0)


@pytest.mark.cluster
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_long_prompt_is_prefilled_in_chunks_between_another_sessions_rounds(targets, name):
    """A 150-token prompt with ``max_prefill_tokens`` 16 (a slowed target): ten prefill forwards, and the session
    already running gets a round between every two of them (without chunks: one or two rounds while the long prompt
    is cached). Both outputs equal ``generate``; the long prompt's session is served by a prompt-lookup drafter
    announced after its first round."""
    target = targets[name]
    config = tiny_config(target, None, type="prompt_lookup", num_draft_tokens=3, prompt_lookup_num_tokens=3,
                         max_matching_ngram_size=3)
    config["verifier"]["max_prefill_tokens"] = CHUNK
    new_tokens = (40, 12)

    async def main():
        async with cluster(config, entry={"verifier": node_entry("forward_delay", "0.05")}) as client:
            return await asyncio.to_thread(_interleaved, client.started.client_address, new_tokens)

    seen, pong = asyncio.run(main())
    chunks = math.ceil((len(LONG) - 1) / CHUNK)
    first_long = next(i for i, (rid, msg) in enumerate(seen) if rid == 2)
    between = sum(1 for rid, msg in seen[1:first_long] if rid == 1 and isinstance(msg, Chunk))
    assert between >= chunks - 1, f"{between} rounds of the running session while {chunks} chunks were cached"
    assert pong.prefill_forwards == 1 + chunks  # the short prompt's, and the long one's chunks
    results = {rid: msg for rid, msg in seen if isinstance(msg, Done)}
    assert results[1].token_ids == reference_greedy(target, SHORT, new_tokens[0])
    assert results[2].token_ids == reference_greedy(target, LONG, new_tokens[1])


class CountingLM:
    """Records the token count of each forward of the wrapped model."""

    def __init__(self, model):
        self.model = model
        self.sizes: list[int] = []

    def __call__(self, input_ids=None, **kwargs):
        self.sizes.append(int(input_ids.shape[-1]))
        return self.model(input_ids=input_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.unit
def test_the_drafter_catches_a_long_prompt_up_in_chunks_of_its_own(tiny, monkeypatch):
    """A drafter session opened on a 150-token prompt: each node step feeds at most CATCH_UP_TOKENS of it (one
    forward each, no token drafted), then the chain steps draft exactly what one prefill forward would have."""
    model = _load(tiny("llama", "random"))
    params = GenerationParams.from_dict({"max_new_tokens": 8, "eos_token_ids": []}, model.config.vocab_size)
    whole = LMDraftSession(DynamicBackend(model), LONG, len(LONG), params, 0, model.config.vocab_size)
    whole.propose(4)
    counted = CountingLM(model)
    chunked = LMDraftSession(DynamicBackend(counted), LONG, len(LONG), params, 0, model.config.vocab_size)
    monkeypatch.setattr(node_session, "CATCH_UP_TOKENS", 32)
    node = NodeSession(1, chunked, DraftLengthSchedule(4, "constant", max_k=4, overlap=False))
    for _ in range(4):
        node.step()
        assert chunked.chain == [] and node.last_step is None
    assert counted.sizes == [32, 32, 32, 32] and chunked.lm.length == 128
    while len(chunked.chain) < 4:
        node.step()
    assert counted.sizes == [32, 32, 32, 32, len(LONG) - 128, 1, 1, 1]
    assert chunked.chain_tokens == whole.chain_tokens
    assert chunked.catch_up(32) == 0  # nothing left to catch up: the chain steps go on as before


def _intervals(path, what: str) -> list[dict]:
    import json

    with open(path) as lines:
        return [e for e in map(json.loads, lines) if e["what"] == what]


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["assistant", "gguf"])
def test_the_drafter_prefills_only_after_the_targets_prefill_and_first_token(tiny, tmp_path, kind):
    """A 150-token prompt cached in 16-token chunks by a slowed target, served by an assistant drafter (torch) or a
    gguf one (llama.cpp): no forward of the drafter's model runs while the target prefills or computes the first
    token (the drafter is announced after the first round, so the first token comes at the target's own speed);
    the drafter then catches the prompt up in chunks of its own (32 here), drafts, and the output equals
    ``generate`` on the target alone. Before, the drafter was announced at the first chunk and prefilled its copy
    during the target's prefill."""
    target, drafter = tiny("qwen2"), tiny("qwen2", "random")
    config = tiny_config(target, drafter, type=kind, num_draft_tokens=3)
    if kind == "gguf":
        from testkit.tiny_gguf import write_qwen2_gguf

        config["drafter"]["model"] = str(write_qwen2_gguf(drafter, tmp_path / "drafter.gguf"))
    config["verifier"]["max_prefill_tokens"] = CHUNK
    trace_v, trace_d = tmp_path / "verifier.jsonl", tmp_path / "drafter.jsonl"
    new_tokens = 24

    async def main():
        async with cluster(config, entry={"verifier": node_entry("trace_verifier", str(trace_v)),
                                          "drafter": node_entry("trace_drafter", f"{trace_d},32")}) as client:
            started = len(_intervals(trace_d, "forward")) if trace_d.exists() else 0  # load-time forwards, if any
            done = await client.generate(token_ids=LONG, max_new_tokens=new_tokens, eos_token_ids=[])
            return started, done

    started, done = asyncio.run(main())
    assert done.token_ids == reference_greedy(target, LONG, new_tokens)
    assert done.metrics["drafts"] > 0, "the drafter never drafted: nothing was checked"
    prefills = _intervals(trace_v, "prefill")
    assert len(prefills) == math.ceil((len(LONG) - 1) / CHUNK)
    first_round = _intervals(trace_v, "round")[0]
    assert first_round["start"] >= prefills[-1]["end"]
    forwards = _intervals(trace_d, "forward")[started:]
    busy = [*prefills, first_round]
    overlapping = [(f, b) for f in forwards for b in busy if f["start"] < b["end"] and b["start"] < f["end"]]
    assert not overlapping, f"drafter forwards ran during the target's prefill or first round: {overlapping[:3]}"
    assert min(f["start"] for f in forwards) >= first_round["end"]
    catch_up = [f["tokens"] for f in forwards if f["tokens"] > 1]
    assert max(catch_up) <= 32 and catch_up.count(32) >= (len(LONG) + 1) // 32 - 1, catch_up
