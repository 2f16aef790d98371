"""``mtp_drafter`` (Gemma 4 ``-assistant``): the drafter reads only the target's input embeddings; greedy identity
with transformers on a tiny Gemma 4 target (sliding + full layers, KV sharing, a window the generations outgrow),
overlap off (tests/test_conformance.py runs it with overlap, and the sampling check with its negative control); the
K/V rows the drafter holds equal the target cache's after partial acceptances (no stale rows); clear errors for a
target that is not Gemma-4-like."""

from __future__ import annotations

import asyncio

import pytest
import safetensors
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

from drafter_node.mtp_drafter import AssistantMTPDrafter, MTPDrafterError
from drafter_node.settings import DrafterConfig
from runtime.config import ConfigError, load_config, load_typed
from runtime.launch import cluster
from shared.backend import DynamicBackend
from shared.kv import CachedLM, KVRowsError
from shared.protocol import split_state
from shared.sampling import GenerationParams
from testkit.tiny_models import build_gemma4_pair, reference_greedy
from verifier_node.session import Session

pytestmark = pytest.mark.cluster

# One prompt of a single token (nothing to prefill: the drafter waits for the first commit's state), one longer than
# the sliding window of 8; all generations outgrow it.
PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def gemma4(model_dir, tokenizer_dir):
    return build_gemma4_pair(model_dir, tokenizer_dir)


def mtp_config(target, assistant, **keys):
    config = tiny_config(target, assistant, **keys)
    config["drafter"]["type"] = "mtp_drafter"
    return config


def drafter_for(target, assistant, **keys) -> AssistantMTPDrafter:
    return AssistantMTPDrafter(load_typed(mtp_config(target, assistant, **keys)).drafter)


def test_drafter_reads_only_the_targets_input_embeddings(gemma4, monkeypatch):
    target_path, assistant_path = gemma4
    read: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    drafter = drafter_for(target_path, assistant_path)
    monkeypatch.undo()
    assert read == ["model.embed_tokens.weight"], read
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=torch.float32)
    assert torch.equal(drafter.embed.weight, target.get_input_embeddings().weight)
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(drafter.embed(ids), target.get_input_embeddings()(ids))  # scaled like the target's
    held = sum(p.numel() for p in drafter.model.parameters()) + sum(p.numel() for p in drafter.embed.parameters())
    assert held == sum(p.numel() for p in assistant.parameters()) + target.get_input_embeddings().weight.numel()
    assert drafter.capabilities.needs_hidden_states and drafter.capabilities.sends_q
    assert drafter.capabilities.needs_kv_layers == [0, 1]  # the layers that store K/V (2 and 3 reuse them)


def test_mtp_drafter_greedy_matches_transformers(gemma4):
    target, assistant = gemma4
    expected = [reference_greedy(target, p, 30) for p in PROMPTS]

    async def main():
        async with cluster(mtp_config(target, assistant, overlap=False, num_draft_tokens=3)) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=30, eos_token_ids=[])
                                          for p in PROMPTS))

    results = asyncio.run(main())
    print("acceptance", [round(r.metrics["acceptance_rate"], 2) for r in results],
          "rolled back", [r.metrics["rolled_back_draft_tokens"] for r in results])
    assert [r.token_ids for r in results] == expected
    assert all(r.metrics["drafts"] > 0 for r in results)


