"""Static ensemble verification (``verification.ensemble_weight`` w): the verifier verifies against
v = w·p + (1 − w)·q. Lossy by design, so the checks are: w → 1 gives exactly the lossless outcomes; the output
distribution is measured to be v (its distance from the target's matches (1 − w)·TV(p, q)), and clearly not p; the
greedy path runs end to end with q sent under greedy; refusals at config, connect and request time.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest
import torch
import zmq
import zmq.asyncio
from conftest import start_cluster, tiny_config
from sampling_check import PROMPT, VOCAB, exact_joint, tv

from drafter_node.lm_drafter import choose
from runtime.client import PipespecError
from runtime.config import ConfigError, load_config, typed
from runtime.launch import cluster
from runtime.security import drafter_links
from shared.protocol import Capabilities, Error, Hello, Welcome, decode, encode
from shared.sampling import GenerationParams, make_generator
from testkit.tiny_models import reference_greedy
from verifier_node.acceptance import accept_greedy, accept_sampling, ensemble_targets

pytestmark = pytest.mark.cluster

W_TO_1 = 1 - 1e-9
V = 6  # vocabulary of the in-process Markov "models"


def ensemble_config(target, drafter, w, **drafter_keys) -> dict:
    config = tiny_config(target, drafter, **drafter_keys)
    config["verification"] = {"ensemble_weight": w}
    return config


# ------------------------------------------------------------------------------------------ acceptance rules
def random_round(seed: int, k: int, top_m: int, do_sample: bool):
    """Target scores (k + 1 rows), a draft chosen from the drafter's q, and q as the verifier rebuilds it."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(k + 1, V, generator=g) * 2
    drafter_scores = torch.randn(k, V, generator=g) * 2
    params = GenerationParams(do_sample=do_sample, seed=seed)
    draft, q_rows = [], []
    for i in range(k):
        tok = choose(drafter_scores[i], params, 10 + i, top_m, greedy_q=True)
        draft.append(tok.token)
        q_rows.append(torch.zeros(V).scatter_(0, tok.q_idx.long(), tok.q_prob))
    if not do_sample and seed % 2:  # half the greedy rounds draft the target's own argmax (long accepted runs)
        draft = scores[:k].argmax(-1).tolist()
    return scores, draft, torch.stack(q_rows)


@pytest.mark.parametrize("top_m", [0, 3])
def test_sampling_w_to_1_gives_the_lossless_outcomes(top_m):
    for seed in range(2000):
        scores, draft, q = random_round(seed, 3, top_m, do_sample=True)
        lossless = accept_sampling(scores, draft, q, make_generator(seed, 5, 0))
        ensemble = accept_sampling(scores, draft, q, make_generator(seed, 5, 0), ensemble_weight=W_TO_1)
        assert ensemble == lossless, seed


@pytest.mark.parametrize("top_m", [0, 3])
def test_greedy_w_to_1_picks_argmax_p(top_m):
    for seed in range(500):
        scores, draft, q = random_round(seed, 4, top_m, do_sample=False)
        assert ensemble_targets(scores, q, W_TO_1) == scores.argmax(-1).tolist()
        assert accept_greedy(scores, draft, q, W_TO_1) == accept_greedy(scores, draft)


def test_greedy_ensemble_takes_argmax_v_and_the_bonus_from_p():
    p = torch.tensor([[0.5, 0.4, 0.1], [0.5, 0.4, 0.1], [0.1, 0.2, 0.7]])
    q = torch.tensor([[0.0, 0.9, 0.0], [0.0, 0.2, 0.0]])  # top-m truncated, not renormalised: 0 outside
    scores = p.log()
    # row 0: v = [.25, .65, .05] → 1; row 1: v = [.25, .30, .05] → 1; bonus: argmax p → 2
    assert ensemble_targets(scores, q, 0.5) == [1, 1, 2]
    assert accept_greedy(scores, [1, 1], q, 0.5) == [1, 1, 2]
    assert accept_greedy(scores, [1, 0], q, 0.5) == [1, 1]  # correction: argmax v, not argmax p
    assert accept_greedy(scores, [1, 1]) == [0]  # lossless: argmax p
    assert accept_greedy(scores[:1], [], None, 0.5) == [0]  # no draft: a plain target step


