"""The benchmark machinery of the benchmarks package on tiny models: the persistent transformers worker answers
like transformers itself, the pass planner packs setups into a memory budget with the reference in every pass, and
the runner interleaves rows prompt by prompt (transformers workers and a real pipespec cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import tiny_config

from benchmarks.passes import ClusterSetup, HFSetup, Row, plan_passes, rotated
from benchmarks.runner import Runner
from benchmarks.summary import tps, vs_anchor
from benchmarks.workers import Worker, WorkerError
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 9, 13, 21, 7], [30, 4, 4, 17], [11, 12, 13]]


def _setup(key: str, target: Path, **kw) -> HFSetup:
    return HFSetup(key, "float32", 1, "cpu", str(target), 0.01, **kw)


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_worker_generates_like_transformers_and_survives_a_bad_request(tiny):
    target, drafter = tiny("llama"), tiny("llama", "random")
    worker = Worker(_setup("w", target))
    try:
        worker.call("ready")
        alone = worker.call("generate", ids=PROMPTS[0], max_new_tokens=12, strategy={"kind": "target"})
        assert alone["token_ids"] == reference_greedy(target, PROMPTS[0], 12, eos=[0])
        assert alone["stats"]["drafts"] == 0
        assisted = worker.call("generate", ids=PROMPTS[0], max_new_tokens=12,
                               strategy={"kind": "assistant", "model": str(drafter)})
        assert assisted["token_ids"] == alone["token_ids"]  # greedy assisted generation is lossless
        assert assisted["stats"]["drafts"] > 0 and assisted["generator"]
        with pytest.raises(WorkerError, match="unknown strategy"):
            worker.call("generate", ids=PROMPTS[0], max_new_tokens=4, strategy={"kind": "nonsense"})
        curve = worker.call("curve", model=str(drafter), sizes=[1, 2, 3], prefix_len=8, budget_s=30.0, repeats=1)
        assert curve["sizes"] == [1, 2, 3] and curve["prefix_len"] == 8
        assert all(s > 0 for s in curve["seconds"])
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_plan_passes_fits_the_budget_and_repeats_the_reference():
    setups = {"a": HFSetup("a", "float32", 1, "cpu", "-", 4.0, curves=[("t", "target", [1])]),
              "b": HFSetup("b", "float32", 2, "cpu", "-", 4.0, curves=[("t", "target", [1])]),
              "c": ClusterSetup("c", "cpu.yaml", {}, {"verifier": 3.0, "drafter": 1.0})}
    rows = {"ref": Row("ref", "ref", "a"),
            "a2": Row("a2", "a2", "a", anchor="ref", models={"drafter": 1.0}),
            "b1": Row("b1", "b1", "b", anchor="ref"),
            "c1": Row("c1", "c1", "c", anchor="ref")}
    # a with its drafter: 0.5 + 4 + 1 = 5.5; b: 4.5; c: 2 × 0.5 + 4 = 5; a with the target only: 4.5
    passes = plan_passes([["ref", "a2"], ["b1"], ["c1"]], rows, setups, budget_gib=10.0)
    assert [p.rows for p in passes] == [["ref", "a2", "b1"], ["c1", "ref"]]
    assert passes[0].owned == {"ref", "a2", "b1"} and passes[1].owned == {"c1"}
    assert passes[0].curves == {"a", "b"} and passes[1].curves == set()  # curves once, where the setup is owned
    assert passes[0].estimated_gib == pytest.approx(10.0) and passes[1].estimated_gib == pytest.approx(9.5)
    assert [p.rows for p in plan_passes([["ref", "a2"], ["b1"], ["c1"]], rows, setups, 100.0)] == [
        ["ref", "a2", "b1", "c1"]]


def test_rotated():
    assert rotated([1, 2, 3], 0) == [1, 2, 3]
    assert rotated([1, 2, 3], 4) == [2, 3, 1]
    assert rotated([], 2) == []


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_runner_interleaves_prompt_by_prompt_and_keeps_partial_results(tiny):
    target, drafter = tiny("llama"), tiny("llama", "random")
    setups = {"w1": _setup("w1", target, curves=[("target", "target", [1, 2])]), "w2": _setup("w2", target),
              "ps": ClusterSetup("ps", tiny_config(target, drafter), {}, {})}
    rows = {"ref": Row("ref", "ref", "w1", strategy={"kind": "target"}),
            "asst": Row("asst", "asst", "w2", strategy={"kind": "assistant", "model": str(drafter)}, anchor="ref"),
            "bad": Row("bad", "bad", "w2", strategy={"kind": "nonsense"}, anchor="ref"),
            "ps": Row("ps", "ps", "ps", anchor="ref")}
    prompts = {"default": [{"ids": ids, "messages": None} for ids in PROMPTS]}
    updates = []
    runner = Runner(rows, setups, prompts, 10, lambda: updates.append(len(runner.raw["ref"]["per_prompt"])),
                    curve_budget_s=30.0, curve_repeats=1)
    passes = plan_passes([["ref"], ["asst", "bad"], ["ps"]], rows, setups, budget_gib=100.0)
    asyncio.run(runner.run(passes))
    raw = runner.raw
    assert "error" in raw["bad"] and raw["bad"]["per_prompt"] == []  # refused at its warm-up; the others went on
    expected = [reference_greedy(target, ids, 10, eos=[0]) for ids in PROMPTS]
    for key in ("ref", "asst", "ps"):
        assert "error" not in raw[key]
        assert [p["token_ids"] for p in raw[key]["per_prompt"]] == expected
    live = ["ref", "asst", "ps"]
    starts = sorted((p["at"], key, i) for key in live for i, p in enumerate(raw[key]["per_prompt"]))
    assert [i for _, _, i in starts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every row on prompt i before prompt i + 1
    assert [[k for _, k, i in starts if i == n] for n in range(3)] == [rotated(live, n) for n in range(3)]
    assert updates[:3] == [1, 2, 3]  # the json callback ran after every prompt
    assert set(runner.curves["w1"]["curves"]) == {"target"} and "w2" not in runner.curves
    assert vs_anchor(runner.state(), "ref", "ref") == 1.0
    assert vs_anchor(runner.state(), "asst", "ref") == pytest.approx(tps(raw["asst"]["per_prompt"])
                                                                     / tps(raw["ref"]["per_prompt"]))
