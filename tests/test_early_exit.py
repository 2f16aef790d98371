"""``early_exit`` drafter (LayerSkip): loads only the target's first E layers + final norm + LM head; greedy identity
with transformers on Qwen2 and GPT-2 (where transformers' own early exit fails); config errors for E outside
1..layers−1. tests/test_conformance.py runs the Llama case and the sampling check with its negative control."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

from drafter_node.early_exit import EarlyExitDrafter
from runtime.config import ConfigError, load_config, load_typed
from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]


def early_exit_config(target, exit_layer=1, **keys):
    config = tiny_config(target, None, **keys)
    config["drafter"].update(type="early_exit", model=None, assistant_early_exit=exit_layer)
    return config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_drafter_holds_only_the_first_layers_with_the_targets_weights(tiny, arch):
    target_path = tiny(arch)
    config = load_typed(early_exit_config(target_path), {"drafter.dtype": "float32"})
    drafter = EarlyExitDrafter(config.drafter, config.drafter_type)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    theirs = target.state_dict()
    ours = drafter.model.state_dict()
    assert sum(p.numel() for p in drafter.model.parameters()) < sum(p.numel() for p in target.parameters())
    layer_keys = [k for k in theirs if ".1." in k and ("layers." in k or ".h." in k)]
    assert layer_keys and not any(k in ours for k in layer_keys), "layer 1 must not be loaded"
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key  # layer 0, embeddings, final norm, LM head: the target's own


@pytest.mark.parametrize(("arch", "overlap"), [("qwen2", False), ("gpt2", True), ("gpt2", False)])
def test_early_exit_greedy_matches_transformers(tiny, arch, overlap):
    target = tiny(arch)
    expected = [reference_greedy(target, p, 30) for p in PROMPTS]

    async def main():
        async with cluster(early_exit_config(target, overlap=overlap, num_draft_tokens=3)) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=30, eos_token_ids=[])
                                          for p in PROMPTS))

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == expected
    assert results[0].metrics["drafts"] > 0


@pytest.mark.parametrize("exit_layer", [0, 2, 5, "one", True])
def test_exit_layer_outside_the_target_is_a_config_error(tiny, exit_layer):
    with pytest.raises(ConfigError, match=r"drafter\.assistant_early_exit"):
        load_config(early_exit_config(tiny("llama"), exit_layer))
