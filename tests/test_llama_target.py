"""The llama.cpp target backend (``verifier.backend: llama_cpp``, shared/llama_target.py).

In process (``unit``): on a tiny Qwen2 written as a float32 GGUF, rows of several sessions in one forward give each
the logits of its own chain; a token tree gives every node the logits of its path, and keeping a path (a side branch
too) leaves the sequence as a chain forward of it would; visibilities llama.cpp's sequences cannot express, a token id
past the vocabulary and running out of sequence ids are refused clearly; the loader's facts and tokenizer; a cuda
device without GPU offload and the drafter types that need the target's torch forward are refused at load.

Through real nodes (``cluster``): greedy output equals llama.cpp's own one-token-at-a-time greedy decoding of the
same GGUF (testkit/llama_reference.py: a step where they part must be a near-tie by its logit margin) with the
``gguf`` drafter beside it and concurrent sessions verified in one ``llama_decode``; and with token trees sent by a
hand-played drafter whose right continuation is on a side branch. Sampling (``statistical``): lossless by the
distance test, with the accept-all negative control (tests/sampling_check.py).
"""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
from conftest import hand_played, peer_messages, peer_socket, tiny_config, wait_for_drafter

from shared.llama_engine import LlamaDecodeError, LlamaEngine
from shared.llama_target import LlamaTargetBackend, tree_of
from shared.target import Row
from testkit.llama_reference import batch_noise, greedy_agrees, llama_greedy
from testkit.tiny_gguf import write_qwen2_gguf

#: Logit tolerance between a batched / tree forward and a chain forward of the same tokens (float32 GGUF).
ATOL = 2e-3
#: Near-tie margin of the tiny float32 GGUF: its batched and one-token logits differ by about 1e-5.
TIE = 1e-3
PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def llama_pair(tiny, tmp_path_factory):
    """(target GGUF in a copy of its folder, so its tokenizer files sit beside it; the drafter's GGUF)."""
    root = tmp_path_factory.mktemp("llama-target")
    folder = shutil.copytree(tiny("qwen2", "target"), root / "target")
    target = write_qwen2_gguf(folder, folder / "target.gguf")
    drafter = write_qwen2_gguf(tiny("qwen2", "random"), root / "drafter.gguf")
    return target, drafter


@pytest.fixture()
def backend(llama_pair):
    engine = LlamaEngine(llama_pair[0], n_ctx=1024, n_seq=8, threads=1)
    yield LlamaTargetBackend(engine, capacity=768)
    engine.close()


def chain_logits(backend, ids: list[int]) -> torch.Tensor:
    handle = backend.open()
    try:
        return handle.feed(ids)[0]
    finally:
        handle.close()


def tree_row(handle, pending: int, tokens: list[int], parents: list[int]) -> Row:
    """``verifier_node.tree.tree_row``'s layout, written out: the pending token, then node i at length + depth,
    seeing the held prefix, the pending token and its ancestors."""
    n, length = len(tokens), handle.length
    visible = torch.zeros(n + 1, length + n + 1, dtype=torch.bool)
    visible[:, : length + 1] = True
    depth = [0] * (n + 1)
    for i, parent in enumerate(parents):
        visible[1 + i] = visible[1 + parent] if parent >= 0 else visible[0]
        visible[1 + i, length + 1 + i] = True
        depth[1 + i] = depth[1 + parent] + 1 if parent >= 0 else 1
    return Row(handle, [pending, *tokens], [length + d for d in depth], visible)


