"""The compiled backend (:class:`shared.backend.CompiledBackend`): a verifier session whose decode steps run the
``torch.compile``d fixed-shape step is token-identical to transformers' ``generate`` (drafts of several lengths, so
several buckets, rejections that crop and continue, forwards too long for any bucket that take the eager path); a
compile failure or a failing step falls back to the eager static path and still matches; sampling through a cluster
on it stays lossless (in CI: ``make test-ci``).

Compiling is the slow part: one backend per model for the whole module, buckets 1, 2 and 4 only."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_config
from sampling_check import check_lossless_sampling, exact_joint
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.backend import CompiledBackend, CompiledHandle, DynamicBackend, StaticBackend, make_backend
from shared.batch import Row
from shared.kv import CachedLM
from shared.sampling import GenerationParams
from testkit.tiny_models import reference_greedy
from verifier_node.session import Session

torch.set_num_threads(1)

BUCKETS = (1, 2, 4)


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def compiled(tiny):
    """``compiled(arch)`` → (folder, model, warmed-up backend), built once per arch for the module."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            folder = tiny(arch)
            model = _load(folder)
            # Llama: attention widths 64 and 96 (its sessions grow past 64: eager there); Qwen2: the whole slot only.
            backend = CompiledBackend(model, slots=2, slot_tokens=96, buckets=BUCKETS,
                                      min_width=64 if arch == "llama" else 96)
            backend.warm_up()
            assert backend.failure is None, backend.failure
            assert sorted(backend.compile_s) == list(BUCKETS)
            made[arch] = (folder, model, backend)
        return made[arch]

    return get


