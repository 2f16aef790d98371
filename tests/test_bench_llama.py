"""llama.cpp's ``llama-server`` as a benchmark setup (benchmarks/llama_server.py) and its rows in
scripts/bench_types.py: the command line built from the options, the request, the answer and counter parsing, a
missing binary failing its row with the reason while the other rows run, and the report's llama.cpp rows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks import drafter_types as dt
from benchmarks.llama_server import (
    LlamaServer,
    completion_body,
    parse_completion,
    parse_metrics,
    server_command,
    server_version,
)
from benchmarks.passes import HFSetup, LlamaSetup, Row, plan_passes
from benchmarks.runner import Runner
from testkit.tiny_models import reference_greedy


def _setup(tmp_path: Path, **kw) -> LlamaSetup:
    return LlamaSetup("llama-speculative", tmp_path / "bin", tmp_path / "t.gguf", {"target": 3.0}, 2,
                      ctx_size=1024, **kw)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.unit
def test_server_command_carries_threads_port_context_and_the_draft_options(tmp_path):
    spec = server_command(_setup(tmp_path, draft=tmp_path / "d.gguf", draft_max=5, draft_min=1), 43210)
    assert spec[0] == str(tmp_path / "bin" / "llama-server")
    assert _flag(spec, "-m") == str(tmp_path / "t.gguf") and _flag(spec, "--port") == "43210"
    assert _flag(spec, "--host") == "127.0.0.1"  # loopback only
    assert _flag(spec, "-t") == "2" and _flag(spec, "-tb") == "2" and _flag(spec, "-c") == "1024"
    assert _flag(spec, "-np") == "1" and "--metrics" in spec  # one slot; the draft counters on
    assert _flag(spec, "--spec-type") == "draft-simple" and _flag(spec, "-md") == str(tmp_path / "d.gguf")
    assert _flag(spec, "--spec-draft-n-max") == "5" and _flag(spec, "--spec-draft-n-min") == "1"
    alone = server_command(_setup(tmp_path), 1)
    assert not any(a.startswith("--spec") or a == "-md" for a in alone)


@pytest.mark.unit
def test_completion_body_is_the_prompt_ids_greedy_without_prompt_cache():
    body = completion_body([5, 6, 7], 8)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 8
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["repeat_penalty"] == 1.0
    assert body["cache_prompt"] is False and body["return_tokens"] is True


METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
llamacpp:spec_decode_num_draft_tokens_total {draft}
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
llamacpp:spec_decode_num_drafts_total {drafts}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} 7
"""


@pytest.mark.unit
def test_parse_metrics_reads_the_unlabeled_counters():
    m = parse_metrics(METRICS.format(draft=30, accepted=12, drafts=10))
    assert m == {"prompt_tokens_total": 120.0, "spec_decode_num_draft_tokens_total": 30.0,
                 "spec_decode_num_accepted_tokens_total": 12.0, "spec_decode_num_drafts_total": 10.0}


@pytest.mark.unit
def test_parse_completion_takes_ids_timings_and_the_counters_change():
    timings = {"prompt_n": 40, "predicted_n": 8, "predicted_ms": 800.0, "draft_n": 9, "draft_n_accepted": 5}
    body = {"content": "x", "tokens": [1, 2, 3, 4, 5, 6, 7, 8], "timings": timings, "stop_type": "limit"}
    before = parse_metrics(METRICS.format(draft=30, accepted=12, drafts=10))
    after = parse_metrics(METRICS.format(draft=39, accepted=17, drafts=13))
    out = parse_completion(body, 8, before, after)
    assert out["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8] and out["timings"] == timings
    assert out["stop_type"] == "limit"
    # 3 drafts of 9 tokens, 5 accepted: after the prompt's token the target ran 8 - 5 = 3 steps
    assert out["stats"] == {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 5, "rounds": 3}
    # no counters: the timings' draft counts, every step taken as a draft
    assert parse_completion(body, 8)["stats"] == {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 5, "rounds": 3}
    alone = parse_completion({"tokens": [4, 5], "timings": {"predicted_n": 2}}, 8)
    assert alone["stats"] == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "rounds": 2}