@pytest.mark.unit
def test_rows_of_several_sessions_are_their_chains(backend):
    a, b = backend.open(), backend.open()
    outs = backend.feed_rows([Row(a, PROMPTS[0]), Row(b, PROMPTS[1])])
    torch.testing.assert_close(outs[0].logits, chain_logits(backend, PROMPTS[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1].logits, chain_logits(backend, PROMPTS[1]), atol=ATOL, rtol=0)
    assert (a.length, b.length) == (5, 3)
    assert backend.feed_rows([Row(a, [4]), Row(b, [6])], logits=False)[0].logits is None  # prefill: no head rows
    a.crop(3)
    expected = chain_logits(backend, [*PROMPTS[0][:3], 1, 2])[-2:]
    torch.testing.assert_close(a.feed([1, 2])[0], expected, atol=ATOL, rtol=0)
    c = backend.open()
    last = c.feed(PROMPTS[2], last_logits_only=True)[0]  # a prompt's forward: llama.cpp computes one row only
    assert last.shape == (1, backend.engine.n_vocab)
    torch.testing.assert_close(last, chain_logits(backend, PROMPTS[2])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(c.next_logits([*PROMPTS[2], 3]), chain_logits(backend, [*PROMPTS[2], 3])[-1],
                               atol=ATOL, rtol=0)
    a.close(), b.close(), c.close()
    assert backend.engine.free_sequences() == 8


@pytest.mark.unit
@pytest.mark.parametrize("keep", ["side", "first", "none"])
def test_a_tree_gives_each_node_its_paths_logits_and_keeps_a_path(backend, keep):
    """Nodes 0 (10) and 2 (12) under the pending token, 1 (11) under 0, 3 (13) and 4 (14) under 2; batched with
    another session's chain. Keeping 2 → 4 (a side branch: the session's own sequence id held the first leaf),
    0 → 1 (its own), or nothing: the sequence is what a chain forward of the kept tokens leaves, and the borrowed
    sequence ids are back."""
    prompt, pending = PROMPTS[0], 42
    a, b = backend.open(), backend.open()
    backend.feed_rows([Row(a, prompt), Row(b, PROMPTS[1])])
    tokens, parents = [10, 11, 12, 13, 14], [-1, 0, -1, 2, 2]
    outs = backend.feed_rows([tree_row(a, pending, tokens, parents), Row(b, [6])])
    assert backend.engine.free_sequences() == 8 - 2 - 2  # three leaves: two borrowed ids
    paths = {-1: [], 0: [10], 1: [10, 11], 2: [12], 3: [12, 13], 4: [12, 14]}
    for node, path in paths.items():
        torch.testing.assert_close(outs[0].logits[1 + node], chain_logits(backend, [*prompt, pending, *path])[-1],
                                   atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1].logits[0], chain_logits(backend, PROMPTS[1] + [6])[-1], atol=ATOL, rtol=0)
    base = len(prompt)
    nodes = {"side": [2, 4], "first": [0, 1], "none": []}[keep]
    backend.keep_positions(a, base + 1, [base + 1 + i for i in nodes])
    assert a.length == base + 1 + len(nodes) and backend.engine.free_sequences() == 6
    kept = [tokens[i] for i in nodes]
    torch.testing.assert_close(a.feed([7, 7])[0], chain_logits(backend, [*prompt, pending, *kept, 7, 7])[-2:],
                               atol=ATOL, rtol=0)
    a.close(), b.close()


@pytest.mark.unit
def test_a_crop_after_a_tree_keeps_a_path_from_its_root(backend):
    a = backend.open()
    a.feed(PROMPTS[0])
    backend.feed_rows([tree_row(a, 42, [10, 11, 12], [-1, 0, -1])])
    a.crop(len(PROMPTS[0]) + 1)  # the pending token only
    assert backend.engine.free_sequences() == 7 and a.tree is None
    torch.testing.assert_close(a.feed([3])[0], chain_logits(backend, PROMPTS[0] + [42, 3])[-1:], atol=ATOL, rtol=0)
    backend.feed_rows([tree_row(a, 5, [10, 11, 12], [-1, 0, -1])])
    with pytest.raises(ValueError, match="path"):
        a.keep_positions(a.length - 4, [a.length - 3, a.length - 1])  # node 0 and node 2: not a path
    a.close()


@pytest.mark.unit
def test_what_llama_cpp_sequences_cannot_express_is_refused(backend):
    a = backend.open()
    a.feed(PROMPTS[0])
    row = tree_row(a, 42, [10, 11], [-1, 0])
    assert tree_of(row)[0] == [-1, 0, 1]
    blind = tree_row(a, 42, [10, 11], [-1, 0])
    blind.visible[2, 0] = False  # a token that does not see the whole prefix
    with pytest.raises(ValueError, match="whole held prefix"):
        backend.feed_rows([blind])
    skewed = tree_row(a, 42, [10, 11, 12], [-1, 0, 1])
    skewed.visible[3, a.length + 1] = False  # sees its parent but not its grandparent
    with pytest.raises(ValueError, match="exactly its ancestors"):
        backend.feed_rows([skewed])
    moved = tree_row(a, 42, [10], [-1])
    moved.positions[1] += 1
    with pytest.raises(ValueError, match="depth"):
        backend.feed_rows([moved])
    with pytest.raises(ValueError, match="past the GGUF's vocabulary"):
        a.feed([backend.engine.n_vocab])
    assert a.length == len(PROMPTS[0]) and backend.engine.free_sequences() == 7  # nothing was fed or borrowed
    a.close()


@pytest.mark.unit
def test_a_tree_wider_than_the_free_sequence_ids_fails_cleanly(llama_pair):
    engine = LlamaEngine(llama_pair[0], n_ctx=256, n_seq=2, threads=1)
    backend = LlamaTargetBackend(engine, capacity=128)
    try:
        a = backend.open()
        a.feed(PROMPTS[0])
        with pytest.raises(LlamaDecodeError, match="sequence ids"):
            backend.feed_rows([tree_row(a, 42, [10, 11, 12], [-1, -1, -1])])  # three leaves, one id to borrow
        assert engine.free_sequences() == 1 and a.length == len(PROMPTS[0])
        torch.testing.assert_close(a.feed([42])[0], chain_logits(backend, PROMPTS[0] + [42])[-1:], atol=ATOL, rtol=0)
    finally:
        engine.close()


def verifier_section(model: str, **keys):
    from runtime.config import load_typed

    config = tiny_config_for(model, **keys)
    return load_typed(config).verifier


def tiny_config_for(model: str, drafter: str | None = None, **verifier_keys) -> dict:
    return {"verifier": {"model": model, "backend": "llama_cpp", "threads": 1, "profile_s": 0, "kv_slots": 2,
                         "kv_slot_tokens": 256, **verifier_keys},
            "drafter": {"type": "prompt_lookup"} if drafter is None else {"type": "gguf", "model": drafter}}


@pytest.mark.unit
def test_the_loader_makes_a_target_of_the_gguf(llama_pair):
    from transformers import AutoTokenizer

    from shared.target import TargetOptions, load_target

    target_gguf, _ = llama_pair
    target = load_target(verifier_section(str(target_gguf)), TargetOptions([1]))
    try:
        assert target.kind == "llama.cpp" and target.dtype == "f32" and target.device == "cpu"
        assert target.vocab_size == target.backend.engine.n_vocab
        assert target.backend.capacity_tokens() == 2 * 256
        assert target.backend.can_batch() and target.open().trees
        folder_tokenizer = AutoTokenizer.from_pretrained(target_gguf.parent)
        assert target.tokenizer("hello world")["input_ids"] == folder_tokenizer("hello world")["input_ids"]
        assert target.end_token_ids and all(0 <= t < target.vocab_size for t in target.end_token_ids)
    finally:
        target.backend.engine.close()


@pytest.mark.unit
def test_a_tokenizer_that_does_not_match_the_gguf_is_refused(llama_pair, tmp_path):
    from shared.models import ModelLoadError, vocab_tokens
    from shared.target import TargetOptions, load_target

    target_gguf, _ = llama_pair
    folder = shutil.copytree(target_gguf.parent, tmp_path / "swapped", ignore=shutil.ignore_patterns("*.gguf"))
    from transformers import AutoTokenizer

    tokens = vocab_tokens(AutoTokenizer.from_pretrained(folder))[:258]
    tokens[10], tokens[11] = tokens[11], tokens[10]
    wrong = write_qwen2_gguf(folder, folder / "wrong.gguf", vocab_tokens=tokens)
    with pytest.raises(ModelLoadError, match=r"does not map onto wrong\.gguf"):
        load_target(verifier_section(str(wrong)), TargetOptions([1]))


@pytest.mark.unit
def test_cuda_without_gpu_offload_is_refused_clearly(llama_pair, monkeypatch):
    import llama_cpp

    from shared.llama_engine import gpu_offload_problem

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert "without GPU offload" in gpu_offload_problem("cuda")
    assert gpu_offload_problem("cpu") is None
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    assert gpu_offload_problem("cuda:0") is None


@pytest.mark.unit
@pytest.mark.parametrize("change, key, words", [
    ({"drafter": {"type": "mtp"}}, "drafter.type", "hidden states"),
    ({"drafter": {"type": "early_exit", "assistant_early_exit": 1}}, "drafter.type", "first layers"),
    ({"verifier": {"device": "mps"}}, "verifier.device", "cpu or cuda"),
    ({"verifier": {"model": "FOLDER"}}, "verifier.model", "GGUF"),
])
def test_a_config_llama_cpp_cannot_serve_is_refused(llama_pair, change, key, words):
    from runtime.config import ConfigError, load_config

    target_gguf, _ = llama_pair
    config = tiny_config_for(str(target_gguf))
    for section, values in change.items():
        config[section].update({k: str(target_gguf.parent) if v == "FOLDER" else v for k, v in values.items()})
    with pytest.raises(ConfigError, match=f"^{key}: ") as info:
        load_config(config)
    assert words in str(info.value)


@pytest.mark.unit
def test_a_llama_cpp_drafter_backend_is_refused(tiny):
    from runtime.config import ConfigError, load_config

    target = str(tiny("qwen2", "target"))
    with pytest.raises(ConfigError, match=r"^drafter\.backend: .*drafter\.type: gguf"):
        load_config({"verifier": {"model": target}, "drafter": {"type": "assistant", "model": target,
                                                                "backend": "llama_cpp"}})


@pytest.mark.unit
def test_the_reference_is_llama_cpps_greedy_and_tells_ties_apart(llama_pair, tiny):
    """The reference itself: llama.cpp's one-token greedy decoding of the float32 GGUF is transformers' greedy on
    the same weights here; greedy_agrees passes equal outputs and a parting on a near-tie only."""
    from testkit.tiny_models import reference_greedy

    ref = llama_greedy(llama_pair[0], PROMPTS[0], 16)
    assert ref.tokens == reference_greedy(tiny("qwen2", "target"), PROMPTS[0], 16)
    assert greedy_agrees(ref.tokens, ref, TIE)[0]
    wrong = list(ref.tokens)
    wrong[3] = (wrong[3] + 1) % 200
    ok, why = greedy_agrees(wrong, ref, tie=min(ref.margins[3], 1.0) / 2)
    assert not ok and "token 3" in why
    assert greedy_agrees(wrong, ref, tie=ref.margins[3] * 2)[0]  # the same parting, called a near-tie
    assert not greedy_agrees(ref.tokens[:-1], ref, TIE)[0]


# ---------------------------------------------------------------------------------------------- real nodes
def llama_config(target_gguf, drafter: dict) -> dict:
    config = tiny_config(target_gguf.parent, None)
    config["verifier"].update(model=str(target_gguf), backend="llama_cpp")
    config["drafter"].update(drafter)
    return config


def run(config, prompts, n: int, **params):
    from runtime.launch import cluster

    async def main():
        async with cluster(config) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[], **params)
                                          for p in prompts))

    return asyncio.run(main())


