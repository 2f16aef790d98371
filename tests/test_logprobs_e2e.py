"""Log probabilities end to end: one launcher subprocess (verifier, a drafter that is the target with noise on its
LM head, so drafts are both accepted and rejected, and the HTTP server) serves the module.

* exactness: the cluster's numbers (``AsyncClient.generate(..., logprobs=N)``) against transformers on the float32
  target alone — greedy against ``generate(output_scores=True)``, sampling (seeded, with a repetition penalty,
  temperature, top-k and top-p) against a teacher-forced forward over prompt + output with transformers' own
  processors — within 1e-5, top-N included; raw (unprocessed) scores must not match (a control that fails);
* HTTP through the ``openai`` package: chat and completions, streamed and not, the streamed entries concatenated
  equal the whole response's; a stop string lists only the tokens whose text is shown; bad values are 400s naming
  the field.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from conftest import http_launcher, tiny_config
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runtime.client import AsyncClient, Chunk
from testkit.tiny_hybrid import perturbed_copy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7, 12]]
TOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    target = tiny("llama")
    root = tmp_path_factory.mktemp("logprobs")
    near = perturbed_copy(target, root / "near", noise=0.6, seed=5)
    config = tiny_config(target, near, num_draft_tokens=3)
    config["http"] = {"request_metrics": True}
    with http_launcher(config, root, target=target) as served:
        yield served


def _generate(server, calls: list[dict], stream: bool = False) -> list:
    """``AsyncClient.generate`` for each call (concurrently); with ``stream``, (chunks, result) per call."""
    async def one(c, call):
        if not stream:
            return await c.generate(**call)
        chunks, result = [], None
        async for item in c.stream(**call, include_result=True):
            if isinstance(item, Chunk):
                chunks.append(item)
            else:
                result = item
        return chunks, result

    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await asyncio.gather(*(one(c, call) for call in calls))
    return asyncio.run(main())


def _model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _same(a: list, b: list) -> None:
    """Two requests' entries: the same tokens, bytes and alternatives, numbers within TOL (two runs may verify in
    different round shapes, whose float sums differ in the last bits)."""
    assert [(e.id, e.piece, [t.id for t in e.top]) for e in a] == [(e.id, e.piece, [t.id for t in e.top]) for e in b]
    assert all(abs(x.logprob - y.logprob) < TOL for x, y in zip(a, b))
    assert all(abs(s.logprob - t.logprob) < TOL for x, y in zip(a, b) for s, t in zip(x.top, y.top))


def _spec_counts(results) -> tuple[int, int]:
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    return accepted, sum(r.metrics["draft_tokens"] for r in results) - accepted


def _compare(entries, tokens: list[int], want: torch.Tensor, top_n: int) -> None:
    """Each entry's logprob and top-N (ids and values) against ``want`` (log-probabilities, a row per token)."""
    assert [e.id for e in entries] == tokens and len(want) == len(tokens)
    for e, row in zip(entries, want):
        assert abs(e.logprob - float(row[e.id])) < TOL
        finite = int(torch.isfinite(row).sum())
        top = row.topk(min(top_n, finite))
        assert [t.id for t in e.top] == top.indices.tolist()
        assert all(abs(t.logprob - v) < TOL for t, v in zip(e.top, top.values.tolist()))


def test_greedy_logprobs_equal_transformers_scores(server):
    n = 24
    results = _generate(server, [{"token_ids": p, "max_new_tokens": n, "eos_token_ids": [], "logprobs": 5}
                                 for p in PROMPTS])
    accepted, rejected = _spec_counts(results)
    assert accepted > 0 and rejected > 0  # drafted tokens accepted, corrections, bonus tokens: all covered
    model = _model(server.target)
    for prompt, r in zip(PROMPTS, results):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=[], pad_token_id=1, output_scores=True, return_dict_in_generate=True)
        assert r.token_ids == out.sequences[0, len(prompt):].tolist()
        _compare(r.logprobs, r.token_ids, torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1), 5)


def test_sampled_logprobs_equal_transformers_processed_scores(server):
    n = 24
    settings = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.3}
    calls = [{"token_ids": p, "max_new_tokens": n, "eos_token_ids": [], "logprobs": 6, "seed": 11 + i, **settings}
             for i, p in enumerate(PROMPTS)]
    results = _generate(server, calls)
    streamed = _generate(server, calls, stream=True)
    accepted, rejected = _spec_counts(results)
    assert accepted > 0 and rejected > 0
    model = _model(server.target)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(40), TopPLogitsWarper(0.9)])  # generate's order
    raw_gap = 0.0
    for prompt, r, (chunks, final) in zip(PROMPTS, results, streamed):
        assert final.token_ids == r.token_ids  # seeded: the same output however rounds ran
        assert [e for c in chunks for e in c.logprobs] == final.logprobs  # the same run's: identical
        _same(final.logprobs, r.logprobs)
        seq = torch.tensor([prompt + r.token_ids])
        with torch.inference_mode():
            logits = model(seq).logits[0, len(prompt) - 1: -1].float()
        rows = torch.stack([processors(seq[:, : len(prompt) + j], logits[j: j + 1])[0] for j in range(n)])
        _compare(r.logprobs, r.token_ids, torch.log_softmax(rows, -1), 6)
        raw = torch.log_softmax(logits, -1)
        raw_gap = max(raw_gap, max(abs(e.logprob - float(raw[j, e.id])) for j, e in enumerate(r.logprobs)))
    assert raw_gap > 1e-2  # the control: the unprocessed distribution is not what is reported


