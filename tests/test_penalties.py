"""presence_penalty, frequency_penalty and logit_bias (with repetition_penalty and min_new_tokens), lossless.

* unit: :func:`shared.sampling.process_logits` against hand-computed scores and against transformers' own
  processors (``RepetitionPenaltyLogitsProcessor``, ``SequenceBiasLogitsProcessor``) chained with reference
  presence / frequency processors written here, independent of shared.penalties; the cheap contexts the verifier
  and drafters pass are the same as the whole sequence; bad values are refused naming the field;
* cluster: greedy output through a running cluster (a tiny Llama, a random drafter: drafts accepted and rejected)
  is token-identical to transformers' ``generate`` on the target alone with the same processors;
* statistical: sampling with the penalties lands within the bound of the exact penalised joint, while the
  unpenalised target's joint and the penalised drafter's (what a verifier that skipped the penalties or accepted
  every draft would give) are far outside it, and a measured run through an accept-all verifier is too;
* HTTP: the fields through the real server and the ``openai`` package equal ``AsyncClient.generate`` with the same
  parameters; bad values are 400s naming the field.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest
import torch
from conftest import start_cluster, tiny_config
from sampling_check import TV_BOUND, check_lossless_sampling, exact_joint, sample_pairs, tv
from test_universal import encode, make_drafter, pairs  # noqa: F401 (pairs: tokenizers and models, a fixture)
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from benchmarks.http_overhead import free_port
from drafter_node.lm_drafter import pick_token
from drafter_node.universal import draft_bias
from http_server.errors import OpenAIError
from http_server.schemas import ChatRequest, CompletionRequest, check_supported
from runtime.launch import serve_http
from shared.sampling import GenerationParams, ParamError, process_block, process_logits
from testkit.tiny_models import _reference_model
from verifier_node.tree import DraftTree, process_tree


class PresencePenalty(LogitsProcessor):
    """Reference: subtract ``penalty`` once from every token generated so far (``input_ids`` past the prompt)."""

    def __init__(self, penalty: float, prompt_len: int):
        self.penalty, self.prompt_len = penalty, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token in set(ids[self.prompt_len:]):
                scores[row, token] -= self.penalty
        return scores


class FrequencyPenalty(LogitsProcessor):
    """Reference: subtract ``penalty`` × its count from every token generated so far."""

    def __init__(self, penalty: float, prompt_len: int):
        self.penalty, self.prompt_len = penalty, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token, count in Counter(ids[self.prompt_len:]).items():
                scores[row, token] -= self.penalty * count
        return scores


def reference_chain(params: dict, prompt_len: int) -> list[LogitsProcessor]:
    """What ``generate(logits_processor=...)`` gets for ``params``' presence, frequency and bias (in pipespec's
    order; the built-in repetition penalty and min_new_tokens are ``generate``'s own arguments)."""
    chain: list[LogitsProcessor] = []
    if params.get("presence_penalty"):
        chain.append(PresencePenalty(params["presence_penalty"], prompt_len))
    if params.get("frequency_penalty"):
        chain.append(FrequencyPenalty(params["frequency_penalty"], prompt_len))
    if params.get("logit_bias"):
        chain.append(SequenceBiasLogitsProcessor({(int(t),): float(b) for t, b in params["logit_bias"].items()}))
    return chain


# ------------------------------------------------------------------------------------------------ unit
@pytest.mark.unit
def test_penalties_and_bias_against_a_hand_computed_row():
    logits = torch.arange(8, dtype=torch.float32)
    context = torch.tensor([1, 2, 2, 3, 3, 4])  # prompt [1, 2, 2], generated [3, 3, 4]
    p = GenerationParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"2": 1.5, "5": -100, "7": 0})
    p.validate(8)
    out = process_logits(logits, context, p, num_generated=3)
    expected = [0, 1, 2 + 1.5, 3 - 0.5 - 2 * 0.25, 4 - 0.5 - 0.25, 5 - 100, 6, 7]  # the prompt's 2 is no repeat
    assert out.tolist() == expected
    # a negative penalty favours repeats
    p = GenerationParams(presence_penalty=-1.0, frequency_penalty=-2.0)
    assert process_logits(logits, context, p, 3).tolist() == [0, 1, 2, 3 + 1 + 4, 4 + 1 + 2, 5, 6, 7]
    # nothing generated yet: only the bias
    p = GenerationParams(presence_penalty=2.0, frequency_penalty=2.0, logit_bias={"0": 3.0})
    assert process_logits(logits, context, p, 0).tolist() == [3, 1, 2, 3, 4, 5, 6, 7]
    # a row narrower than the vocabulary the ids were checked against (a drafter's) takes the ids it has
    p = GenerationParams(logit_bias={"2": 1.0, "6": 5.0, "9": 1.0})
    assert process_logits(logits[:4], context, p, 0).tolist() == [0, 1, 3, 3]