@pytest.mark.parametrize("prompt_len", [5, 20])  # inside and beyond twice the sliding window
def test_drafts_equal_transformers_gemma4_assistant_drafts(gemma4, prompt_len):
    """The same target state gives the same greedy drafts as transformers' own Gemma 4 assistant loop
    (``SinglePositionMultiTokenCandidateGenerator``, right after the target's prefill)."""
    from transformers import DynamicCache, GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    target_path, assistant_path = gemma4
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(assistant_path, dtype=torch.float32).eval()
    prompt = list(range(3, 3 + prompt_len))
    with torch.no_grad():
        out = target(input_ids=torch.tensor([prompt]), cache=DynamicCache(config=target.config), use_cache=True,
                     output_hidden_states=True, return_shared_kv_states=True)
    committed = [*prompt, int(out.logits[0, -1].argmax())]
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                           GenerationConfig(max_length=100))
    generator.num_assistant_tokens = 4
    candidates, _ = generator.get_candidates(input_ids=torch.tensor([committed]), model_kwargs={}, model_outputs=out,
                                             is_first_iteration=False, n_last_matches=0)
    drafter = drafter_for(target_path, assistant_path)
    lm = CachedLM(target)
    _, hidden = lm.feed(prompt, want_hidden=True)
    kv = lm.new_rows(drafter.capabilities.needs_kv_layers, len(prompt), len(prompt))
    params = GenerationParams.from_dict({"max_new_tokens": 10, "eos_token_ids": []})
    session = drafter.open_session(committed, len(prompt), params, {"hidden": hidden, **kv})
    assert session.propose(4) == 4
    assert session.chain_tokens == candidates[0, len(committed):].tolist()


def _held(cache_layer) -> torch.Tensor:
    return torch.stack([cache_layer.keys[0], cache_layer.values[0]])


def test_drafter_rows_equal_the_target_cache_after_partial_acceptance(gemma4):
    """Drive a verifier session and a drafter session by hand: drafts of which only a prefix is right, round after
    round past the sliding window; the drafter's rows must be exactly the target cache's committed rows."""
    target_path, assistant_path = gemma4
    drafter = drafter_for(target_path, assistant_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    prompt = [5, 17, 33, 2, 60, 8]
    params = GenerationParams.from_dict({"max_new_tokens": 40, "eos_token_ids": []})
    session = Session(1, DynamicBackend(model), drafter.tokenizer, prompt, params, b"c", 1)
    layers = drafter.capabilities.needs_kv_layers
    hidden, kv = session.prefill(True, layers)
    draft = drafter.open_session(list(session.tokens), len(prompt), params, {"hidden": hidden, **kv})
    reference = reference_greedy(target_path, prompt, 40)
    window = drafter.sliding_window
    rounds = 0
    while len(session.generated) < 30:
        done = len(session.generated)
        right = 1 + rounds % 3  # a prefix of right tokens, then a wrong one
        block = [*reference[done : done + right], (reference[done + right] + 1) % 150]
        result = session.verify(block, None, True, layers)
        assert result.accepted == right and len(result.tokens) == right + 1
        draft.observe_commit(result.tokens, {"hidden": result.hidden, **result.kv})
        cache = session.lm.cache
        assert draft.kv_end == dict.fromkeys(draft.kv, len(session.tokens) - 1)
        assert session.lm.length == len(session.tokens) - 1
        full = draft.kv["full_attention"]
        assert full.shape[2] == len(session.tokens) - 1  # every committed position but the pending one, no more
        assert torch.equal(full, _held(cache.layers[1]))
        sliding = _held(cache.layers[0])
        assert sliding.shape[2] == min(window - 1, session.lm.length)
        assert torch.equal(draft.kv["sliding_attention"][:, :, -sliding.shape[2]:], sliding)
        assert torch.equal(draft.hidden, result.hidden[-1])
        assert draft.propose(2) == 2  # drafting works from the fresh state
        rounds += 1
    assert session.generated == reference[: len(session.generated)]


def test_a_target_that_is_not_gemma4_is_a_clear_error(gemma4, tiny):
    _, assistant = gemma4
    llama = tiny("llama")
    with pytest.raises(ConfigError, match=r"verifier\.model: the target \(llama\) provides no shared K/V states"):
        load_config(mtp_config(llama, assistant))
    with pytest.raises(MTPDrafterError, match="provides no shared K/V states"):
        AssistantMTPDrafter(DrafterConfig(type="mtp_drafter", model=str(assistant), target_model=str(llama),
                                          dtype="float32"))
    with pytest.raises(ConfigError, match=r"drafter\.model: a 'llama' checkpoint is not a Gemma 4 assistant"):
        load_config(mtp_config(gemma4[0], llama))


def test_verifier_refuses_kv_layers_the_target_cannot_provide(gemma4, tiny):
    model = AutoModelForCausalLM.from_pretrained(gemma4[0], dtype=torch.float32)
    CachedLM(model).check_kv_layers([0, 1])
    with pytest.raises(KVRowsError, match="reuses another layer"):
        CachedLM(model).check_kv_layers([3])
    llama = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32)
    with pytest.raises(KVRowsError, match="does not exist"):
        CachedLM(llama).check_kv_layers([5])


