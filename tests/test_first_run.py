"""The first run's words: the start-up lines (what each node chose, the measured costs, the plan the drafter's cost
model implies) and the end-of-run summary, on real node processes with fixed cost curves — a run where speculation
pays and one where it cannot — each checked against what the run then did."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import tiny_config
from node_entry import costs_entry

from runtime.first_run import run_summary, startup_lines
from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPT = [5, 17, 33, 2, 60]
# A verifier whose forward costs about the same for 1 and 9 tokens, a cheap drafter: drafting pays.
FLAT = json.dumps({"verify": {"1": 0.010, "9": 0.012, "17": 0.014}, "draft": {"1": 0.001, "17": 0.004}})
# A verifier whose cost grows with every token (emulated bf16 on a CPU): drafting cannot pay, whatever α.
LINEAR = json.dumps({"verify": {"1": 0.010, "17": 0.170}, "draft": {"1": 0.003, "17": 0.05}})


def run_one(config, spec: str, n: int):
    async def main():
        async with cluster(config, entry=costs_entry(spec)) as client:
            result = await client.generate(token_ids=PROMPT, max_new_tokens=n, eos_token_ids=[])
            return client.startup, result
    return asyncio.run(main())


def test_a_run_where_speculation_pays_says_so_and_speculates(tiny):
    target = tiny("llama", "target")
    config = tiny_config(target, target, num_draft_tokens=4, draft_schedule="cost", max_draft_tokens=8)
    pong, result = run_one(config, FLAT, 40)
    assert result.token_ids == reference_greedy(target, PROMPT, 40)
    (report,) = pong["reports"]
    assert report["decision"] == "pays" and report["k"] >= 1 and report["speedup"] > 1.0
    assert report["drafter"] == pong["drafters"][0]["id"]
    assert report["verify_1_s"] == pytest.approx(0.010) and report["draft_s"] == pytest.approx(0.001)
    lines = startup_lines(pong)
    assert lines[0] == "verifier: float32 (not profiled), 1 thread"
    assert lines[1].startswith("drafter: float32 (")
    assert "1 thread" in lines[1]
    assert lines[2].startswith("plan: speculation pays here: ")
    assert f"k = {report['k']}, expected {report['speedup']:.1f}× the target alone" in lines[2]
    assert "draft step 1.0 ms, verify 1 token 10 ms" in lines[2]
    m = result.metrics
    assert m["draft_tokens"] > 0 and m["accepted_tokens"] == m["draft_tokens"]  # the drafter is the target
    summary = run_summary(m, pong["reports"])
    assert summary.startswith(f"speculated: {m['accepted_tokens']} of 40 tokens from drafts, acceptance 1.00")
    assert f"{report['speedup']:.1f}× the target alone expected" in summary
    assert "the target alone: 100.00 tok/s" in summary  # 1 / verify 1 token
    # the ceiling: every draft accepted, a flat verifier and a 1 ms drafter allow far more than the target alone
    assert m["ceiling_tokens_per_second"] > 300
    assert m["ceiling_fraction"] == pytest.approx(m["decode_tokens_per_second"] / m["ceiling_tokens_per_second"])
    assert f"% of the ceiling {m['ceiling_tokens_per_second']:.2f} tok/s" in summary


def test_a_run_where_speculation_cannot_pay_says_so_and_drafts_nothing(tiny):
    target = tiny("llama", "target")
    config = tiny_config(target, target, num_draft_tokens=4, draft_schedule="cost", threads="auto")
    pong, result = run_one(config, LINEAR, 30)
    assert result.token_ids == reference_greedy(target, PROMPT, 30)
    (report,) = pong["reports"]
    assert report["decision"] == "cannot_pay" and report["k"] == 0 and report["speedup"] == 1.0
    lines = startup_lines(pong)
    assert lines[-1].startswith("plan: speculation cannot pay on this hardware: running the target alone, "
                                "expected 1.0×")
    assert "draft step 3.0 ms, verify 1 token 10 ms" in lines[-1]
    m = result.metrics
    assert m["draft_tokens"] == 0 and m["solo_rounds"] > 0  # what it said: no drafting at all
    # where drafting cannot pay, the ceiling is the target alone's measured rate
    assert m["ceiling_tokens_per_second"] is None or m["ceiling_tokens_per_second"] == pytest.approx(100.0, rel=0.2)
    summary = run_summary(m, pong["reports"])
    assert summary.startswith("target alone for all 30 tokens: the cost model found speculation cannot pay "
                              "(draft step 3.0 ms, verify 1 token 10 ms")