@pytest.mark.unit
@pytest.mark.parametrize("params", [
    dict(presence_penalty=0.7, frequency_penalty=0.3, logit_bias={"7": 2.5, "11": -4.0}),
    dict(repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=1.1, logit_bias={"3": 5.0}),
    dict(repetition_penalty=0.8, logit_bias={"40": -100, "3": 100}),
    dict(do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.2, presence_penalty=1.5,
         frequency_penalty=-0.5, logit_bias={"11": 1.0}),
])
def test_process_logits_matches_transformers_processors(params):
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    prompt_len = 2
    context = torch.tensor([3, 7, 7, 11, 40, 11, 11])  # prompt [3, 7], generated [7, 11, 40, 11, 11]
    p = GenerationParams(**params)
    p.validate(50)
    ours = process_logits(logits, context, p, num_generated=context.numel() - prompt_len)
    chain: list[LogitsProcessor] = []
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))  # built-in: before the list
    chain += reference_chain(params, prompt_len)
    if p.do_sample:
        chain += [TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k)]
    ref = LogitsProcessorList(chain)(context[None], logits[None].clone())[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ours)
    assert torch.allclose(ours[finite], ref[finite], atol=1e-5)
    assert not torch.allclose(ours, logits.float())  # the parameters changed something


@pytest.mark.unit
def test_generated_only_context_and_trees_give_the_same_rows():
    """The verifier passes only the generated tokens where no repetition penalty reads the prompt, and trees
    process each node on its own path: the same rows as the whole sequence through process_block."""
    torch.manual_seed(1)
    p = GenerationParams(presence_penalty=0.6, frequency_penalty=0.9, logit_bias={"4": 1.0})
    prompt, generated, block = [4, 5, 5, 9], [9, 2, 2], [2, 4, 7]
    logits = torch.randn(len(block) + 1, 12)
    whole = process_block(logits, torch.tensor(prompt + generated), torch.tensor(block), p, len(generated))
    short = process_block(logits, torch.tensor(generated), torch.tensor(block), p, len(generated))
    assert torch.equal(whole, short)
    tree = process_tree(logits, torch.tensor(prompt + generated), DraftTree.from_chain(block), p, len(generated))
    assert torch.equal(whole, tree)
    assert not torch.equal(whole, process_block(logits, torch.tensor(generated), torch.tensor(block),
                                                GenerationParams(), len(generated)))


@pytest.mark.unit
def test_drafters_apply_the_same_processing():
    # an LM drafter (the target's vocabulary) picks the biased token; a padded head keeps its extra columns out
    logits = torch.zeros(10)
    logits[3] = 5.0
    p = GenerationParams(logit_bias={"6": 6.0})
    p.validate(8)
    assert pick_token(logits, [1, 2], p, 2, 8, 0).token == 6
    p = GenerationParams(frequency_penalty=2.0, presence_penalty=2.0)
    assert pick_token(logits, [1, 3, 3], p, 1, 8, 0).token != 3  # 5 - 2 - 4 < 0
    # universal: target ids move onto the drafter's ids; ids without a counterpart are not applied at all
    assert draft_bias({"5": 2.0, "7": -1.0, "9": 3.0}, {5: 50, 7: 70}) == {"50": 2.0, "70": -1.0}


@pytest.mark.unit
@pytest.mark.parametrize("bad,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"frequency_penalty": True}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"), ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1, 5: 2}}, "logit_bias"), ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
])
def test_bad_penalties_are_refused_naming_the_field(bad, field):
    with pytest.raises(ParamError, match=field):
        GenerationParams.from_dict(bad, vocab_size=100 if field != "logit_bias" or len(bad[field]) < 1000 else 2000)


@pytest.mark.unit
def test_logit_bias_keys_become_text_and_round_trip():
    p = GenerationParams.from_dict({"logit_bias": {7: 1, "3": -2.5, "9": 0}}, vocab_size=10)
    assert p.logit_bias == {"3": -2.5, "7": 1.0}  # sorted, floats, the zero bias dropped
    assert GenerationParams.from_dict(p.to_dict(), vocab_size=10) == p