@pytest.mark.unit
@pytest.mark.parametrize(("body", "message"), [
    ({"content": "abc", "tokens": [], "timings": {"predicted_n": 3}}, "3 predicted"),
    ({"content": "abc", "timings": {"predicted_n": 3}}, "no token ids"),
    ({"tokens": list(range(9))}, "n_predict 8"),
    ({"error": {"code": 400, "message": "bad"}}, "answered an error"),
    ([1, 2], "not an object"),
])
def test_parse_completion_refuses_an_answer_without_the_generated_ids(body, message):
    with pytest.raises(ValueError, match=message):
        parse_completion(body, 8)


@pytest.mark.unit
def test_a_missing_binary_or_gguf_is_a_clear_error(tmp_path):
    (tmp_path / "bin").mkdir()
    with pytest.raises(FileNotFoundError, match=r"llama-server not found in .*build_llama_cpp.py --tools"):
        LlamaServer(_setup(tmp_path)).prepare()
    assert server_version(tmp_path / "bin") is None
    server = tmp_path / "bin" / "llama-server"
    server.write_text("#!/bin/sh\necho 'version: 1 (abc)'\necho 'built with cc for x86_64'\n")
    server.chmod(0o755)
    assert server_version(tmp_path / "bin") == "version: 1 (abc); built with cc for x86_64"
    with pytest.raises(FileNotFoundError, match=r"t.gguf is missing: run python -m weights"):
        LlamaServer(_setup(tmp_path, missing_hint="run python -m weights")).prepare()
    # a bf16 target to make, with no converter in the source tree
    setup = _setup(tmp_path, convert_from=str(tmp_path / "hf"), convert_src=tmp_path / "src")
    with pytest.raises(FileNotFoundError, match=r"convert_hf_to_gguf.py is not in .*src"):
        LlamaServer(setup).prepare()


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_a_row_whose_llama_server_is_missing_fails_alone(tiny, tmp_path):
    """The missing binary fails its row with the reason; the transformers row beside it runs every prompt."""
    target = tiny("llama")
    setups = {"w": HFSetup("w", "float32", 1, "cpu", str(target), 0.01),
              "llama-target": LlamaSetup("llama-target", tmp_path, tmp_path / "t.gguf", {"target": 0.01}, 1)}
    rows = {"ref": Row("ref", "ref", "w", strategy={"kind": "target"}),
            "llama-target": Row("llama-target", "llama", "llama-target", anchor="ref")}
    prompts = {"default": [{"ids": [5, 9, 13], "messages": None}, {"ids": [30, 4], "messages": None}]}
    runner = Runner(rows, setups, prompts, 6, lambda: None)
    asyncio.run(runner.run(plan_passes([["ref"], ["llama-target"]], rows, setups, 100.0)))
    assert runner.raw["llama-target"]["per_prompt"] == []
    assert runner.raw["llama-target"]["error"].startswith(f"FileNotFoundError: llama-server not found in {tmp_path}")
    assert [p["token_ids"] for p in runner.raw["ref"]["per_prompt"]] == [
        reference_greedy(target, p["ids"], 6, eos=[0]) for p in prompts["default"]]


def _pp(tokens: list[int], time_s: float, **extra) -> dict:
    return {"token_ids": tokens, "new_tokens": len(tokens), "time_s": time_s, "at": 0.0, **extra}


