"""The ``gguf`` drafter type: a GGUF model in llama.cpp drafting for a torch target.

llama.cpp itself is checked first (it loads a tiny Qwen2 written as GGUF and computes what transformers computes
on the same weights, also after cropping its KV cache and across sequences of one batched forward; a build that
crashes is caught in a child process), then the type through real node processes: greedy output identical to
transformers' ``generate`` on the target, and a GGUF whose vocabulary is not the target's refused at connect.
Lossless sampling and the registry-wide refusals are in tests/test_conformance.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_config

from testkit.tiny_gguf import write_qwen2_gguf
from testkit.tiny_models import reference_greedy


@pytest.fixture(scope="module")
def gguf_pair(tiny, tmp_path_factory):
    """(target folder, drafter folder, the drafter as GGUF): tiny Qwen2 models sharing the test tokenizer."""
    folder = tmp_path_factory.mktemp("gguf")
    target = tiny("qwen2", "target")
    drafter = tiny("qwen2", "random")
    return target, drafter, write_qwen2_gguf(drafter, folder / "drafter.gguf")


def hf_logits(folder, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.unit
def test_llama_cpp_computes_what_transformers_computes(gguf_pair):
    """Same weights, same logits (float32, up to rounding): the GGUF writer and the engine's decode are right."""
    from shared.llama_engine import LlamaEngine

    _, drafter, path = gguf_pair
    ids = [5, 17, 33, 2, 60, 7, 9, 100]
    expected = hf_logits(drafter, ids)
    engine = LlamaEngine(path, n_ctx=256, n_seq=2, threads=1)
    try:
        got = engine.decode([(0, 0, ids)], all_logits=True)[0]
        np.testing.assert_allclose(got, expected, atol=2e-3, rtol=1e-3)
        # crop back to 5 positions and feed a different continuation: the dropped K/V must be gone
        engine.crop(0, 5)
        other = [1, 2, 3]
        again = engine.decode([(0, 5, other)], all_logits=True)[0]
        np.testing.assert_allclose(again, hf_logits(drafter, ids[:5] + other)[5:], atol=2e-3, rtol=1e-3)
        # two sequences in one forward: each row sees only its own sequence
        rows = engine.decode([(0, 8, [4]), (1, 0, [9, 8, 7])])
        np.testing.assert_allclose(rows[0], hf_logits(drafter, ids[:5] + other + [4])[-1], atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(rows[1], hf_logits(drafter, [9, 8, 7])[-1], atol=2e-3, rtol=1e-3)
    finally:
        engine.close()


@pytest.mark.unit
def test_the_vocabulary_fingerprint_maps_gguf_ids_onto_the_targets(gguf_pair):
    """A GGUF written from the target's tokenizer maps onto it (the target's tokenizer may have more tokens: the
    test tokenizer adds one past the model's head); one with two tokens swapped does not."""
    from transformers import AutoTokenizer

    from shared.llama_engine import LlamaEngine
    from shared.models import vocab_fingerprint, vocab_prefix_matches, vocab_tokens

    target, _, path = gguf_pair
    tokens = vocab_tokens(AutoTokenizer.from_pretrained(target))
    engine = LlamaEngine(path, n_ctx=64, n_seq=1, threads=1)
    try:
        texts = engine.token_texts()
    finally:
        engine.close()
    assert len(texts) < len(tokens)  # the case worth testing: the target knows a token the drafter does not
    assert vocab_prefix_matches(vocab_fingerprint(texts), tokens)
    swapped = list(texts)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    assert not vocab_prefix_matches(vocab_fingerprint(swapped), tokens)
    assert not vocab_prefix_matches(vocab_fingerprint([*texts, "extra", "more"]), texts)  # longer than the target's
    for hostile in ("vocab:", "vocab:x:y", "vocab:99999999999:00", None, 5, "vocab:0:" + "0" * 32):
        assert not vocab_prefix_matches(hostile, tokens)
    # a padded head: trailing [PAD{i}] entries do not count
    assert vocab_fingerprint([*texts, f"[PAD{len(texts)}]"]) == vocab_fingerprint(texts)


@pytest.mark.unit
def test_a_target_token_the_gguf_lacks_is_fed_as_a_known_one(gguf_pair):
    """The target may commit a token past the GGUF's vocabulary (an added special token): llama.cpp would refuse the
    forward, so the engine feeds its end token there instead (drafts are only proposals)."""
    from shared.llama_engine import LlamaEngine

    _, _, path = gguf_pair
    engine = LlamaEngine(path, n_ctx=64, n_seq=1, threads=1)
    try:
        logits = engine.decode([(0, 0, [5, engine.n_vocab + 3, 7])])[0]
        assert np.isfinite(logits).all()
    finally:
        engine.close()


@pytest.mark.unit
def test_a_full_kv_pool_fails_the_forward_and_keeps_the_sequence(gguf_pair):
    """A forward that does not fit the KV memory raises LlamaDecodeError, and the sequence is as before it."""
    from shared.llama_engine import LlamaDecodeError, LlamaEngine

    _, drafter, path = gguf_pair
    engine = LlamaEngine(path, n_ctx=256, n_seq=1, threads=1)
    try:
        engine.decode([(0, 0, [5, 17, 33])])
        with pytest.raises(LlamaDecodeError, match="KV memory is full"):
            engine.decode([(0, 3, [7] * 300)])
        got = engine.decode([(0, 3, [2, 60])])[0]  # the first three positions are still there, nothing after
        np.testing.assert_allclose(got, hf_logits(drafter, [5, 17, 33, 2, 60])[-1], atol=2e-3, rtol=1e-3)
    finally:
        engine.close()


@pytest.mark.unit
def test_a_session_finding_every_sequence_in_use_drafts_nothing(gguf_pair):
    """Past llama.cpp's sequence limit a session is opened that proposes nothing (its request goes on at the
    target's pace), and a sequence given back is used again."""
    from drafter_node.gguf import GGUFDrafter, GGUFDraftSession, IdleDraftSession
    from drafter_node.settings import DrafterConfig
    from shared.sampling import GenerationParams

    _, _, path = gguf_pair
    drafter = GGUFDrafter(DrafterConfig(type="gguf", model=str(path), kv_slot_tokens=256, kv_slots=1))
    params = GenerationParams(max_new_tokens=8)
    taken = [drafter.engine.acquire() for _ in range(drafter.engine.n_seq)]
    idle = drafter.open_session([5, 17], 2, params, {})
    assert isinstance(idle, IdleDraftSession) and idle.propose(3) == 0
    drafter.engine.release(taken.pop())
    session = drafter.open_session([5, 17], 2, params, {})
    assert isinstance(session, GGUFDraftSession) and session.propose(3) == 3
    session.close()
    drafter.engine.close()


@pytest.mark.unit
def test_the_start_up_profile_measures_llama_cpp_and_is_cached(gguf_pair, monkeypatch):
    """The node's start-up profile of a gguf drafter: llama.cpp forwards at each planned thread count, in a profile
    the verifier accepts (dtype "gguf"), read from the disk cache at the next start when it was measured on a quiet
    machine, and measured again when it was not. (Whether the machine is quiet is set here: the test session's
    own processes, a node zygote warming up, would otherwise decide it.)"""
    import shared.costs.measure as measure
    from drafter_node.gguf import GGUFDrafter
    from drafter_node.settings import DrafterConfig
    from shared.costs.curve import NodeProfile
    from shared.models import ProfileSpec

    _, _, path = gguf_pair
    drafter = GGUFDrafter(DrafterConfig(type="gguf", model=str(path), kv_slot_tokens=256, kv_slots=1))
    lines: list[str] = []
    try:
        monkeypatch.setattr(measure, "others_cores", lambda *args: 2.0)  # busy: measured twice, not trusted
        busy = drafter.measure_profile(ProfileSpec([1], [1, 2], 2.0, ""), lines.append)
        assert busy is not None and not busy.quiet
        assert any("measuring again" in line for line in lines)
        again = drafter.measure_profile(ProfileSpec([1], [1, 2], 2.0, ""), lines.append)
        assert again is not None and not again.cached  # a busy profile is measured again at the next start

        monkeypatch.setattr(measure, "others_cores", lambda *args: 0.0)  # quiet
        spec = ProfileSpec([1, 2], [1, 2, 4], 4.0, "")
        profile = drafter.measure_profile(spec, lines.append)
        assert profile is not None and profile.dtype == "gguf" and sorted(profile.curves) == [1, 2]
        assert profile.quiet and not profile.cached
        assert profile.curves[1].sizes[0] == 1 and all(s > 0 for s in profile.curves[1].seconds)
        assert NodeProfile.from_dict(profile.to_dict()).dtype == "gguf"  # what the verifier validates
        again = drafter.measure_profile(spec, lines.append)
        assert again is not None and again.cached and again.curves[1].seconds == profile.curves[1].seconds
        assert any("cached" in line for line in lines)
        assert drafter.engine.acquire() == 0  # the measuring sequence was given back
    finally:
        drafter.engine.close()


@pytest.mark.process
def test_a_crashing_llama_cpp_build_is_caught(gguf_pair):
    """The installed llama.cpp runs a forward in a child process: a build whose CPU code this machine cannot run
    (a native AMX build on a KVM guest died with a general protection fault) fails here, not in a drafter node."""
    _, _, path = gguf_pair
    probe = subprocess.run([sys.executable, "-m", "drafter_node.gguf", "--check", str(path)],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, f"llama.cpp probe failed ({probe.returncode}): {probe.stderr[-2000:]}"
    assert "forward ok" in probe.stdout


@pytest.mark.unit
def test_the_check_reports_a_crash_with_its_signal(tmp_path):
    """The probe's parent names the signal and what to do when the child dies (a child that segfaults on purpose)."""
    from drafter_node.gguf import run_probe

    ok, message = run_probe([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert not ok
    assert "SIGSEGV" in message and "make setup-gguf" in message


@pytest.mark.cluster
def test_greedy_output_is_the_targets(gguf_pair):
    """Real nodes: the GGUF drafter's blocks are verified by the torch target; output = transformers' generate, with
    concurrent sessions drafted in batched llama.cpp forwards."""
    from runtime.launch import cluster

    target, _, path = gguf_pair
    prompts = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8], [9, 8, 7, 6]]
    expected = [reference_greedy(target, p, 24) for p in prompts]
    config = tiny_config(target, None, type="gguf", num_draft_tokens=4)
    config["drafter"]["model"] = str(path)

    async def main():
        async with cluster(config) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=24, eos_token_ids=[])
                                          for p in prompts))

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == expected
    assert results[0].metrics["drafts"] > 0, "the gguf drafter never contributed a block"
    # four sessions at once: some drafter steps ran as one llama_decode over several sequences
    assert max(r.metrics["draft_batch_mean"] for r in results) > 1.0


@pytest.mark.cluster
def test_a_gguf_with_another_vocabulary_is_refused_at_connect(gguf_pair, tmp_path):
    """The verifier refuses a GGUF whose token ids do not map onto its tokenizer's, with the reason."""
    from transformers import AutoTokenizer

    from runtime.launch import LaunchError, cluster
    from shared.models import vocab_tokens

    target, drafter, _ = gguf_pair
    tokens = vocab_tokens(AutoTokenizer.from_pretrained(target))[:258]  # the head's width (the writer pads past it)
    tokens[10], tokens[11] = tokens[11], tokens[10]
    wrong = write_qwen2_gguf(drafter, tmp_path / "wrong.gguf", vocab_tokens=tokens)
    config = tiny_config(target, None, type="gguf")
    config["drafter"]["model"] = str(wrong)
    config["launch"]["ready_timeout_s"] = 180  # the node probes the GGUF in a child before loading it (busy host)

    async def main():
        async with cluster(config):
            pass

    with pytest.raises(LaunchError, match="tokenizer"):
        asyncio.run(main())
