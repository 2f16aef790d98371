"""``mtp`` drafter (DeepSeek-V3 / GLM-4.5 multi-token-prediction layers inside the target checkpoint): loads only the
MTP layers + embeddings + LM head; incremental drafts equal a from-scratch recompute after partial acceptance;
greedy identity with transformers on tiny DeepSeek-V3 and GLM-4-MoE targets (K = 1 and 2, overlap on and off);
clear errors for checkpoints without MTP layers. tests/test_conformance.py runs the random DeepSeek-V3 K = 2 case
with overlap and the sampling check with its negative control."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import safetensors
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

from drafter_node.base import DraftToken
from drafter_node.mtp import MTPDrafter, MTPError
from runtime.config import ConfigError, load_config, load_typed
from runtime.launch import cluster
from shared.sampling import GenerationParams
from testkit.tiny_models import build_small_vocab_tokenizer, build_tokenizer, reference_greedy
from testkit.tiny_mtp import build_mtp_model

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42]]


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """``mtp_target(arch, k)`` → folder of a tiny target saved with k MTP layers."""
    root = tmp_path_factory.mktemp("mtp")
    build_tokenizer(root / "tok")
    cache = {}

    def get(arch: str, k: int = 1, with_weights: bool = True):
        key = (arch, k, with_weights)
        if key not in cache:
            cache[key] = build_mtp_model(root / f"{arch}-{k}-{with_weights}", arch, root / "tok", seed=3,
                                         mtp_layers=k, with_mtp_weights=with_weights)
        return cache[key]

    return get


def mtp_config(target, **keys):
    config = tiny_config(target, None, **keys)
    config["drafter"].update(type="mtp", model=None)
    return config


def load_drafter(target) -> MTPDrafter:
    return MTPDrafter(load_typed(mtp_config(target)).drafter)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_drafter_reads_only_the_mtp_layers_embeddings_and_head(mtp_target, arch, monkeypatch):
    target = mtp_target(arch, 2)
    read: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    drafter = load_drafter(target)
    monkeypatch.undo()
    assert drafter.block_len == 2 and drafter.capabilities.needs_hidden_states
    assert not [k for k in read if k.startswith(("model.layers.0.", "model.layers.1.", "model.norm."))], \
        "the target's own decoder layers must not be read"
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.2.eh_proj.weight",
            "model.layers.3.eh_proj.weight"} <= set(read)
    with safetensors.safe_open(str(target / "model.safetensors"), "pt") as f:
        for j, module in enumerate(drafter.modules):
            p = f"model.layers.{2 + j}."
            assert torch.equal(module.eh_proj.weight, f.get_tensor(p + "eh_proj.weight"))
            assert torch.equal(module.enorm.weight, f.get_tensor(p + "enorm.weight"))
            assert torch.equal(module.shared_head_norm.weight, f.get_tensor(p + "shared_head.norm.weight"))
            expert = f.get_tensor(p + "mlp.experts.1.down_proj.weight")
            assert torch.equal(module.block.mlp.experts.down_proj[1], expert)
        assert torch.equal(drafter.head.weight, f.get_tensor("lm_head.weight"))
        assert torch.equal(drafter.embed.weight, f.get_tensor("model.embed_tokens.weight"))
    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    layers = sum(p.numel() for p in full.model.layers.parameters())
    mtp = sum(p.numel() for p in drafter.modules.parameters())
    assert mtp < 1.5 * layers  # two MTP (MoE) layers against the target's two: the drafter holds no target layer


def target_hidden(target, ids: list[int]) -> torch.Tensor:
    """The target's final-norm hidden states of every position of ``ids`` (what the verifier sends)."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def fresh_logits(drafter, committed, chain, hidden, params) -> list[torch.Tensor]:
    """From scratch: a new session over the whole committed prefix (every module computed over all positions in
    one forward); the draft logits at each of ``chain``'s positions."""
    s = drafter.open_session(committed, 3, params, {"hidden": hidden[: len(committed) - 1]})
    out = []
    for token in chain:
        out.append(s.draft_logits())
        s.chain.append(DraftToken(token))
    return out


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_incremental_drafts_equal_a_recompute_after_partial_acceptance(mtp_target, arch):
    target = mtp_target(arch, 2)
    drafter = load_drafter(target)
    drafter.target_vocab_size = drafter.config.vocab_size
    params = GenerationParams()
    prompt = [5, 17, 33]
    # The sequence the verifier commits over the rounds below, and the target's hidden rows for all of it.
    s = drafter.open_session(prompt, 3, params, {"hidden": None})
    assert s.propose(2) == 0, "no target hidden state for the prompt: nothing to draft from"
    final = [*prompt, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    hidden = target_hidden(target, final)
    s = drafter.open_session(prompt, 3, params, {"hidden": hidden[:2]})
    committed = list(prompt)
    # (commit tokens as a function of the chain): partial acceptance, full rejection, full acceptance + bonus.
    rounds = [lambda c: [c[0], 9 if c[1] != 9 else 10], lambda c: [11 if c[0] != 11 else 12],
              lambda c: [*c, 13], lambda c: [c[0], 14 if c[1] != 14 else 15]]
    for make in rounds:
        logits = []
        for _ in range(2):
            logits.append(s.draft_logits())
            assert s.propose(1) == 1
        assert s.propose(1) == 0, "K = 2 drafts per round: the next needs new target hidden states"
        chain = s.chain_tokens
        for got, want in zip(logits, fresh_logits(drafter, committed, chain, hidden, params)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens = make(chain)
        final[len(committed):len(committed) + len(tokens)] = tokens
        hidden = target_hidden(target, final)  # the target over the sequence as committed so far
        base = len(committed)
        s.observe_commit(tokens, {"hidden": hidden[base - 1 : base - 1 + len(tokens)]})
        committed += tokens
        assert s.chain == [] or s.chain_tokens == chain[: len(s.chain)]
    # The caches were kept and cropped, never rebuilt: module 1 holds positions up to (committed − 3).
    assert s.lengths[1] >= len(committed) - 3


def test_a_session_without_hidden_states_waits_for_them(mtp_target):
    """A session announced without hidden rows (the drafter connected after the prefill) drafts nothing until a
    commit brings rows, then drafts from there on; a commit without rows restarts that way."""
    target = mtp_target("deepseek_v3", 2)
    drafter = load_drafter(target)
    drafter.target_vocab_size = drafter.config.vocab_size
    ids = [5, 17, 33, 2, 60, 7, 8, 9]
    hidden = target_hidden(target, ids)
    s = drafter.open_session(ids[:5], 5, GenerationParams(), {})
    assert s.propose(2) == 0
    s.observe_commit([7], {"hidden": hidden[4:5]})  # the pending token's row
    assert s.propose(3) == 2 and s.start == 4
    s.observe_commit([s.chain_tokens[0], 9], {})  # no rows: nothing to draft from until the next commit
    assert s.propose(2) == 0
    s.observe_commit([1], {"hidden": hidden[0:1]})
    assert s.propose(2) == 2


@pytest.fixture(scope="module")
def distilled_target(tmp_path_factory):
    """``distilled_target(arch, k)`` → a tiny target (12-token vocabulary) whose MTP layers were trained on its own
    greedy output, so drafts are often accepted (partial and full acceptance, pre-draft hits). k = 1 is the same
    checkpoint declaring only its first MTP layer."""
    root = tmp_path_factory.mktemp("distilled")
    build_small_vocab_tokenizer(root / "tok")
    cache = {}

    def get(arch: str, k: int):
        if (arch, 2) not in cache:
            cache[arch, 2] = build_mtp_model(root / f"{arch}-2", arch, root / "tok", seed=5, mtp_layers=2,
                                             distil=True)
        if k == 1 and (arch, 1) not in cache:
            folder = root / f"{arch}-1"
            shutil.copytree(cache[arch, 2], folder)
            config = json.loads((folder / "config.json").read_text())
            config["num_nextn_predict_layers"] = 1
            (folder / "config.json").write_text(json.dumps(config))
            cache[arch, 1] = folder
        return cache[arch, k]

    return get


SMALL_PROMPTS = [[2, 5, 7, 3, 9], [4, 4, 10], [6]]


def greedy_cases(target, prompts):
    """(prompt, request params, expected tokens): plain runs, EOS inside a block, a short max_new_tokens."""
    plain = [reference_greedy(target, p, 24) for p in prompts]
    eos = plain[0][9]
    cases = [(p, {"max_new_tokens": 24, "eos_token_ids": []}, e) for p, e in zip(prompts, plain)]
    cases.append((prompts[0], {"max_new_tokens": 24, "eos_token_ids": [eos]},
                  reference_greedy(target, prompts[0], 24, eos=[eos])))
    cases.append((prompts[1], {"max_new_tokens": 7, "eos_token_ids": []}, reference_greedy(target, prompts[1], 7)))
    return cases


@pytest.mark.parametrize(("arch", "k", "overlap", "drafter"), [
    ("deepseek_v3", 1, True, "distilled"), ("glm4_moe", 1, False, "distilled"),
    ("deepseek_v3", 2, False, "distilled"), ("glm4_moe", 2, True, "distilled"),
    ("glm4_moe", 1, False, "random"),
])
def test_mtp_greedy_matches_transformers(mtp_target, distilled_target, arch, k, overlap, drafter):
    if drafter == "distilled":
        target, prompts = distilled_target(arch, k), SMALL_PROMPTS
    else:
        target, prompts = mtp_target(arch, k), PROMPTS
    cases = greedy_cases(target, prompts)

    async def main():
        async with cluster(mtp_config(target, overlap=overlap)) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, **params) for p, params, _ in cases))

    results = asyncio.run(main())
    for (prompt, params, expected), result in zip(cases, results):
        assert result.token_ids == expected, f"prompt {prompt} params {params}"
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    assert drafted > 0
    assert all(len(r.metrics["per_position_acceptance"]) <= k for r in results), "K drafts per round at most"
    if drafter == "distilled":
        assert accepted / drafted > 0.4, "the distilled MTP layers should mostly be accepted"


@pytest.mark.parametrize("case", ["zero_layers", "weights_missing"])
def test_checkpoint_without_mtp_layers_is_a_clear_error(mtp_target, case):
    target = mtp_target("glm4_moe", 0) if case == "zero_layers" else mtp_target("deepseek_v3", 1, with_weights=False)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        load_config(mtp_config(target))

    async def launch():
        async with cluster(mtp_config(target)):
            pass

    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        asyncio.run(launch())
    settings = load_typed(tiny_config(target, None)).drafter  # an assistant config passes; the drafter refuses
    with pytest.raises(MTPError, match="num_nextn_predict_layers"):
        MTPDrafter(settings)


def test_a_target_without_mtp_support_is_a_clear_error(tiny):
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers"):
        load_config(mtp_config(tiny("llama")))