def test_split_state_cuts_rows_by_position_and_reassembles():
    end = 30
    tensors = {"hidden": torch.randn(29, 8), "kv.0": torch.randn(2, 2, 9, 4), "kv.1": torch.randn(2, 2, 29, 4)}
    pieces = split_state(tensors, end, budget=5 * (8 + 2 * 2 * 4 * 2) * 4)
    assert [e for e, _ in pieces] == [6, 11, 16, 21, 26, 30]
    for name, t in tensors.items():
        axis = 2 if name.startswith("kv.") else 0
        assert torch.equal(torch.cat([p[name] for _, p in pieces if name in p], dim=axis), t)
    assert "kv.0" not in pieces[0][1] and pieces[-1][1]["kv.0"].shape[2] == 4  # rows end at `end` for every tensor


def test_long_prompt_state_arrives_in_pieces(gemma4):
    """A prompt whose state exceeds the message cap: session_start goes without it and ``state`` pieces follow; the
    drafter still drafts and the output is transformers' own."""
    target, assistant = gemma4
    prompt = [(7 * i) % 200 + 2 for i in range(40)]  # 39 positions × 768 bytes of state > 3/4 of the 16 KiB cap
    expected = reference_greedy(target, prompt, 12)
    config = mtp_config(target, assistant, num_draft_tokens=3)
    config["verifier"]["max_message_bytes"] = 16384

    async def main():
        async with cluster(config) as client:
            return await client.generate(token_ids=prompt, max_new_tokens=12, eos_token_ids=[])

    result = asyncio.run(main())
    assert result.token_ids == expected
    assert result.metrics["drafts"] > 0


