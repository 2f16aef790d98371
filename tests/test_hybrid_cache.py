"""Rolling back hybrid and state-space caches (shared/kv.py): after a rejected draft, a Qwen3-Next, Mamba2, Falcon-H1
or LFM2 cache must equal one that never saw the rejected tokens, and a model whose cache pipespec cannot roll back is
refused when it is loaded."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared import kv
from shared.kv import CachedLM, rollback_problem
from shared.models import ModelLoadError, load_causal_lm
from testkit.tiny_hybrid import HYBRID_FAMILIES, build_hybrid

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 33, 2, 60, 7, 9]
DRAFT = [20, 21, 22, 23, 24]
NEXT = [30, 31, 32]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    from testkit.tiny_models import build_tokenizer

    root = tmp_path_factory.mktemp("hybrid")
    build_tokenizer(root / "tok")
    models = {}
    for family in HYBRID_FAMILIES:
        folder = build_hybrid(root / family, family, root / "tok", seed=3)
        models[family] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    models["folder.lfm2"] = root / "lfm2"
    return models


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    lm = CachedLM(model)
    logits, _ = lm.feed(tokens)
    return logits


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_crop_after_a_rejection_equals_a_cache_that_never_saw_it(hybrids, family):
    model = hybrids[family]
    assert rollback_problem(model.config) is None
    for accepted in (0, 1, 3, len(DRAFT)):  # rejected at the first draft, in the middle, none rejected
        lm = CachedLM(model)
        lm.feed(PROMPT)
        lm.feed(DRAFT)  # the verify forward of a round
        keep = len(PROMPT) + accepted
        lm.crop(keep)
        assert lm.length == keep
        # re-fed: the kept tokens after the round's start (nothing when every draft was accepted)
        assert lm.refed_total == (accepted if accepted < len(DRAFT) else 0)
        logits, _ = lm.feed(NEXT)
        expected = fresh_logits(model, (PROMPT + DRAFT)[:keep] + NEXT)[-len(NEXT):]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_crop_before_the_last_forward_rebuilds_from_the_start(hybrids, family):
    model = hybrids[family]
    lm = CachedLM(model)
    lm.feed(PROMPT)
    lm.feed(DRAFT)
    lm.crop(3)  # inside the prompt: behind the snapshot of the last forward
    assert (lm.length, lm.refed_total) == (3, 3)
    logits, _ = lm.feed(NEXT)
    torch.testing.assert_close(logits, fresh_logits(model, PROMPT[:3] + NEXT)[-len(NEXT):], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_a_greedy_round_by_round_decode_matches_generate(hybrids, family):
    """Rounds of 3 drafts of which only the first is right: every round rolls back, the output must not drift."""
    model = hybrids[family]
    ids = torch.tensor([PROMPT])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               eos_token_id=[], pad_token_id=1)[0, len(PROMPT):].tolist()
    lm = CachedLM(model)
    lm.feed(PROMPT[:-1])
    tokens, out = list(PROMPT), []
    while len(out) < 12:
        correct = reference[len(out)]
        draft = [correct, (correct + 1) % 100, (correct + 2) % 100]
        logits, _ = lm.feed([tokens[-1], *draft])
        picks = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == picks[accepted]:
            accepted += 1
        new = [*draft[:accepted], picks[accepted]]
        lm.crop(len(tokens) + accepted)  # keep the pending token and the accepted drafts
        tokens += new
        out += new
    assert out[:12] == reference
    assert lm.refed_total > 0


def test_hybrids_verify_one_session_per_forward(hybrids):
    for family in HYBRID_FAMILIES:
        assert not CachedLM(hybrids[family]).batchable, family  # ragged batching stacks K/V only


def test_attention_caches_pass_the_load_check():
    from testkit.tiny_models import gemma4_text_config, model_config

    assert rollback_problem(model_config("llama", 160)) is None
    # Gemma 4: sliding layers and KV-sharing consumers (DummyLayer: no K/V of their own)
    gemma = gemma4_text_config(160, 64, ["sliding_attention", "full_attention", "sliding_attention"],
                               num_kv_shared_layers=1)
    assert rollback_problem(gemma) is None


def test_an_unsupported_cache_layer_is_refused_at_load(hybrids, monkeypatch):
    class OddLayer:
        pass

    class OddCache:
        def __init__(self, config):
            self.layers = [OddLayer()]

    monkeypatch.setattr(kv, "DynamicCache", OddCache)
    problem = rollback_problem(hybrids["lfm2"].config)
    assert problem == ("model type 'lfm2': cache layer 0 is a OddLayer, which pipespec cannot roll back after a "
                       "rejected draft (supported: attention, sliding-window attention, linear-attention / "
                       "state-space layers)")
    with pytest.raises(ModelLoadError, match=r"cannot serve the model .*lfm2.*model type 'lfm2': cache layer 0"):
        load_causal_lm(str(hybrids["folder.lfm2"]), "cpu", "float32", None)


def test_a_cache_transformers_cannot_build_is_refused(hybrids, monkeypatch):
    def broken(config):
        raise NotImplementedError("no cache for this one")

    monkeypatch.setattr(kv, "DynamicCache", broken)
    assert rollback_problem(hybrids["mamba2"].config) == (
        "model type 'mamba2': transformers cannot build a DynamicCache for it (no cache for this one)")