@pytest.mark.unit
def test_http_fields_map_and_refuse():
    from http_server.generation import generation_params

    req = CompletionRequest(prompt="hi", temperature=0, presence_penalty=0.5, frequency_penalty=-1,
                            logit_bias={"5": 10}, repetition_penalty=1.1, min_tokens=3)
    check_supported(req)
    params = generation_params(req, 16)
    assert params == {"max_new_tokens": 16, "do_sample": False, "presence_penalty": 0.5, "frequency_penalty": -1,
                      "logit_bias": {"5": 10}, "repetition_penalty": 1.1, "min_new_tokens": 3}
    GenerationParams.from_dict(params, vocab_size=100)  # what the verifier accepts
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"5": -101}}, {"logit_bias": {"5": None}}):
        req = ChatRequest(messages=[{"role": "user", "content": "hi"}], **bad)
        with pytest.raises(OpenAIError) as info:
            check_supported(req)
        assert info.value.status == 400 and info.value.param == "logit_bias"


@pytest.mark.cluster
def test_universal_drafter_moves_the_bias_onto_its_vocabulary(pairs):  # noqa: F811 (the imported fixture)
    """A drafter with another tokenizer: greedy drafting in its own vocabulary gets the bias on the counterpart id
    (a target id applied there as it is would name another token), sampled drafting on the target's ids."""
    drafter = make_drafter(pairs, "other")
    prompt = encode(pairs["target"], "def add(a, b):")
    t2d = drafter.vocab.t2d
    target_id = next(t for t, d in sorted(t2d.items()) if t != d and t > 10 and t < drafter.draft_vocab_size)
    params = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {str(target_id): 100.0},
              "eos_token_ids": []}
    greedy = drafter.open_session(prompt, len(prompt), GenerationParams.from_dict(params), {})
    assert greedy.draft_params.logit_bias == {str(t2d[target_id]): 100.0}
    context = len(drafter.encode_draft(drafter.target_tokenizer.decode(prompt)))  # the drafter's prompt tokens
    greedy.propose(2)
    assert greedy.d_ids[context] == t2d[target_id]  # +100 on the counterpart: its argmax
    sampled = drafter.open_session(prompt, len(prompt), GenerationParams.from_dict(
        {**params, "do_sample": True, "seed": 5}), {})
    assert sampled.propose(3) == 3
    assert [d.token for d in sampled.chain] == [target_id] * 3  # +100 on the target's own id: q is all on it


# ------------------------------------------------------------------------------------------------ cluster
GREEDY_PROMPTS = [[5, 17, 33, 2, 60, 5, 17], [42] * 8 + [9, 8]]
GREEDY_PARAMS = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {"17": 3.0, "60": -100}},
    {"repetition_penalty": 1.4, "presence_penalty": -0.5, "frequency_penalty": 1.2, "logit_bias": {"9": 4.0},
     "min_new_tokens": 20},
]


def reference_generate(target, prompt: list[int], n: int, params: dict, eos: list[int]) -> list[int]:
    """transformers' ``generate`` on the target alone: greedy, its built-ins for repetition_penalty and
    min_new_tokens, the reference processors for the rest."""
    model = _reference_model(str(target))
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=eos,
        pad_token_id=1, repetition_penalty=params.get("repetition_penalty", 1.0),
        min_new_tokens=params.get("min_new_tokens", 0),
        logits_processor=LogitsProcessorList(reference_chain(params, len(prompt))),
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.cluster
def test_greedy_with_penalties_matches_transformers(tiny):
    target = tiny("llama", "target")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=4)
    cases = []
    for prompt in GREEDY_PROMPTS:
        for params in GREEDY_PARAMS:
            eos = [0] if "min_new_tokens" in params else []
            cases.append((prompt, params, eos, reference_generate(target, prompt, 30, params, eos)))
            # the parameters really change the output (else the check would not test them)
            assert cases[-1][3] != reference_generate(target, prompt, 30, {}, eos)

    async def main():
        async with start_cluster(config) as client:
            return await asyncio.gather(*(client.generate(token_ids=prompt, max_new_tokens=30, eos_token_ids=eos,
                                                          **params) for prompt, params, eos, _ in cases))

    results = asyncio.run(main())
    for (prompt, params, _, expected), result in zip(cases, results):
        assert result.token_ids == expected, f"prompt {prompt} params {params}"
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    assert 0 < accepted < drafted, "drafts must be both accepted and rejected"


