"""``universal`` drafter (different tokenizers): greedy identity with transformers through a running cluster (overlap
on and off, and both directions of one vocabulary being a subset of the other), the text re-tokenisation with an
oracle drafter (drafted text comes out as the target's own tokens, rollback re-synchronises), the vocabulary map
(unmapped target tokens get q = 0), the sampling distribution with overlap off and a top-4 q, the refusal of a
drafter set up for another target, and the bundled config. tests/test_conformance.py runs the greedy case with
overlap and a drafter of other merges, the sampling check with its negative control, and the config refusals.

Tokenizers are byte-level BPEs trained on the spot with different corpora, sizes and special-token orders, so ids
differ between them even for the same text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from sampling_check import check_lossless_sampling, exact_joint
from transformers import PreTrainedTokenizerFast

from drafter_node.universal import UniversalDrafter, VocabMap
from runtime.config import load_config, load_typed
from runtime.launch import LaunchError, cluster
from shared.models import tokenizer_id
from shared.sampling import GenerationParams
from testkit.conformance import build_word_drafter
from testkit.tiny_models import CORPUS, OTHER_CORPUS, build_bpe, build_model, reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n", "the quick brown fox"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Tokenizer folders and tiny models: a target, a drafter with a different tokenizer, and the two subset cases."""
    root = tmp_path_factory.mktemp("universal")
    build_bpe(root / "tok_target", 330, CORPUS, ["<eos>", "<pad>"])
    build_bpe(root / "tok_other", 420, OTHER_CORPUS, ["<pad>", "<s>", "<eos>"])  # different merges and ids
    build_bpe(root / "tok_super", 460, CORPUS, ["<pad>", "<eos>"])  # ⊃ the target's vocabulary
    build_bpe(root / "tok_sub", 280, CORPUS, ["<eos>"])  # ⊂ the target's vocabulary, ids shifted by one
    out = {"root": root, "target": build_model(root / "target", "llama", root / "tok_target", seed=1)}
    for name, arch in (("other", "qwen2"), ("super", "llama"), ("sub", "gpt2")):
        out[name] = build_model(root / name, arch, root / f"tok_{name}", seed=3, layers=1)
    return out


def universal_config(target: Path, drafter: Path, **keys) -> dict:
    config = tiny_config(target, drafter, **keys)
    config["drafter"]["type"] = "universal"
    return config


def run_greedy(config: dict, prompts: list[list[int]], new_tokens: int):
    async def main():
        async with cluster(config) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=new_tokens, eos_token_ids=[])
                                          for p in prompts))

    return asyncio.run(main())


def encode(folder: Path, text: str) -> list[int]:
    return PreTrainedTokenizerFast.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------- greedy e2e


@pytest.mark.parametrize(("drafter", "overlap", "k"), [("other", False, 3), ("super", True, 5), ("sub", False, 4)])
def test_universal_greedy_matches_transformers(pairs, drafter, overlap, k):
    target = pairs["target"]
    prompts = [encode(target, p) for p in PROMPTS]
    expected = [reference_greedy(target, p, 30) for p in prompts]
    results = run_greedy(universal_config(target, pairs[drafter], overlap=overlap, num_draft_tokens=k), prompts, 30)
    assert [r.token_ids for r in results] == expected
    assert sum(r.metrics["drafts"] for r in results) > 0, "the drafter never contributed a block"


def test_subset_vocabularies_really_are_subsets(pairs):
    root = pairs["root"]
    vocab = {n: set(PreTrainedTokenizerFast.from_pretrained(root / f"tok_{n}").get_vocab())
             for n in ("target", "super", "sub")}
    assert vocab["target"] < vocab["super"] and vocab["sub"] < vocab["target"]


# ------------------------------------------------------------------------- re-tokenisation, oracle drafter


class OracleLM:
    """Stands in for the drafter's sequence handle: always predicts the drafter token that continues ``text``."""

    capacity = None  # no KV slot of its own

    def __init__(self, tokenizer, text: str, vocab: int):
        self.tokenizer, self.text, self.vocab, self.length = tokenizer, text, vocab, 0

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        done = self.tokenizer.decode(ids)
        assert self.text.startswith(done), (done, self.text)
        nxt = self.tokenizer(self.text[len(done):], add_special_tokens=False)["input_ids"][:1] or [0]
        logits = torch.zeros(self.vocab)
        logits[nxt[0]] = 10.0
        self.length = len(ids)
        return logits

    def crop(self, keep: int) -> None:
        self.length = min(self.length, keep)


def make_drafter(pairs, name: str, q_top_k: int = 0) -> UniversalDrafter:
    config = load_typed(universal_config(pairs["target"], pairs[name], q_top_k=q_top_k))
    drafter = UniversalDrafter(config.drafter, config.drafter_type)
    drafter.target_vocab_size = len(drafter.target_tokenizer)
    return drafter