@pytest.mark.cluster
def test_greedy_output_is_llama_cpps_own_with_the_gguf_drafter(llama_pair):
    target_gguf, drafter_gguf = llama_pair
    config = llama_config(target_gguf, {"type": "gguf", "model": str(drafter_gguf), "num_draft_tokens": 4})
    results = run(config, PROMPTS, 24)
    for prompt, result in zip(PROMPTS, results):
        ok, why = greedy_agrees(result.token_ids, llama_greedy(target_gguf, prompt, 24), TIE)
        assert ok, f"prompt {prompt}: {why}"
    assert sum(r.metrics["drafts"] for r in results) > 0, "the gguf drafter never contributed a block"
    assert max(r.metrics["verify_batch_mean"] for r in results) > 1.0, "no two sessions shared a llama_decode"


async def tree_peer(endpoint: str, tok_id: str, expected: dict[tuple[int, ...], list[int]],
                    stop: asyncio.Event) -> int:
    """A drafter played by hand that sends, every round of every session, a tree whose right continuation is on a
    side branch: a wrong first root, then the right token with the right next one and a wrong sibling under it.
    ``expected``: each prompt's reference output after it, by prompt."""
    from shared.protocol import Capabilities, Commit, Draft, Hello, SessionStart, encode

    trees, known = 0, {}
    async with peer_socket(endpoint) as sock:
        await sock.send_multipart(encode(Hello(drafter_type="hand", tokenizer_id=tok_id,
                                               capabilities=Capabilities())))
        async for msg in peer_messages(sock, stop):
            if isinstance(msg, SessionStart):
                sid, base = msg.session, len(msg.token_ids)
                known[sid] = expected[tuple(msg.token_ids)]
            elif isinstance(msg, Commit) and msg.session in known:
                sid, base = msg.session, msg.base_len + len(msg.tokens)
            else:
                continue
            right = known[sid][base : base + 2]
            if len(right) < 2:
                continue
            wrong = [(t + 1) % 200 for t in right]
            tokens, parents = [wrong[0], right[0], right[1], wrong[1]], [-1, -1, 1, 1]
            await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=tokens,
                                                   parents=parents)))
            trees += 1
    return trees