# ------------------------------------------------------------------------------------------------ statistical
SAMPLED = {"presence_penalty": 1.8, "frequency_penalty": 1.2, "logit_bias": {"4": 2.0, "9": -3.0}}


@pytest.mark.statistical
def test_sampling_with_penalties_is_the_penalised_targets(sharp_pair):
    target, drafter = sharp_pair
    bias = {int(k): v for k, v in SAMPLED["logit_bias"].items()}
    penalised = {"presence": SAMPLED["presence_penalty"], "frequency": SAMPLED["frequency_penalty"], "bias": bias}
    exact = exact_joint(target, **penalised)
    # negative controls, each far outside the bound: a verifier that skipped the penalties (the plain target's
    # joint), or one that accepted every draft of a drafter that applies them (the penalised drafter's joint)
    wrong = {"the unpenalised target's joint": exact_joint(target),
             "the penalised drafter's joint": exact_joint(drafter, **penalised)}
    assert tv(wrong["the unpenalised target's joint"], exact) > 2 * TV_BOUND
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0)
    check_lossless_sampling(config, exact, wrong=wrong, params=SAMPLED)
    # and measured: the same requests through a verifier that accepts every draft land far outside the bound
    control = asyncio.run(sample_pairs(config, hooks={"verifier": "accept_all"}, params=SAMPLED))
    print(f"accept-all control with penalties: TV {tv(control.joint, exact):.3f}")
    assert control.accepted == control.drafted and tv(control.joint, exact) > 2 * TV_BOUND


# ------------------------------------------------------------------------------------------------ HTTP
#: (extra fields, the param the 400 names); the last three are refused by the verifier (it knows the vocabulary)
BAD_HTTP = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the tiny vocabulary (160)
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
]


@pytest.mark.cluster
def test_http_penalties_equal_async_client_and_bad_values_are_400s(tiny):
    """The real HTTP server (the launcher's serve_http, on an in-process cluster: one start for every check here)
    and the openai package: the fields give AsyncClient.generate's text; bad values are 400s naming the field."""
    config = tiny_config(tiny("llama", "target"), tiny("llama", "random"), num_draft_tokens=3)
    config["http"] = {"host": "127.0.0.1", "port": free_port()}
    fields = {"presence_penalty": 1.2, "frequency_penalty": 0.6, "logit_bias": {"50": 5, "60": -100},
              "repetition_penalty": 1.3}
    params = {**fields, "logit_bias": {50: 5, 60: -100}}  # the Python client takes int keys
    prompt = "def add(a, b):"

    async def main():
        async with start_cluster(config) as client, serve_http(client, client.config) as http:
            plain, want, want_min = await asyncio.gather(
                client.generate(prompt=prompt, max_new_tokens=16),
                client.generate(prompt=prompt, max_new_tokens=16, **params),
                client.generate(prompt=prompt, max_new_tokens=16, min_new_tokens=16, **params))
            async with openai.AsyncOpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0,
                                          timeout=60) as oai:
                model = http.model_name
                got = await oai.completions.create(  # the openai package's own arguments, where it has them
                    model=model, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=1.2,
                    frequency_penalty=0.6, logit_bias={"50": 5, "60": -100}, extra_body={"repetition_penalty": 1.3})
                got_min = await oai.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
                    extra_body={**fields, "min_tokens": 16})
                refusals = []
                for extra, _ in BAD_HTTP:
                    try:
                        await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=4, temperature=0, extra_body=extra)
                        refusals.append(None)
                    except openai.BadRequestError as exc:
                        refusals.append(exc.body)
            chat_min = await client.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=16,
                                             min_new_tokens=16, **params)
            return plain, want, want_min, got, got_min, chat_min, refusals

    plain, want, want_min, got, got_min, chat_min, refusals = asyncio.run(main())
    assert want.token_ids != plain.token_ids  # the parameters change the text: equality below means something
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    assert len(want_min.token_ids) == 16
    assert got_min.choices[0].message.content == chat_min.text and got_min.usage.completion_tokens == 16
    for (extra, param), body in zip(BAD_HTTP, refusals):
        assert body is not None, f"{extra} was served"
        assert body["param"] == param and body["type"] == "invalid_request_error", body