@pytest.mark.unit
def test_the_report_shows_llama_rows_with_alpha_mismatches_and_the_gguf_comparison(tmp_path):
    stats = {"rounds": 3, "drafts": 3, "draft_tokens": 9, "accepted_tokens": 5}
    timings = {"predicted_n": 8, "draft_n": 9, "draft_n_accepted": 5}
    raw = {
        "target-code": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 4.0)]},
        "hf-assistant": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 8.0, stats=stats)]},
        "pipespec-gguf": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 2.0, stats=stats)]},
        "llama-target": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 9], 2.0, llama={"timings": {}})]},
        "llama-speculative": {"pass": 1, "per_prompt": [
            _pp([1, 2, 3, 4, 5, 6, 7, 8], 1.0, stats=stats, llama={"timings": timings})]},
        "llama-speculative-q4": {"pass": 1, "per_prompt": [], "error": "FileNotFoundError: llama-server not found"},
    }
    machine = {"cpu": "cpu", "cores": 2, "logical_cpus": 2, "flags": {}, "memory_gib": 8.0, "gpu": None,
               "python": "3", "versions": {}}
    meta = {"start": "2026-01-01T00:00:00", "end": None, "machine": machine, "prompts": 1, "max_new_tokens": 8,
            "ensemble_weight": 0.7, "hf_threads": 2, "llama_cpp": {
                "bin": "/x/bin", "version": "version: 1 (abc)", "threads": 2, "draft_max": 3, "draft_min": 0}}
    report = {"meta": meta, "raw": raw, "anchor_runs": {}, "setups": {"llama-speculative": {"command": [
        "/x/bin/llama-server", "-m", "/c/t.gguf", "-t", "2"]}}}
    report["rows"] = [dt.summarize(k, report) for k in raw]
    rows = {r["key"]: r for r in report["rows"]}
    assert "alpha" not in rows["llama-target"] and rows["llama-target"]["mismatches"] == 1
    spec = rows["llama-speculative"]
    assert spec["alpha"] == pytest.approx(5 / 9) and spec["tau"] == pytest.approx(1 + 5 / 3)
    assert spec["vs_target"] == pytest.approx(4.0) and spec["vs_hf_same"] == pytest.approx(8.0)
    assert rows["pipespec-gguf"]["vs_hf_same"] == pytest.approx(4.0)  # against transformers' assisted generation
    assert rows["pipespec-gguf"]["vs_llama_speculative"] == pytest.approx(0.5)
    dt.write_markdown(tmp_path / "types.md", report)
    text = (tmp_path / "types.md").read_text()
    assert "llama.cpp: `version: 1 (abc)` (/x/bin)" in text and "-t 2 -tb 2" in text
    assert "| llama.cpp speculative (bf16 target) | llama.cpp draft model |" in text
    assert "llama.cpp speculative (Q4_K_M target) failed: `FileNotFoundError: llama-server not found`" in text
    assert "pipespec gguf ÷ llama.cpp speculative (bf16 target), the same pair: 0.50× (same pass)" in text
    assert "`llama-server -m t.gguf -t 2`" in text


@pytest.mark.unit
def test_the_llama_cpp_target_row_is_compared_with_the_same_gguf_pair_in_llama_cpp(tmp_path):
    """pipespec-gguf-target (configs/gguf_target.yaml) ÷ llama-speculative-q4 (the Q4_K_M target and the 0.5B's
    GGUF in llama-server), directly when they shared a pass; the row's tokens may differ from transformers'."""
    stats = {"rounds": 3, "drafts": 3, "draft_tokens": 9, "accepted_tokens": 5}
    raw = {
        "target-code": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 4.0)]},
        "pipespec-gguf-target": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 9], 1.0, stats=stats)]},
        "llama-speculative-q4": {"pass": 1, "per_prompt": [
            _pp([1, 2, 3, 4, 5, 6, 7, 9], 1.5, stats=stats, llama={"timings": {}})]},
    }
    machine = {"cpu": "cpu", "cores": 2, "logical_cpus": 2, "flags": {}, "memory_gib": 8.0, "gpu": None,
               "python": "3", "versions": {}}
    meta = {"start": "2026-01-01T00:00:00", "end": None, "machine": machine, "prompts": 1, "max_new_tokens": 8,
            "ensemble_weight": 0.7, "hf_threads": 2}
    report = {"meta": meta, "raw": raw, "anchor_runs": {}, "setups": {}}
    report["rows"] = [dt.summarize(k, report) for k in raw]
    row = next(r for r in report["rows"] if r["key"] == "pipespec-gguf-target")
    assert row["config"] == "gguf_target.yaml" and row["mismatches"] == 1
    assert row["vs_llama_speculative_q4"] == pytest.approx(1.5) and row["vs_llama_q4_how"] == "same pass"
    dt.write_markdown(tmp_path / "types.md", report)
    assert ("pipespec llama.cpp target (Q4_K_M) + gguf ÷ llama.cpp speculative (Q4_K_M target), the same GGUF pair: "
            "1.50× (same pass)") in (tmp_path / "types.md").read_text()
    assert dt.unit_of("pipespec-gguf-target") == dt.unit_of("pipespec-gguf")  # they share a pass