@pytest.mark.cluster
def test_token_trees_keep_a_side_branch_and_stay_exact(llama_pair):
    """Two sessions at once, so tree rows also share a llama_decode."""
    from runtime.launch import cluster

    target_gguf, _ = llama_pair
    config, tok_id = hand_played(target_gguf.parent)
    config["verifier"].update(model=str(target_gguf), backend="llama_cpp")
    prompts, n = PROMPTS[:2], 20
    refs = [llama_greedy(target_gguf, p, n) for p in prompts]
    expected = {tuple(p): p + ref.tokens for p, ref in zip(prompts, refs)}

    async def main():
        async with cluster(config) as client:
            stop = asyncio.Event()
            peer = asyncio.create_task(tree_peer(client.config["verifier"]["endpoint"], tok_id, expected, stop))
            await wait_for_drafter(client)
            results = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[])
                                             for p in prompts))
            stop.set()
            return results, await peer

    results, trees = asyncio.run(main())
    for result, ref in zip(results, refs):
        ok, why = greedy_agrees(result.token_ids, ref, TIE)
        assert ok, why
        assert result.metrics["tree_rounds"] > 0
        assert result.metrics["accepted_tokens"] > 0, "the side branch was never kept"
    assert trees > 0 and max(r.metrics["verify_batch_mean"] for r in results) > 1.0


