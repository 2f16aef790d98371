"""Issue 44, part C: ``n`` answers per request and per-request speculation (``speculative`` / ``num_draft_tokens``).

Pure logic (the seed rule, the request checks, the verifier's and the drafter's draft caps) in unit tests; the rest
end to end on one launcher subprocess serving HTTP (the ``openai`` package and the standard library talking to it),
with transformers' own greedy ``generate`` on the target alone as the ground truth and an :class:`AsyncClient` on the
same cluster for the seeded samples; and one distribution check that seeded choices are independent lossless draws
(with its negative control)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import types

import openai
import pytest
import torch
from conftest import http_launcher, http_refusal, start_cluster, tiny_config, wait_for_drafter
from sampling_check import PROMPT, TV_BOUND, N, exact_joint, tv
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter_node.node_handlers import MessageHandler
from runtime.client import AsyncClient, PipespecError
from shared.backend import DynamicBackend
from shared.choices import MAX_N, choice_seed
from shared.sampling import GenerationParams, ParamError
from testkit.tiny_models import reference_greedy
from verifier_node.session import Session

EOS = [0]  # the tiny models' end token (testkit.tiny_models)
MAX_SESSIONS = 4  # the server's: a request of n = 5 cannot fit (test_one_failing_choice_fails_the_request)


# ------------------------------------------------------------------------------------------ unit
@pytest.mark.unit
def test_choice_seed_rule():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7  # choice 0: the request's own seed
    seeds = [choice_seed(7, i) for i in range(MAX_N)]
    assert seeds == [choice_seed(7, i) for i in range(MAX_N)]  # deterministic
    assert len(set(seeds)) == MAX_N and all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(8, 1) != choice_seed(7, 1) and choice_seed(7, 1) != 8  # not seed + i: unrelated streams


def _check(kind: str, **fields) -> str | None:
    """The ``param`` of the 400 a request body gets (None: accepted)."""
    return http_refusal(kind, **fields)


@pytest.mark.unit
def test_request_checks_of_n_best_of_and_speculative():
    assert _check("completions", n=MAX_N, best_of=MAX_N) is None
    assert _check("chat", n=2, speculative={"num_draft_tokens": 0, "draft_type": "lm"}) is None
    for bad in (0, MAX_N + 1, "2", 2.0, True):
        assert _check("completions", n=bad) == "n", bad
    assert _check("completions", n=2, best_of=3) is None  # ranked by log probability per token
    assert _check("completions", n=3, best_of=2) == "best_of"  # fewer candidates than answers
    assert _check("completions", n=2, best_of=3, stream=True) == "best_of"  # ranked once all are done
    assert _check("chat", n=2, best_of=2) == "best_of"  # a completions field
    assert _check("completions", speculative={"num_draft_tokens": -1}) == "speculative.num_draft_tokens"
    assert _check("completions", speculative={"num_draft_tokens": 65}) == "speculative.num_draft_tokens"
    assert _check("completions", speculative={"num_draft_tokens": "3"}) == "speculative.num_draft_tokens"
    assert _check("completions", speculative={"k": 3}) == "speculative.k"
    assert _check("completions", speculative={"draft_type": ""}) == "speculative.draft_type"
    # the verifier checks the same bound on its own (a client other than the HTTP server)
    with pytest.raises(ParamError, match="num_draft_tokens"):
        GenerationParams.from_dict({"num_draft_tokens": 65})
    assert GenerationParams.from_dict({"num_draft_tokens": 0}).num_draft_tokens == 0


@pytest.mark.unit
def test_session_cuts_drafts_to_the_requests_cap(tiny):
    folder = tiny("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def session(cap):
        s = Session(1, DynamicBackend(model), tokenizer, [5, 6, 7, 8],
                    GenerationParams.from_dict({"max_new_tokens": 16, "num_draft_tokens": cap}), b"c", 1)
        s.prefill()
        return s

    q = torch.full((3, model.config.vocab_size), 1.0 / model.config.vocab_size)
    plan = session(1).plan_round([9, 10, 11], q)
    assert plan.draft == [9] and plan.q.shape[0] == 1 and plan.fed == [8, 9]
    assert session(None).plan_round([9, 10, 11], q).draft == [9, 10, 11]  # no cap: the drafter's block
    # a token tree: the nodes of depth at most the cap
    tree = session(2).plan_round([9, 10, 11, 12], None, parents=[-1, 0, 1, -1])
    assert tree.draft == [9, 10, 12]


@pytest.mark.unit
@pytest.mark.parametrize("schedule", ["constant", "heuristic", "cost"])
def test_drafter_plans_within_the_requests_cap(schedule):
    """The drafter's schedule for a session never plans past its request's ``num_draft_tokens``."""
    from drafter_node.cost_model import CostBook

    settings = types.SimpleNamespace(overlap=False, draft_schedule=schedule, num_draft_tokens=4, max_draft_tokens=8)
    handlers = types.SimpleNamespace(settings=settings, drafter=types.SimpleNamespace(block_len=None), max_k=8,
                                     book=CostBook(), _trees_for=lambda draft: False)
    for cap, want in ((None, 8), (2, 2), (1, 1)):
        draft = types.SimpleNamespace(params=GenerationParams(num_draft_tokens=cap), committed=[],
                                      predrafts_rows=True)
        sched = MessageHandler._schedule_for(handlers, draft)
        assert sched.max_k == want and sched.k <= want, (schedule, cap, sched.max_k, sched.k)


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["verifier"].update(max_sessions=MAX_SESSIONS, admission_wait_s=0)
    config["http"] = {"request_metrics": True}  # the tests read per-request speculative metrics
    with http_launcher(config, tmp_path_factory.mktemp("choices"), target=target) as served:
        yield served


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _client_run(server, coro_fn):
    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await coro_fn(c)
    return asyncio.run(main())


def _wait_no_sessions(server, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while (sessions := _client_run(server, lambda c: c.ping())["sessions"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sessions, f"sessions left running: {sessions}"


@pytest.mark.cluster
def test_speculation_off_or_capped_is_greedy_exact(server):
    """K = 0, 1, 3 (and the drafter's own): the text equals transformers' greedy ``generate`` on the target alone;
    K = 0 drafts nothing, K caps every verified block (the drafter's own blocks here are 3 long)."""
    client = _openai(server)
    for ids in ([5, 17, 33, 2, 60], [40, 41, 42]):
        truth = reference_greedy(server.target, ids, 20, eos=EOS)
        for k in (None, 0, 1, 3):
            extra = {} if k is None else {"speculative": {"num_draft_tokens": k}}
            want = _client_run(server, lambda c, k=k, ids=ids: c.generate(token_ids=ids, max_new_tokens=20,
                                                                          num_draft_tokens=k))
            assert want.token_ids == truth, k
            r = client.completions.create(model=server.model, prompt=ids, max_tokens=20, temperature=0,
                                          extra_body=extra)
            assert r.choices[0].text == want.text and r.usage.completion_tokens == len(truth)
            spec = r.model_extra["metrics"]["speculative_decoding"]
            if k == 0:
                assert spec["num_drafts"] == 0 and spec["num_draft_tokens"] == 0 and want.metrics["drafts"] == 0
                assert r.model_extra["metrics"]["drafter_type"] is None  # no drafter was given the request
            else:
                assert spec["num_drafts"] > 0
                assert len(spec["per_position_acceptance"]) == (k or 3)  # k = 1: no round checked 2 draft tokens
                assert spec["num_draft_tokens"] <= (k or 3) * spec["num_drafts"]


@pytest.mark.cluster
def test_n3_greedy_choices_equal_the_single_answer_and_usage_sums(server):
    client = _openai(server)
    one = client.completions.create(model=server.model, prompt="def add(a, b):", max_tokens=12, temperature=0)
    r = client.completions.create(model=server.model, prompt="def add(a, b):", max_tokens=12, temperature=0, n=3,
                                  best_of=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [one.choices[0].text] * 3
    assert [c.finish_reason for c in r.choices] == [one.choices[0].finish_reason] * 3
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(c.model_extra["metrics"]["speculative_decoding"]["num_drafts"] > 0 for c in r.choices)
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0, n=2)
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert [c.index for c in chat.choices] == [0, 1]


@pytest.mark.cluster
def test_the_choices_prompts_share_one_prefill_forward(server):
    """The n prompts leave as one burst; the verifier's prompt gather waits for those still being tokenised, so a
    text prompt's n choices are cached in one batched forward (without waiting for them: two or three here)."""
    client = _openai(server)
    for kind, n in (("completions", 4), ("chat", 3), ("completions", 2)):
        _wait_no_sessions(server)
        before = _client_run(server, lambda c: c.ping())["prefill_forwards"]
        if kind == "chat":
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "sort a list"}],
                                           max_tokens=4, temperature=0, n=n)
        else:
            client.completions.create(model=server.model, prompt="def quicksort(items):", max_tokens=4,
                                      temperature=0, n=n)
        after = _client_run(server, lambda c: c.ping())["prefill_forwards"]
        assert after - before == 1, (kind, n, after - before)