def test_a_drafter_joining_mid_request_waits_for_the_state_then_drafts(gemma4):
    """A (re)connected drafter learns a live session from the rows the verifier's cache holds (no hidden state):
    it proposes nothing until the next commit completes its state, then its rows match the cache."""
    target_path, assistant_path = gemma4
    drafter = drafter_for(target_path, assistant_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    prompt = list(range(3, 23))
    params = GenerationParams.from_dict({"max_new_tokens": 10, "eos_token_ids": []})
    session = Session(1, DynamicBackend(model), drafter.tokenizer, prompt, params, b"c", 1)
    layers = drafter.capabilities.needs_kv_layers
    session.prefill(True, layers)
    session.verify([], None, True, layers)
    draft = drafter.open_session(list(session.tokens), len(prompt), params, session.lm.held_rows(layers))
    assert draft.propose(3) == 0
    result = session.verify([], None, True, layers)
    draft.observe_commit(result.tokens, {"hidden": result.hidden, **result.kv})
    assert draft.propose(3) == 3
    assert torch.equal(draft.kv["full_attention"], _held(session.lm.cache.layers[1]))
    sliding = _held(session.lm.cache.layers[0])
    assert torch.equal(draft.kv["sliding_attention"][:, :, -sliding.shape[2]:], sliding)


def test_a_commit_that_confirms_the_chain_keeps_its_continuation(gemma4, monkeypatch):
    """Overlap's pre-draft hit: a commit equal to the chain's start keeps the rest of the chain and continues it
    from the assistant's own state; a commit that differs re-anchors on the target's fresh hidden state."""
    target_path, assistant_path = gemma4
    drafter = drafter_for(target_path, assistant_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    layers = drafter.capabilities.needs_kv_layers
    prompt = [5, 17, 33, 2, 60, 8]
    lm = CachedLM(model)
    _, hidden = lm.feed(prompt[:-1], want_hidden=True)
    kv = lm.new_rows(layers, len(prompt) - 1, len(prompt) - 1)
    lm.crop(len(prompt) - 1)
    params = GenerationParams.from_dict({"max_new_tokens": 20, "eos_token_ids": []})
    draft = drafter.open_session(prompt, len(prompt), params, {"hidden": hidden, **kv})
    positions = []
    step = drafter.step
    monkeypatch.setattr(drafter, "step", lambda *a: positions.append(a[2]) or step(*a))
    assert draft.propose(3) == 3
    chain = draft.chain_tokens
    # The state a verifier would send had the target committed the chain's first two tokens.
    _, hidden = lm.feed([prompt[-1], chain[0]], want_hidden=True)
    kv = lm.new_rows(layers, 2, 2)
    assert draft.observe_commit(chain[:2], {"hidden": hidden, **kv}) == 2
    assert draft.chain_tokens == chain[2:] and len(draft.cursors) == 1 and draft.ready()
    assert draft.propose(1) == 1
    assert positions == [len(prompt) - 1] * 4  # continued at the anchor's position
    # A commit that the chain did not predict: re-anchor at the new committed length.
    _, hidden = lm.feed([chain[1]], want_hidden=True)
    kv = lm.new_rows(layers, 1, 1)
    wrong = (draft.chain_tokens[0] + 1) % 150
    assert draft.observe_commit([wrong], {"hidden": hidden, **kv}) == 0
    assert draft.chain == [] and draft.cursors == [] and draft.ready()
    assert draft.propose(1) == 1
    assert positions[-1] == len(draft.committed) - 1


@pytest.fixture(scope="module")
def agreeing_gemma4(gemma4, tokenizer_dir, tmp_path_factory):
    """A Gemma 4 target whose layers add nothing to the residual stream (its next token is a function of the last
    token alone) and an assistant built to compute the same function from the target's embedding: its drafts are
    the target's own greedy tokens, so blocks are accepted whole (every committed row streamed, chains kept)."""
    root = tmp_path_factory.mktemp("agreeing")
    target = AutoModelForCausalLM.from_pretrained(gemma4[0], dtype=torch.float32)
    from transformers import AutoTokenizer, Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    from testkit.tiny_models import gemma4_text_config

    text = gemma4_text_config(target.config.vocab_size, 64, ["sliding_attention", "full_attention"],
                              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    assistant = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, tie_word_embeddings=False))
    with torch.no_grad():
        for model in (target, assistant):
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")):
                    param.zero_()
        assistant.pre_projection.weight.copy_(torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1))
        assistant.lm_head.weight.copy_(target.lm_head.weight)
    folders = root / "target", root / "assistant"
    for model, folder in zip((target, assistant), folders):
        model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folders[0])
    return folders


def test_mtp_drafter_greedy_with_accepted_blocks_matches_transformers(agreeing_gemma4):
    target, assistant = agreeing_gemma4
    expected = [reference_greedy(target, p, 30) for p in PROMPTS]

    async def main():
        async with cluster(mtp_config(target, assistant, num_draft_tokens=3)) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=30, eos_token_ids=[])
                                          for p in PROMPTS))

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == expected
    metrics = [r.metrics for r in results]
    print("acceptance", [round(m["acceptance_rate"], 2) for m in metrics], "pre-draft hits",
          [m["predraft_hits"] for m in metrics], "bytes/round", [round(m["bytes_per_round"]) for m in metrics])
    assert all(m["acceptance_rate"] > 0.9 for m in metrics), [m["acceptance_rate"] for m in metrics]
    # (Pre-draft hits depend on timing here — the tiny target verifies as fast as the drafter drafts — so they are
    # checked deterministically in test_a_commit_that_confirms_the_chain_keeps_its_continuation.)