@pytest.mark.statistical
def test_sampling_is_lossless_and_the_control_is_caught(tmp_path_factory):
    """The sharpened 12-token target as a GGUF verified by llama.cpp, a different one-layer gguf drafter; the exact
    joint of the first two tokens from llama.cpp's own logits of the same GGUF."""
    from sampling_check import PROMPT, check_lossless_sampling

    from testkit.tiny_models import build_model, build_small_vocab_tokenizer

    root = tmp_path_factory.mktemp("llama-sampling")
    build_small_vocab_tokenizer(root / "tok")
    folder = build_model(root / "target", "qwen2", root / "tok", seed=11, sharpen=1.2)
    target = write_qwen2_gguf(folder, folder / "target.gguf")
    drafter = write_qwen2_gguf(build_model(root / "drafter", "qwen2", root / "tok", seed=12, layers=1, sharpen=1.2),
                               root / "drafter.gguf")
    config = llama_config(target, {"type": "gguf", "model": str(drafter), "num_draft_tokens": 3, "q_top_k": 0})
    check_lossless_sampling(config, llama_joint(target, PROMPT), PROMPT)


def llama_joint(path, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2) of the GGUF's first two sampled tokens after ``prompt``, from llama.cpp's logits."""
    engine = LlamaEngine(path, n_ctx=64, n_seq=1, threads=1)
    try:
        p1 = torch.from_numpy(engine.decode([(0, 0, prompt)])[0]).softmax(-1)
        rows = []
        for x in range(p1.numel()):
            engine.crop(0, len(prompt))
            rows.append(torch.from_numpy(engine.decode([(0, len(prompt), [x])])[0]).softmax(-1))
    finally:
        engine.close()
    joint = p1[:, None] * torch.stack(rows)
    assert np.isclose(float(joint.sum()), 1.0, atol=1e-4)
    return joint


@pytest.mark.slow
def test_the_real_q4_pair_is_llama_cpps_own_greedy():
    """configs/gguf_target.yaml as shipped (the 1.5B's Q4_K_M GGUF verified by llama.cpp, the 0.5B's GGUF drafting),
    two chat prompts at once, against llama.cpp's one-token greedy decoding of the same file; a parting must be a
    near-tie: its reference margin below twice the logit noise between one-token and batched forwards of the
    prompt on this host (testkit.llama_reference.batch_noise; up to 0.76 on the AVX2 host). Blocks of a constant
    length: the cost schedule may plan no drafting at all on a busy machine, and then nothing would be verified."""
    from runtime.launch import cluster
    from shared.models import load_tokenizer
    from shared.named_models import installed_gguf
    from weights import resolve_model

    name, new_tokens = "qwen2.5-coder-1.5b-instruct", 48
    tokenizer = load_tokenizer(resolve_model(name))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in ("Write a Python function is_prime(n).", "Write a Python function that reverses a string.")]

    async def main():
        async with cluster("gguf_target.yaml", overrides={"drafter.draft_schedule": "constant"}) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=new_tokens, eos_token_ids=[])
                                          for p in prompts))

    results = asyncio.run(main())
    path = installed_gguf(name)
    for prompt, result in zip(prompts, results):
        tie = 2 * batch_noise(path, prompt, threads=2)  # this host's batched-vs-one-token logit noise, doubled
        ok, why = greedy_agrees(result.token_ids, llama_greedy(path, prompt, new_tokens, threads=2), tie)
        assert ok, why
    assert sum(r.metrics["drafts"] for r in results) > 0
