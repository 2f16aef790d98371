"""benchmarks/concurrency.py: its helpers (percentiles, ratios, pong deltas, a level's summary), transformers'
left-padded batched generate against unpadded greedy decoding, and one end-to-end run on a small random pair
(``--random``, float32) whose pipespec rows must match transformers' batched row token for token."""

from __future__ import annotations

import json

import pytest

import benchmarks.concurrency as bc
from benchmarks.workers import generate_batch
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

# ---------------------------------------------------------------------------------------------- helpers


def test_percentile_interpolates_between_ranks_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bc.percentile(xs, 0) == 1.0
    assert bc.percentile(xs, 100) == 4.0
    assert bc.percentile(xs, 50) == pytest.approx(2.5)
    assert bc.percentile(xs, 95) == pytest.approx(3.85)  # numpy.percentile([1, 2, 3, 4], 95)
    assert bc.percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert bc.percentile([7.0], 95) == 7.0
    assert bc.percentile([], 50) is None
    with pytest.raises(ValueError):
        bc.percentile(xs, 101)


def test_ratio_is_none_without_both_values():
    assert bc.ratio(6.0, 3.0) == 2.0
    assert bc.ratio(None, 3.0) is None
    assert bc.ratio(6.0, None) is None
    assert bc.ratio(6.0, 0.0) is None
    assert bc.ratio(0.0, 2.0) == 0.0


def test_pong_delta_takes_the_level_out_of_the_running_means():
    before = {"forwards": 10, "mean_batch_sessions": 1.0, "mean_batch_tokens": 5.0}
    after = {"forwards": 14, "mean_batch_sessions": 1.6, "mean_batch_tokens": 8.0}  # 4 forwards of 3.1 and 15.5
    d = bc.pong_delta(before, after)
    assert d["forwards"] == 4
    assert d["mean_batch_sessions"] == pytest.approx((1.6 * 14 - 10) / 4)
    assert d["mean_batch_tokens"] == pytest.approx((8.0 * 14 - 50) / 4)
    assert bc.pong_delta(after, after) == {"forwards": 0, "mean_batch_sessions": None, "mean_batch_tokens": None}
    assert bc.pong_delta({}, {"forwards": 2, "mean_batch_sessions": 2.0})["mean_batch_sessions"] == 2.0


def test_levels_and_prompts():
    assert bc.parse_levels("16,1,4,4") == [1, 4, 16]
    for bad in ("", "0", "a,2"):
        with pytest.raises(SystemExit):
            bc.parse_levels(bad)
    prompts = [{"ids": [i]} for i in range(3)]
    assert [p["ids"][0] for p in bc.level_prompts(prompts, 7)] == [0, 1, 2, 0, 1, 2, 0]


def test_summarize_level_percentiles_batching_and_mismatches():
    def req(tokens, latency, vb=2.0):
        return {"token_ids": tokens, "latency_s": latency,
                "metrics": {"verify_batch_mean": vb, "draft_batch_mean": 0.0, "draft_tokens": 4, "accepted_tokens": 3,
                            "rounds": 2, "verifier_dtype": "float32", "drafter_dtype": "float32"}}

    ref = {"wall_s": 1.0,
           "requests": [{"token_ids": [1, 2], "latency_s": 1.0}, {"token_ids": [3, 4], "latency_s": 1.0}]}
    raw = {"wall_s": 2.0, "requests": [req([1, 2], 1.0), req([3, 5], 2.0, vb=1.0)],
           "pong_before": {"forwards": 1, "mean_batch_sessions": 1.0, "mean_batch_tokens": 3.0},
           "pong_after": {"forwards": 3, "mean_batch_sessions": 1.5, "mean_batch_tokens": 4.0}}
    s = bc.summarize_level("pipespec-batched", 2, raw, ref)
    assert s["tokens_per_s"] == 2.0 and s["new_tokens"] == 4
    assert s["latency_p50_s"] == pytest.approx(1.5) and s["latency_p95_s"] == pytest.approx(1.95)
    assert s["verify_batch_mean"] == 1.5 and s["forwards"] == 2 and s["mean_batch_sessions"] == pytest.approx(1.75)
    assert s["acceptance"] == 0.75
    assert s["mismatches"] == "1/2" and s["mismatch_detail"] == [{"prompt": 1, "first_diff": 1}]
    assert bc.summarize_level("hf-batched", 2, ref, ref)["mismatches"] == "ref"
    assert bc.summarize_level("hf-batched", 2, {"error": "boom"}, None) == {
        "n": 2, "key": "hf-batched", "label": "transformers batched generate", "error": "boom"}