@pytest.mark.cluster
def test_n3_seeded_sampling_is_reproducible_and_follows_the_seed_rule(server):
    client = _openai(server)

    def texts(**kw):
        r = client.completions.create(model=server.model, prompt="import os\n", max_tokens=16, temperature=1.0,
                                      **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first, again = texts(n=3, seed=7), texts(n=3, seed=7)
    assert first == again  # reproducible run to run
    assert len(set(first)) == 3  # and the choices are different samples
    assert texts(seed=7) == first[:1]  # choice 0 is the request's own seed
    # choice i samples with choice_seed(seed, i): the same texts from the Python client, one request per seed, and
    # from its generate_n
    single = _client_run(server, lambda c: asyncio.gather(*(
        c.generate("import os\n", max_new_tokens=16, do_sample=True, temperature=1.0, seed=choice_seed(7, i))
        for i in range(3))))
    assert [r.text for r in single] == first
    several = _client_run(server, lambda c: c.generate_n("import os\n", n=3, seed=7, max_new_tokens=16,
                                                          do_sample=True, temperature=1.0))
    assert [r.text for r in several] == first
    with pytest.raises(PipespecError, match="n must be") as info:
        _client_run(server, lambda c: c.generate_n("import os\n", n=MAX_N + 1, max_new_tokens=4))
    assert info.value.code == "bad_request"
    unseeded = texts(n=3)
    assert len(set(unseeded)) == 3 and unseeded != first  # independent choices


@pytest.mark.cluster
def test_best_of_returns_the_candidates_of_highest_log_probability_per_token(server):
    """best_of = 4, n = 2, seeded: the candidates are the seed rule's four samples; the answer is the two whose mean
    log probability per token (under the target, from the Python client's own logprobs) is highest, best first."""
    client = _openai(server)
    kw = dict(model=server.model, prompt="import os\n", max_tokens=10, temperature=1.0, seed=11)
    r = client.completions.create(n=2, best_of=4, **kw)
    candidates = _client_run(server, lambda c: asyncio.gather(*(
        c.generate("import os\n", max_new_tokens=10, do_sample=True, temperature=1.0, seed=choice_seed(11, i),
                   logprobs=0) for i in range(4))))
    scores = [sum(e.logprob for e in c.logprobs) / len(c.logprobs) for c in candidates]
    best = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert len({c.text for c in candidates}) > 2  # different candidates: the ranking has something to choose
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [candidates[i].text for i in best]
    assert r.choices[0].logprobs is None  # ranked by log probabilities the caller did not ask to see
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)  # every candidate counted