@pytest.mark.parametrize("name", ["other", "super", "sub"])
def test_drafted_text_becomes_the_targets_own_tokens(pairs, name):
    drafter = make_drafter(pairs, name)
    text = "def add(a, b):\n    return a + b\nclass Node:\n    def __init__(self, value):\n"
    full = drafter.target_tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = full[:6]
    session = drafter.open_session(prompt, len(prompt), GenerationParams(eos_token_ids=[]), {})
    session.lm = OracleLM(drafter.tokenizer, text, drafter.draft_vocab_size)
    while len(session.chain) < 16:
        assert session.propose(1) > 0, (session.pending, session.chain_tokens)
    assert session.committed + session.chain_tokens == full[: len(prompt) + len(session.chain)]
    # A commit that rejects at position 12: rollback, re-tokenise (the cache keeps the common prefix), go on.
    wrong = [*session.chain_tokens[:12], full[len(prompt) + 12] + 1]
    assert session.observe_commit(wrong) == 12
    committed_text = drafter.target_tokenizer.decode(session.committed)
    # Only the tail is re-tokenised, and it comes out as re-tokenising the whole text would.
    tail = session._retokenise_tail(session.committed)
    assert tail is not None and tail == drafter.encode_draft(committed_text)
    more = committed_text + " = value\n    return a\n"
    session.lm = OracleLM(drafter.tokenizer, more, drafter.draft_vocab_size)
    while len(session.chain) < 4:
        assert session.propose(1) > 0, (session.pending, session.chain_tokens)
    expected = drafter.target_tokenizer(more, add_special_tokens=False)["input_ids"]
    assert session.committed + session.chain_tokens == expected[: len(session.committed) + len(session.chain)]
    # A session with no clean continuation waits for the next commit, then drafts again.
    session.stuck = True
    assert session.propose(1) == 0
    session.observe_commit(session.chain_tokens[:1])
    assert session.propose(1) > 0


# ------------------------------------------------------------------------------------------ vocabulary map


def test_vocab_map_is_one_to_one_on_identical_strings(pairs):
    root = pairs["root"]
    target = PreTrainedTokenizerFast.from_pretrained(root / "tok_target")
    for name in ("other", "super", "sub"):
        draft = PreTrainedTokenizerFast.from_pretrained(root / f"tok_{name}")
        vmap = VocabMap.build(draft, target)
        assert len(set(vmap.d2t.values())) == len(vmap) == len(vmap.t2d)
        for d, t in vmap.d2t.items():
            assert draft.convert_ids_to_tokens(d) == target.convert_ids_to_tokens(t)
        shared = set(draft.get_vocab()) & set(target.get_vocab())
        assert len(vmap) == len(shared)  # every shared string is mapped (specials included)
    sub = VocabMap.build(PreTrainedTokenizerFast.from_pretrained(root / "tok_sub"), target)
    assert len(sub) == len(PreTrainedTokenizerFast.from_pretrained(root / "tok_sub"))


@pytest.mark.parametrize(("name", "q_top_k"), [("other", 0), ("super", 0), ("sub", 8)])
def test_sampled_drafts_carry_q_over_mapped_target_tokens_only(pairs, name, q_top_k):
    drafter = make_drafter(pairs, name, q_top_k)
    mapped = set(drafter.vocab.t2d)
    assert len(mapped) < drafter.target_vocab_size or name == "super"
    prompt = encode(pairs["target"], "def add(a, b):")
    session = drafter.open_session(prompt, len(prompt), GenerationParams(do_sample=True, seed=3, eos_token_ids=[]),
                                   {})
    assert session.propose(6) == 6
    for d in session.chain:
        assert d.q_idx is not None and abs(float(d.q_prob.sum()) - 1) < 1e-5
        assert d.token in mapped and float(d.q_prob[d.q_idx.tolist().index(d.token)]) > 0
        support = {int(i) for i, p in zip(d.q_idx, d.q_prob) if p > 0}
        assert support <= mapped  # target tokens without a counterpart get q = 0
        assert len(d.q_idx) == (q_top_k or drafter.target_vocab_size)


def test_announces_the_target_tokenizer_it_translates_to(pairs):
    drafter = make_drafter(pairs, "other")
    assert drafter.tokenizer_id == tokenizer_id(PreTrainedTokenizerFast.from_pretrained(pairs["target"]))
    assert drafter.capabilities.sends_q


def test_a_drafter_set_up_for_another_target_is_refused(pairs):
    config = universal_config(pairs["target"], pairs["other"])
    config["drafter"]["target_model"] = str(pairs["super"])  # translates to the wrong target's ids

    async def main():
        async with cluster(config):
            pass

    with pytest.raises(LaunchError, match=r"tokenizer mismatch(.|\n)*drafter\.target_model"):
        asyncio.run(main())


# ------------------------------------------------------------------------------------------------ sampling


@pytest.fixture(scope="module")
def word_drafter(tmp_path_factory):
    return build_word_drafter(tmp_path_factory.mktemp("word_drafter"))


@pytest.mark.ci  # CI runs it beside make test's sparse check (tests/test_conformance.py)
def test_universal_sampling_is_lossless_without_overlap(sharp_pair, word_drafter):
    target, _ = sharp_pair
    config = universal_config(target, word_drafter, num_draft_tokens=3, q_top_k=4, overlap=False)
    check_lossless_sampling(config, exact_joint(target))


# -------------------------------------------------------------------------------------------------- config


def test_bundled_universal_config_loads():
    config = load_config("universal.yaml")
    assert config["drafter"]["type"] == "universal"
    assert config["drafter"]["model"] == "smollm2-135m-instruct"
    assert config["drafter"]["target_model"] == config["verifier"]["model"] == "qwen2.5-coder-1.5b-instruct"