@pytest.mark.unit
def test_gguf_and_llama_rows_come_right_after_the_assistant_pair_in_the_plan():
    keys = [k for k in dt.ROWS if k in {"target-code", "hf-assistant", "pipespec-assistant", "pipespec-ensemble",
                                         "pipespec-gguf", "llama-target", "llama-speculative", "hf-early-exit"}]
    # each llama.cpp row is a unit of its own, llama-speculative (gguf's same pair) first: it shares pass 1 with
    # pipespec-gguf when the three servers do not fit beside the clusters
    assert dt.plan_units(keys) == [["target-code"], ["hf-assistant", "pipespec-assistant"], ["pipespec-gguf"],
                                   ["llama-speculative"], ["llama-target"], ["pipespec-ensemble"], ["hf-early-exit"]]
    assert dt.hf_same_strategy("pipespec-gguf") == dt.hf_same_strategy("llama-speculative") == "hf-assistant"
    assert dt.hf_same_strategy("llama-target") is None


@pytest.mark.slow
def test_a_real_llama_server_decodes_the_ids_greedily_and_counts_its_drafts(tiny, tmp_path):
    """The built llama-server (``--llama-bin``'s default: ``$PIPESPEC_LLAMA_BIN`` or the tools folder; built by
    ``scripts/build_llama_cpp.py --tools``, not by ``make setup``, hence the slow tier) on a tiny float32 Qwen2 GGUF:
    the ids of transformers' greedy decoding of the same weights, and with itself as draft model the same ids with
    every draft accepted (the counters read around each request)."""
    from benchmarks.llama_server import default_bin_dir
    from testkit.tiny_gguf import write_qwen2_gguf

    folder = tiny("qwen2", "target")
    gguf = write_qwen2_gguf(folder, tmp_path / "t.gguf")
    bin_dir = default_bin_dir()
    ids, n = [5, 17, 33, 2, 60, 7], 12
    expected = reference_greedy(folder, ids, n, eos=[0])
    got = {}
    for key, draft in (("alone", None), ("spec", gguf)):
        server = LlamaServer(LlamaSetup(key, bin_dir, gguf, {}, 1, ctx_size=256, draft=draft, draft_max=3))
        try:
            server.start()
            got[key] = [server.generate(ids, n) for _ in range(2)]  # the second request: no state left over
        finally:
            server.close()
        assert server.proc.returncode is not None
    for key in got:
        assert [r["token_ids"] for r in got[key]] == [expected, expected], key
        assert all(r["time_s"] > 0 and r["timings"]["predicted_n"] == len(expected) for r in got[key])
    assert got["alone"][0]["stats"]["drafts"] == 0
    spec = got["spec"][1]["stats"]
    assert spec["drafts"] > 0 and spec["accepted_tokens"] == spec["draft_tokens"] > 0
    assert spec["rounds"] == len(expected) - spec["accepted_tokens"]