@pytest.mark.cluster
def test_streaming_n2_each_index_matches_the_whole_answer(server):
    client = _openai(server)
    messages = [{"role": "user", "content": "count to five"}]
    kw = dict(model=server.model, messages=messages, max_tokens=14, temperature=1.0, seed=11, n=2)
    whole = client.chat.completions.create(**kw)
    deltas, finishes, roles, usage = {0: "", 1: ""}, {0: [], 1: []}, {0: 0, 1: 0}, []
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            deltas[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert [deltas[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert deltas[0] != deltas[1]
    assert [finishes[i] for i in (0, 1)] == [[c.finish_reason] for c in whole.choices]  # one finish chunk each
    assert roles == {0: 1, 1: 1}
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    # completions stream the same way (greedy: both choices the single answer)
    one = client.completions.create(model=server.model, prompt="class Node:", max_tokens=10, temperature=0)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=server.model, prompt="class Node:", max_tokens=10, temperature=0,
                                           n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: one.choices[0].text, 1: one.choices[0].text}


@pytest.mark.cluster
@pytest.mark.parametrize("fields,param", [
    ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"), ({"n": "2"}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"speculative": {"num_draft_tokens": -1}}, "speculative.num_draft_tokens"),
    ({"speculative": {"num_draft_tokens": 65}}, "speculative.num_draft_tokens"),
    ({"speculative": {"draft": 2}}, "speculative.draft"),
    ({"speculative": 3}, "speculative"),
    ({"n": 2, "speculative": {"draft_type": "no-such-type"}}, "speculative.draft_type"),  # the verifier's check
])
def test_bad_n_and_speculative_fields_are_400s_naming_the_field(server, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        _openai(server).completions.create(model=server.model, prompt="hi", max_tokens=4, extra_body=fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    _wait_no_sessions(server)  # a refused choice leaves no other running


@pytest.mark.cluster
def test_one_failing_choice_fails_the_request_and_cancels_the_others(server):
    """n = 5 on a verifier of 4 sessions (no admission wait): the fifth choice is refused ``busy``, so the request
    is a 429 and the four that started are cancelled on the verifier."""
    _wait_no_sessions(server)
    body = {"model": server.model, "prompt": "for i in range(10):", "max_tokens": 400, "temperature": 0, "n": 5}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = json.loads(r.read())
    conn.close()
    assert r.status == 429 and answer["error"]["code"] == "busy", answer
    _wait_no_sessions(server)
    ok = _openai(server).completions.create(model=server.model, prompt="hi", max_tokens=4, temperature=0, n=4)
    assert len(ok.choices) == 4  # the server serves the next request whole


# ------------------------------------------------------------------------------------------ statistical
@pytest.mark.statistical
def test_seeded_choices_are_independent_lossless_draws(sharp_pair):
    """800 draws of the first two tokens as 50 seeded ``generate_n`` calls of 16 choices, speculation capped at one
    draft token: pooled, their joint is within the sampling check's TV bound of the target's exact one (drafts
    accepted and rejected: lossless under the cap), and two choices of one request agree as often as two independent
    draws do (Σ P(x1, x2)²). Negative control: 16 choices given one seed (a rule that ignores the index) always agree,
    far outside the same bound."""
    target, drafter = sharp_pair
    exact = exact_joint(target)
    collide = float((exact**2).sum())  # P(two independent draws agree on both tokens)
    n, calls = 16, N // 16
    params = {"max_new_tokens": 2, "do_sample": True, "eos_token_ids": [], "num_draft_tokens": 1}

    async def main():
        async with start_cluster(tiny_config(target, drafter, num_draft_tokens=3)) as client:
            await wait_for_drafter(client)
            seeded = []
            for first in range(0, calls, 3):  # 48 sessions in flight (the verifier holds 64)
                seeded += await asyncio.gather(*(client.generate_n(token_ids=PROMPT, n=n, seed=1000 * s, **params)
                                                 for s in range(first, min(calls, first + 3))))
            control = await asyncio.gather(*(
                asyncio.gather(*(client.generate(token_ids=PROMPT, seed=1000 * s, **params) for _ in range(n)))
                for s in range(4)))
            return seeded, control

    seeded, control = asyncio.run(main())

    def agreement(groups) -> float:
        pairs = [(a.token_ids == b.token_ids) for g in groups for i, a in enumerate(g) for b in g[i + 1:]]
        return sum(pairs) / len(pairs)

    counts = torch.zeros_like(exact)
    for r in (r for g in seeded for r in g):
        counts[r.token_ids[0], r.token_ids[1]] += 1
    drafted = sum(r.metrics["draft_tokens"] for g in seeded for r in g)
    accepted = sum(r.metrics["accepted_tokens"] for g in seeded for r in g)
    assert 0 < accepted < drafted, "need drafts accepted and rejected, or the check tests nothing"
    assert max(len(r.metrics["per_position_acceptance"]) for g in seeded for r in g) == 1  # the cap held
    print(f"choices: TV {tv(counts / counts.sum(), exact):.3f} (bound {TV_BOUND}), agreement {agreement(seeded):.3f} "
          f"against {collide:.3f} independent, control {agreement(control):.3f}")
    assert tv(counts / counts.sum(), exact) < TV_BOUND
    assert abs(agreement(seeded) - collide) < TV_BOUND, (agreement(seeded), collide)
    assert abs(agreement(control) - collide) > 2 * TV_BOUND  # the control: every choice the same draw