def test_ensemble_rules_need_q_and_a_weight_in_the_open_interval():
    scores = torch.zeros(3, V)
    with pytest.raises(ValueError, match="needs the draft distribution q"):
        accept_greedy(scores, [1, 2], None, 0.5)
    with pytest.raises(ValueError, match="needs the draft distribution q"):
        accept_sampling(scores, [1, 2], None, make_generator(0, 0, 0), 0.5)
    for bad in (0, 1, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="open interval"):
            accept_greedy(scores, [1], torch.ones(1, V) / V, bad)


# ------------------------------------------------------------------------------------------ distribution, in process
def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g) * sharpness).log_softmax(-1)


def joint(step: torch.Tensor, start: int) -> torch.Tensor:
    """P(x1, x2) for a next-token matrix ``step`` (rows: last token)."""
    return step[start][:, None] * step


def two_tokens(log_p, log_q, seed: int, k: int, w: float | None) -> tuple[int, int]:
    """Rounds of draft (sampled from q) + ensemble verification until two tokens are committed."""
    params = GenerationParams(do_sample=True, seed=seed)
    context = [0]
    while len(context) < 3:
        base = len(context)
        draft, q_rows = [], []
        for _ in range(k):
            tok = choose(log_q[(context + draft)[-1]], params, base + len(draft), 0)
            q_rows.append(torch.zeros(V).scatter_(0, tok.q_idx.long(), tok.q_prob))
            draft.append(tok.token)
        rows = torch.stack([log_p[t] for t in [context[-1], *draft]])
        context += accept_sampling(rows, draft, torch.stack(q_rows), make_generator(seed, base, 0), w)
    return context[1], context[2]


def test_in_process_output_distribution_is_v():
    """With k ≥ 2 both tokens come from drafted positions, so the joint is exactly v(x1)·v(x2 | x1)."""
    w, n = 0.5, 6000
    log_p, log_q = markov(1, 2.0), markov(2, 2.0)
    p, q = log_p.exp(), log_q.exp()
    v = w * p + (1 - w) * q
    counts = torch.zeros(V, V)
    for seed in range(n):
        x1, x2 = two_tokens(log_p, log_q, seed, 3, w)
        counts[x1, x2] += 1
    emp = counts / n
    first = emp.sum(1)
    predicted = (1 - w) * tv(p[0], q[0])  # TV(v, p) = (1 − w)·TV(p, q), exactly, for one token
    assert predicted > 0.2
    # An exact sampler of 36 outcomes with n = 6000 lands near TV 0.03 (6 outcomes: 0.01); the bounds leave margin.
    assert tv(emp, joint(v, 0)) < 0.06
    assert abs(tv(first, p[0]) - predicted) < 0.03
    assert tv(emp, joint(p, 0)) > 0.2  # clearly not the target's distribution


# ------------------------------------------------------------------------------------------ end to end
def test_greedy_w_to_1_matches_transformers_and_sends_q(tiny):
    target, drafter = tiny("llama", "target"), tiny("llama", "random")
    prompts = [[5, 17, 33, 2, 60], [100, 101, 7]]
    expected = [reference_greedy(target, prompt, 30) for prompt in prompts]

    async def main(config):
        async with cluster(config) as client:
            return await asyncio.gather(*(
                client.generate(token_ids=prompt, max_new_tokens=30, eos_token_ids=[]) for prompt in prompts
            ))

    for overlap in (True, False):
        config = ensemble_config(target, drafter, W_TO_1, num_draft_tokens=4, overlap=overlap, q_top_k=16)
        results = asyncio.run(main(config))
        assert [r.token_ids for r in results] == expected
        for r in results:
            # drafts without q would be refused under ensemble and every round would be a plain target step
            assert r.metrics["drafts"] > 0 and r.metrics["fallback_rounds"] < r.metrics["rounds"]
            assert r.metrics["ensemble_weight"] == W_TO_1


