"""Lossless sampling on a hybrid target (LFM2: convolution state and attention): the joint distribution of the first
two sampled tokens through real nodes matches the target's, and the drafter's own joint is far outside the bound
(tests/sampling_check.py). Every rejected draft rolls the verifier's convolution state back."""

from __future__ import annotations

import pytest
from conftest import tiny_config
from sampling_check import check_lossless_sampling, exact_joint, tv

from testkit.tiny_hybrid import build_hybrid
from testkit.tiny_models import build_small_vocab_tokenizer

pytestmark = pytest.mark.ci  # CI runs it beside make test's one sampling check per kind of draft


def test_hybrid_sampling_distribution_is_the_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-sampling")
    build_small_vocab_tokenizer(root / "tok")
    target = build_hybrid(root / "target", "lfm2", root / "tok", seed=11, sharpen=1.5)
    drafter = build_hybrid(root / "drafter", "lfm2", root / "tok", seed=12, sharpen=1.5)
    exact = exact_joint(target)
    assert tv(exact, exact_joint(drafter)) > 0.4, "the drafter must really differ from the target"
    check_lossless_sampling(tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0), exact,
                            wrong={"the drafter's joint": exact_joint(drafter)})