def _greedy_rounds(folder, model, backend, prompt: list[int], new: int = 60) -> tuple[list[int], list[int]]:
    """A session on ``backend`` run round by round with drafts of 0 to 5 tokens, right, half-right and wrong (so
    buckets 1, 2 and 4, the eager path for 6 tokens, and rollbacks); returns (its output, generate's)."""
    truth = reference_greedy(folder, prompt, new)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    s = Session(1, backend, tokenizer, prompt, GenerationParams.from_dict({"eos_token_ids": [], "max_new_tokens": new},
                                                                            160), b"c", 1)
    s.prefill()
    rnd = 0
    while not s.finished:
        right = truth[len(s.generated):]
        size = [0, 1, 3, 5, 2, 4][rnd % 6]
        draft = [right[:size], [*right[: size // 2], 7, 7, 7][:size], [9] * size][rnd % 3]
        plan = s.plan_round(draft, None)
        logits, _ = s.round_forward(plan)
        s.finish_round(plan, logits, None, 0.0)
        rnd += 1
        assert rnd < 3 * new
    s.close()
    return s.generated, truth


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_sessions_equal_generate(compiled, arch, caplog):
    folder, model, backend = compiled(arch)
    before = backend.compiled_steps
    with caplog.at_level(logging.INFO, logger="pipespec.backend"):
        ours, truth = _greedy_rounds(folder, model, backend, _ids(3, 9))
    # Llama's session grew past its first width: those steps ran eagerly, nothing compiled while it waited.
    assert ("no step compiled over 96 positions" in caplog.text) == (arch == "llama")
    assert ours == truth
    assert {w for _, w, _ in backend._compiled} == {backend.widths[0]}
    assert backend.compiled_steps - before >= 15  # the compiled step really served the rounds
    # Logits (not just argmax) agree with a dynamic cache, every bucket, after a crop; a 6-token forward is eager.
    handle, alone = backend.open(), CachedLM(model)
    assert isinstance(handle, CompiledHandle)
    for lm in (handle, alone):
        lm.feed(_ids(4, 13), last_logits_only=True)
    for step, count in enumerate((1, 2, 3, 4, 6, 1)):
        fed = _ids(20 + step, count)
        before = backend.compiled_steps
        a, _ = handle.feed(fed)
        b, _ = alone.feed(fed)
        assert torch.allclose(a, b, atol=1e-4), (count, (a - b).abs().max())
        assert backend.compiled_steps - before == (count <= 4)
        keep = handle.length - count // 2
        handle.crop(keep)
        alone.crop(keep)
    # Batched rows take the static backend's eager path on the same slots.
    other = backend.open()
    other.feed([5, 6, 7])
    outs = backend.feed_rows([Row(handle, [8, 9]), Row(other, [10])])
    assert torch.allclose(outs[0].logits, alone.feed([8, 9])[0], atol=1e-4)
    handle.close()
    other.close()
    assert sorted(backend.free) == [0, 1]


@pytest.mark.compile
def test_no_recompiles_as_the_sequence_grows(compiled):
    """The step's shapes do not depend on the sequence's length or its slot: many decode steps at growing lengths
    in both slots compile nothing new."""
    import torch._dynamo.utils as dynamo_utils

    _, _, backend = compiled("qwen2")
    a, b = backend.open(), backend.open()
    counters = dynamo_utils.counters
    frames = dict(counters["stats"])
    assert frames.get("unique_graphs", 0) >= len(BUCKETS)  # the counter does count this backend's graphs
    for lm in (a, b):
        lm.feed(_ids(5, 3))
    for step in range(20):
        (a if step % 2 else b).feed([3 + step])
    assert dict(counters["stats"]).get("unique_graphs") == frames.get("unique_graphs")
    a.close()
    b.close()


@pytest.mark.compile
def test_a_thread_count_without_graphs_runs_eagerly_and_never_recompiles(compiled, caplog):
    """Dynamo guards on the thread count, and core leases switch a node's forwards between counts: a step at a count
    warm-up did not compile for must run the eager path (it recompiled mid-request before), and warming up at both
    counts serves both from graphs built at start-up."""
    import torch._dynamo.utils as dynamo_utils

    _, model, backend = compiled("qwen2")
    handle, alone = backend.open(), CachedLM(model)
    for lm in (handle, alone):
        lm.feed(_ids(8, 5))
    graphs = dynamo_utils.counters["stats"].get("unique_graphs", 0)
    torch.set_num_threads(2)
    try:
        before = backend.compiled_steps
        with caplog.at_level(logging.INFO, logger="pipespec.backend"):
            a, _ = handle.feed([3])
        assert backend.compiled_steps == before and "at 2 thread(s)" in caplog.text
        assert dynamo_utils.counters["stats"].get("unique_graphs", 0) == graphs
        assert torch.allclose(a, alone.feed([3])[0], atol=1e-4)
        backend.warm_up((1, 2))
        assert backend.thread_counts == (1, 2) and torch.get_num_threads() == 2  # restored after warm-up
        graphs = dynamo_utils.counters["stats"].get("unique_graphs", 0)
        for threads, token in ((2, 4), (1, 5), (2, 6)):
            torch.set_num_threads(threads)
            before = backend.compiled_steps
            a, _ = handle.feed([token])
            assert backend.compiled_steps == before + 1, threads
            assert torch.allclose(a, alone.feed([token])[0], atol=1e-4)
        assert dynamo_utils.counters["stats"].get("unique_graphs", 0) == graphs
    finally:
        torch.set_num_threads(1)
        handle.close()


@pytest.mark.compile
def test_flat_pre_draft_rows_run_the_compiled_step_and_match_a_dynamic_cache(compiled):
    """A drafter's pre-drafted outcome rows (one row of R tokens with its own positions and visibility, as the node
    feeds them through ``backend.feed_rows``) run the compiled step at every depth; their logits equal the same rows
    on a dynamic cache, and the adopted row's cache continues like the dynamic one."""
    from drafter_node.base import DraftToken
    from drafter_node.branches import Branches
    from shared.batch import feed_rows

    _, model, backend = compiled("qwen2")
    committed, block, rows = _ids(9, 7), [11, 12, 13], [(3, 43), (0, 40), (2, 42)]
    handle, alone = backend.open(), CachedLM(model)
    for lm in (handle, alone):
        lm.feed(committed + block)
    ours = Branches(backend, handle, len(committed), block, rows)
    theirs = Branches(DynamicBackend(model), alone, len(committed), block, rows)

    def greedy(logits, contexts):
        return [DraftToken(int(row.argmax())) for row in logits]

    for depth in range(3):
        mine, ref = ours.batch_step(greedy), theirs.batch_step(greedy)
        before = backend.compiled_steps
        got = backend.feed_rows(mine.rows)
        want = feed_rows(model, ref.rows)
        assert backend.compiled_steps == before + 1, depth  # a 3-token row: bucket 4
        gap = (got[0].logits - want[0].logits).abs().max()
        assert torch.allclose(got[0].logits, want[0].logits, atol=1e-4), (depth, gap)
        mine.finish(got)
        ref.finish(want)
    assert [ours.context(i) for i in range(len(rows))] == [theirs.context(i) for i in range(len(rows))]
    ours.adopt(1, handle)
    theirs.adopt(1, alone)
    last = ours.context(1)[-1]
    assert torch.allclose(handle.feed([last])[0], alone.feed([last])[0], atol=1e-4)
    handle.close()


@pytest.mark.unit
def test_a_compile_failure_falls_back_to_the_eager_static_path(tiny, monkeypatch, caplog):
    folder = tiny("llama")
    model = _load(folder)

    def refuse(*args, **kwargs):
        raise RuntimeError("no C compiler here")

    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.INFO, logger="pipespec.backend"):
        backend = make_backend(model, "compiled", slots=2, slot_tokens=96, compiled_tokens=4)
    assert isinstance(backend, CompiledBackend) and backend.failure == "RuntimeError: no C compiler here"
    assert caplog.text.count("torch.compile failed") == 1 and "eager static steps" in backend.describe()
    ours, truth = _greedy_rounds(folder, model, backend, _ids(6, 7), new=20)
    assert ours == truth and backend.compiled_steps == 0
    assert make_backend(model, "auto", slots=2).name == "static"  # auto never picks the compiled step


@pytest.mark.unit
def test_a_step_that_fails_at_run_time_falls_back_and_still_matches(tiny, caplog):
    """A step that compiled at start-up can still fail when a round calls it (inductor, an unsupported op, a CUDA
    graph replay): that must switch the step off with one log line, and the round it happened in must still be
    right."""
    folder = tiny("llama")
    model = _load(folder)
    backend = CompiledBackend(model, slots=1, slot_tokens=96, buckets=BUCKETS)
    calls = []

    def broken(ids, *step_inputs):
        if backend._warming:  # start-up "compiles" every bucket (logits of the right shape; nothing reads them)
            return torch.zeros(1, ids.shape[1], model.config.vocab_size)
        calls.append(ids.shape)
        raise RuntimeError("InductorError: unsupported op")

    backend._step = broken
    backend.warm_up()
    assert backend.failure is None and sorted(backend.compile_s) == list(BUCKETS)
    with caplog.at_level(logging.WARNING, logger="pipespec.backend"):
        ours, truth = _greedy_rounds(folder, model, backend, _ids(7, 5), new=16)
    assert ours == truth and len(calls) == 1 and caplog.text.count("torch.compile failed") == 1
    assert backend.failure.startswith("RuntimeError") and isinstance(backend, StaticBackend)


@pytest.mark.ci  # compiles in the verifier node too; the compiled step's logits are checked above
def test_sampling_on_the_compiled_backend_is_lossless(sharp_pair):
    """The sampling check (tests/sampling_check.py) with the verifier on the compiled backend, one session per
    forward (no batching) so that every round runs the compiled step."""
    target, drafter = sharp_pair
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0)
    config["verifier"].update(backend="compiled", compiled_max_tokens=4, kv_slot_tokens=32, kv_slots=50,
                            batching=False)
    check_lossless_sampling(config, exact_joint(target), wrong={"the drafter's joint": exact_joint(drafter)})