def test_greedy_ensemble_raises_acceptance_on_a_disagreeing_pair(tiny):
    """Measured on tiny models: a random drafter is rarely right under p; v = ½p + ½q meets it halfway."""
    target, drafter = tiny("llama", "target"), tiny("llama", "random")
    prompt = [5, 17, 33, 2, 60]

    async def run(w):
        config = ensemble_config(target, drafter, w, num_draft_tokens=3, overlap=False)
        async with cluster(config) as client:
            return await client.generate(token_ids=prompt, max_new_tokens=40, eos_token_ids=[])

    lossless = asyncio.run(run(None))
    ensemble = asyncio.run(run(0.5))
    assert lossless.token_ids == reference_greedy(target, prompt, 40)
    assert lossless.metrics["ensemble_weight"] is None and ensemble.metrics["ensemble_weight"] == 0.5
    assert ensemble.metrics["acceptance_rate"] > lossless.metrics["acceptance_rate"] + 0.1
    assert ensemble.token_ids != lossless.token_ids  # lossy by design


N_E2E = 800
W_E2E = 0.5


def test_sampling_distribution_end_to_end_is_v_not_p(sharp_pair):
    """First two sampled tokens over N seeded requests through real nodes. With k = 3 drafted tokens, no timeouts
    and max_new_tokens = 3 both come from drafted positions, so their joint is v(x1)·v(x2 | x1) exactly; the first
    token's distance from the target's must match (1 − w)·TV(p, q) and be clearly above the sampling noise."""
    target, drafter = sharp_pair
    p_joint, q_joint = exact_joint(target), exact_joint(drafter)
    p1, q1 = p_joint.sum(1), q_joint.sum(1)
    p2, q2 = p_joint / p1[:, None], q_joint / q1[:, None]
    w = W_E2E
    v1, v2 = w * p1 + (1 - w) * q1, w * p2 + (1 - w) * q2
    v_joint = v1[:, None] * v2
    predicted = (1 - w) * tv(p1, q1)
    assert predicted > 0.3, "the drafter must really differ from the target"
    config = ensemble_config(target, drafter, w, num_draft_tokens=3, q_top_k=0)
    config["verifier"]["draft_timeout_ms"] = 60000  # a timed-out round would be a plain step from p

    async def sample():
        counts = torch.zeros(VOCAB, VOCAB)
        slowest = 0.0
        drafts = 0
        async with start_cluster(config) as client:  # the inproc launcher: 800 requests
            for start in range(0, N_E2E, 50):
                results = await asyncio.gather(*(
                    client.generate(token_ids=PROMPT, max_new_tokens=3, do_sample=True, seed=seed, eos_token_ids=[])
                    for seed in range(start, start + 50)
                ))
                for r in results:
                    counts[r.token_ids[0], r.token_ids[1]] += 1
                    slowest = max(slowest, r.metrics["elapsed_s"])
                    drafts += r.metrics["drafts"]
        return counts / N_E2E, slowest, drafts

    emp, slowest, drafts = asyncio.run(sample())
    # Every request saw drafts, and none waited out the draft timeout (the only way to a draftless round here:
    # the empty rounds metrics count as fallbacks are the ones with one token left, cut to no draft).
    assert drafts >= N_E2E and slowest < 60
    measured = tv(emp.sum(1), p1)
    noise = 0.5 * sum(math.sqrt(2 * x * (1 - x) / (math.pi * N_E2E)) for x in v1.tolist())  # E TV of n draws
    print(f"\nensemble w={w}: TV(first token, p) measured {measured:.4f}, (1-w)·TV(p,q) = {predicted:.4f}, "
          f"noise ≈ {noise:.4f}; joint: TV(emp, v) {tv(emp, v_joint):.4f}, TV(emp, p) {tv(emp, p_joint):.4f}")
    # |TV(emp, p) − TV(v, p)| ≤ TV(emp, v), which an exact sampler keeps near `noise` (≈ 0.034 here).
    assert abs(measured - predicted) < 3 * noise
    assert measured > predicted / 2 > 3 * noise  # the negative: clearly NOT the target's distribution
    # The whole two-token joint is v's (144 outcomes, spread out: an exact sampler lands near 0.09 at N = 800).
    assert tv(emp, v_joint) < 0.16
    assert tv(emp, p_joint) > 0.4