def test_greedy_logprobs_under_a_grammar_equal_transformers_with_the_engines_processor(server):
    """The grammar's mask is part of the distribution: excluded alternatives are left out, forced tokens score 0."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt, n = PROMPTS[0], 40
    (r,) = _generate(server, [{"token_ids": prompt, "max_new_tokens": n, "json_schema": schema, "logprobs": 5}])
    assert r.metrics["grammar_forced_tokens"] > 0
    model, tokenizer = _model(server.target), AutoTokenizer.from_pretrained(server.target)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                             strict_mode=True)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=[0], pad_token_id=1, logits_processor=[LogitsProcessor(compiled)],
                         output_scores=True, return_dict_in_generate=True)
    want = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)
    _compare(r.logprobs, r.token_ids, want, 5)
    assert any(len(e.top) < 5 for e in r.logprobs)  # masked alternatives left out
    assert any(e.logprob == 0.0 and len(e.top) == 1 for e in r.logprobs)  # a token the grammar forced


# ------------------------------------------------------------------------------------------------------ HTTP
def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def _same_chat(got: list, want: list[dict]) -> None:
    """Chat ``logprobs.content`` entries: the same tokens, bytes and alternatives, numbers within TOL."""
    got = [c.model_dump() for c in got]

    def shape(entries):
        return [(c["token"], c["bytes"], [(t["token"], t["bytes"]) for t in c["top_logprobs"]]) for c in entries]

    assert shape(got) == shape(want)
    for x, y in zip(got, want):
        assert abs(x["logprob"] - y["logprob"]) < TOL
        assert all(abs(s["logprob"] - t["logprob"]) < TOL for s, t in zip(x["top_logprobs"], y["top_logprobs"]))


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_chat_logprobs_streamed_equal_whole_and_the_client(server, temperature):
    client = _openai(server)
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=16, temperature=temperature, seed=3, logprobs=True,
              top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    (want,) = _generate(server, [{"messages": MESSAGES, "max_new_tokens": 16, "logprobs": 3, "seed": 3,
                                  "do_sample": temperature > 0, "temperature": temperature or 1.0}])
    _same_chat(content, [{"token": e.token, "logprob": e.logprob, "bytes": list(e.piece),
                          "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.piece)}
                                           for t in e.top]} for e in want.logprobs])
    assert all(len(c.top_logprobs) <= 3 for c in content) and any(len(c.top_logprobs) == 3 for c in content)
    shown = b"".join(bytes(c.bytes) for c, e in zip(content, want.logprobs) if not e.special)
    assert shown.decode("utf-8", "replace") == whole.choices[0].message.content  # the text is the tokens' bytes
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    _same_chat(streamed, [c.model_dump() for c in content])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_streamed_equal_whole(server):
    client = _openai(server)
    kw = dict(model=server.model, prompt="for i in range(10):", max_tokens=16, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(len(top) <= 2 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(**kw, stream=True))
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.choices[0].logprobs is not None:
            for key in merged:
                merged[key] += getattr(ch.choices[0].logprobs, key)
    assert merged["tokens"] == lp.tokens and merged["text_offset"] == lp.text_offset
    assert all(abs(x - y) < TOL for x, y in zip(merged["token_logprobs"], lp.token_logprobs, strict=True))
    assert [sorted(t) for t in merged["top_logprobs"]] == [sorted(t) for t in lp.top_logprobs]
    assert all(abs(x[k] - y[k]) < TOL for x, y in zip(merged["top_logprobs"], lp.top_logprobs) for k in x)
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text


def test_a_stop_string_lists_only_the_tokens_whose_text_is_shown(server):
    client = _openai(server)
    kw = dict(model=server.model, prompt="class Node:", max_tokens=24, temperature=0, logprobs=0)
    full = client.completions.create(**kw).choices[0]
    text, tokens, offsets = full.text, full.logprobs.tokens, full.logprobs.text_offset
    # a stop that starts inside the text (not at its start): cut where it first appears
    stop = next(text[k:k + 2] for k in range(3, len(text) - 2) if text.find(text[k:k + 2]) >= 3)
    cut = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
            shown = "".join(ch.choices[0].text for ch in chunks)
            listed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
        else:
            r = client.completions.create(**kw, stop=[stop]).choices[0]
            shown, listed = r.text, r.logprobs.tokens
        assert shown == cut
        # the tokens that begin inside the shown text, none that the stop string cut off
        assert listed == tokens[: sum(1 for o in offsets if o < len(cut))] and len(listed) < len(tokens)


@pytest.mark.parametrize(("kind", "fields", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_values_are_400s_naming_the_field(server, kind, fields, param):
    client = _openai(server)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3, extra_body=fields)
        else:
            client.completions.create(model=server.model, prompt="hi", max_tokens=3, extra_body=fields)
    assert info.value.body["param"] == param