def test_worker_call_is_bounded_and_kills_a_silent_worker():
    import asyncio
    import threading

    class Silent:  # a worker that never answers until it is killed
        def __init__(self):
            self.killed = threading.Event()
            self.proc = self

        def kill(self):
            self.killed.set()

        def call(self, op, **request):
            self.killed.wait(10)
            raise RuntimeError("killed")

    worker = Silent()
    with pytest.raises(TimeoutError, match="no answer to 'generate_batch' within 0 s"):
        asyncio.run(bc.worker_call(worker, 0.2, "generate_batch", ids=[[1]]))
    assert worker.killed.is_set()


def test_generate_batch_left_pads_like_unpadded_greedy(tiny):
    from transformers import AutoModelForCausalLM

    target = tiny("qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    model.generation_config.eos_token_id = 0
    prompts = [[5, 9, 13, 21, 7, 30, 31], [30, 4], [11, 12, 13, 14]]
    out = generate_batch(model, prompts, 10)
    assert out["width"] == 7
    assert out["token_ids"] == [reference_greedy(target, p, 10, eos=[0]) for p in prompts]


# ---------------------------------------------------------------------------------------------- end to end


def test_the_headline_pair_shares_a_pass_when_the_setups_do_not_all_fit():
    from benchmarks.passes import ClusterSetup, HFSetup, Row, plan_passes

    keys = list(bc.ROW_DEFS)
    assert bc.pass_units(keys) == [["pipespec-batched", "hf-batched"], ["pipespec-unbatched"], ["hf-assisted"]]
    assert bc.pass_units(["hf-batched", "hf-assisted"]) == [["hf-batched"], ["hf-assisted"]]
    # The GiB of the real fp32 run: a cluster 10.9 (two processes), the worker 7.8 with the target, 10.4 with both.
    setups = {k: ClusterSetup(k, "cpu.yaml", {}, {"verifier": 6.9, "drafter": 3.0})
              for k in ("pipespec-batched", "pipespec-unbatched")}
    setups[bc.HF_SETUP] = HFSetup(bc.HF_SETUP, "float32", 2, "cpu", "-", 7.3)
    rows = {k: Row(k, k, k) for k in ("pipespec-batched", "pipespec-unbatched")}
    rows["hf-batched"] = Row("hf-batched", "b", bc.HF_SETUP)
    rows["hf-assisted"] = Row("hf-assisted", "a", bc.HF_SETUP, models={"drafter": 2.6})
    passes = plan_passes(bc.pass_units(keys), rows, setups, budget_gib=20.5)
    assert [sorted(p.rows) for p in passes] == [["hf-batched", "pipespec-batched"], ["pipespec-unbatched"],
                                                ["hf-assisted"]]
    assert [p.rows for p in plan_passes(bc.pass_units(keys), rows, setups, budget_gib=100.0)] == [
        ["pipespec-batched", "hf-batched", "pipespec-unbatched", "hf-assisted"]]


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_end_to_end_random_pair(tmp_path):
    out = tmp_path / "results"
    code = bc.main(["--random", "--concurrency", "1,2", "--max-new-tokens", "4", "--out", str(out),
                    "--progress-s", "0"])
    assert code == 0
    for name in ("concurrency.json", "concurrency.md", "concurrency.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "concurrency.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| N | row |"))
    assert [c.strip() for c in header.strip("|").split("|")] == bc.COLUMNS
    assert "pipespec batched ÷ transformers batched generate" in md and "- machine:" in md
    report = json.loads((out / "concurrency.json").read_text())
    assert report["meta"]["concurrency"] == [1, 2] and report["meta"]["hf_dtype"] == "float32"
    for n in (1, 2):
        raw = report["raw"][str(n)]
        assert set(raw) == set(bc.ROW_DEFS)
        ref = [r["token_ids"] for r in raw["hf-batched"]["requests"]]
        assert len(ref) == n and all(ref)
        for key in ("pipespec-batched", "pipespec-unbatched"):
            assert [r["token_ids"] for r in raw[key]["requests"]] == ref, key  # greedy, float32: identical
    rows = {(r["n"], r["key"]): r for r in report["rows"]}
    for n in (1, 2):
        for key in ("pipespec-batched", "pipespec-unbatched"):
            r = rows[(n, key)]
            assert r["mismatches"] == f"0/{n}" and r["requests"] == n
            assert r["forwards"] >= 1 and r["verify_batch_mean"] >= 1.0 and r["latency_p95_s"] > 0
        assert rows[(n, "hf-assisted")]["requests"] == n
    assert set(report["ratios"]["2"]) == set(bc.RATIOS)
    assert all(v is not None and v > 0 for v in report["ratios"]["2"].values())