# ------------------------------------------------------------------------------------------ refusals
def test_config_refuses_bad_weights():
    """(Which drafter types take ensemble verification: tests/test_conformance.py, for every type.)"""
    for bad in (0, 1, 1.0, 2, -0.5, "0.7", True, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"verification\.ensemble_weight: must be a number in the open"):
            load_config("cpu.yaml", {"verification.ensemble_weight": bad})


async def _fake_drafter(endpoint: str, tok_id: str, capabilities: Capabilities):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    await sock.send_multipart(encode(Hello(drafter_type="fake", tokenizer_id=tok_id, capabilities=capabilities)))
    assert await sock.poll(10000), "the verifier did not answer the hello"
    return ctx, sock, decode(await sock.recv_multipart())


def test_connect_and_request_refusals(tiny):
    """A drafter without q is refused at connect; with q only when sampling, greedy requests are refused."""
    from shared.models import load_tokenizer, tokenizer_id

    target = tiny("llama")
    tok_id = tokenizer_id(load_tokenizer(str(target)))
    config = ensemble_config(target, None, 0.7)
    config["launch"]["start_drafter"] = False

    async def main():
        async with cluster(config) as client:
            endpoint = client.config["verifier"]["endpoint"]
            ctx, sock, reply = await _fake_drafter(endpoint, tok_id, Capabilities(sends_q=False))
            assert isinstance(reply, Error) and reply.code == "ensemble_needs_q"
            assert "needs the draft distribution q" in reply.message and "'fake'" in reply.message
            assert not (await client.ping())["drafter_connected"]
            sock.close()
            ctx.term()

            ctx, sock, reply = await _fake_drafter(endpoint, tok_id, Capabilities(sends_q=True, greedy_q=False))
            assert isinstance(reply, Welcome) and reply.want_q is True
            with pytest.raises(PipespecError, match="sends none under greedy decoding") as info:
                await client.generate(token_ids=[5, 6, 7], max_new_tokens=4)
            assert info.value.code == "bad_request"
            # sampled requests are served (this fake drafter never drafts: plain steps after the timeout)
            config_ok = await client.generate(token_ids=[5, 6, 7], max_new_tokens=2, do_sample=True, seed=1)
            assert len(config_ok.token_ids) == 2
            sock.close()
            ctx.term()

    asyncio.run(main())


def test_drafter_node_refused_at_connect_exits_with_the_message(tiny, capsys):
    """A prompt-lookup drafter started on its own (another host's config) meets an ensemble verifier: it stops with
    exit status 2 and says why, instead of retrying forever."""
    from drafter_node.node import DrafterNode
    from drafter_node.prompt_lookup import PromptLookupDrafter

    target = tiny("llama")
    config = ensemble_config(target, None, 0.7)
    config["launch"]["start_drafter"] = False

    async def main():
        async with cluster(config) as client:
            cfg = copy.deepcopy(client.config)  # the verifier's config, concrete endpoints
            cfg["drafter"].update(type="prompt_lookup")
            sections = typed(cfg)
            node = DrafterNode.from_config(sections, drafter=PromptLookupDrafter(sections.drafter,
                                                                                 sections.drafter_type),
                                           links=drafter_links(cfg))
            result = {}
            thread = threading.Thread(target=lambda: result.setdefault("rc", node._loop()))
            thread.start()
            await asyncio.to_thread(thread.join, 20)
            node.stop()
            node.sock.close(linger=0)
            return result.get("rc")

    assert asyncio.run(main()) == 2
    err = capsys.readouterr().err
    assert "refused by the verifier" in err and "needs the draft distribution q" in err


# ------------------------------------------------------------------------------------------ the real pair (slow)
@pytest.mark.slow
def test_qwen_pair_acceptance_gain_at_w_07():
    """Acceptance at w = 0.7 is at least the lossless acceptance on the same 2 prompts (Qwen 1.5B + 0.5B)."""
    from benchmarks.ensemble_gain import load_prompts, measure

    rows = asyncio.run(measure("cpu.yaml", load_prompts(None, 2), max_new_tokens=48, weights=[None, 0.7]))
    lossless, ensemble = rows
    assert lossless["draft_tokens"] > 0 and ensemble["draft_tokens"] > 0
    assert ensemble["acceptance_rate"] >= lossless["acceptance_rate"], rows
