"""OpenVINO GenAI as a benchmark setup (benchmarks/ov_genai.py, benchmarks/ov_worker.py) and its rows in
scripts/bench_types.py: the rows and setups, the worker's protocol and counters, a failed environment failing its
row with the reason while the other rows run, the runner driving a worker (a stand-in speaking the protocol, so no
OpenVINO environment is made in the default run), and the report's OpenVINO rows and forward-cost table. One slow
test makes the real environment and exports a tiny model."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import drafter_types as dt
from benchmarks import ov_genai, ov_worker
from benchmarks.passes import HFSetup, OVSetup, Row, plan_passes
from benchmarks.runner import Runner
from testkit.tiny_models import reference_greedy

# ---------------------------------------------------------------------------------------------- rows and setups


@pytest.mark.unit
def test_the_openvino_rows_are_registered_counted_and_compared_with_assisted_generation():
    assert dt.ROWS["ov-target"][2] == "ov:target" and dt.ROWS["ov-speculative"][2] == "ov:target+draft"
    assert dt.is_ov("ov-target") and not dt.is_ov("llama-target") and not dt.is_llama("ov-target")
    assert not dt.drafts_counted("ov-target") and dt.drafts_counted("ov-speculative")
    assert dt.hf_same_strategy("ov-speculative") == "hf-assistant" and dt.hf_same_strategy("ov-target") is None
    keys = [k for k in dt.ROWS if k in {"target-code", "hf-assistant", "pipespec-assistant", "llama-target",
                                         "ov-target", "ov-speculative", "hf-early-exit"}]
    # each OpenVINO row a unit of its own, after the llama.cpp rows and before the other types
    assert dt.plan_units(keys) == [["target-code"], ["hf-assistant", "pipespec-assistant"], ["llama-target"],
                                   ["ov-target"], ["ov-speculative"], ["hf-early-exit"]]
    assert dt.select_rows("ov", list(dt.ROWS), "t") == ["ov-target", "ov-speculative"]


@pytest.mark.unit
def test_ov_setup_takes_the_draft_only_where_the_row_drafts_and_budgets_float32(tiny, tmp_path):
    target, draft = str(tiny("qwen2", "target")), str(tiny("qwen2", "random"))
    alone = dt.ov_setup("ov-target", target, draft, 2, 5, tmp_path / "venv", curves=True)
    spec = dt.ov_setup("ov-speculative", target, draft, 3, 4, tmp_path / "venv", curves=False)
    assert alone.draft_path is None and set(alone.models) == {"target"}
    assert alone.curves == [("OpenVINO target", "target", dt.FORWARD_SIZES)] and spec.curves == []
    assert spec.draft_path == draft and spec.draft_tokens == 4 and spec.threads == 3 and set(spec.models) == {
        "target", "draft"}
    assert alone.models["target"] == pytest.approx(dt.model_gib(target, "float32"))
    assert alone.precision == "bf16" and alone.threads_label == "2 threads"
    spec_json = ov_genai.worker_spec(spec, tmp_path / "t-ov", tmp_path / "d-ov")
    assert spec_json == {"key": "ov-speculative", "target": str(tmp_path / "t-ov"), "draft": str(tmp_path / "d-ov"),
                         "threads": 3, "precision": "bf16", "draft_tokens": 4}


@pytest.mark.unit
def test_the_environment_pins_pipespecs_torch_and_the_openvino_set():
    reqs = ov_genai.requirements("2.13.0+cpu")
    assert reqs[0] == "torch==2.13.0+cpu"  # the same build as pipespec's: no CUDA torch pulled in
    names = {r.split("==")[0].split("[")[0] for r in reqs}
    assert {"openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers"} <= names
    assert all("==" in r for r in reqs)  # every one pinned
    transformers = next(r for r in reqs if r.startswith("transformers=="))
    major, minor = (int(x) for x in transformers.split("==")[1].split(".")[:2])
    assert (major, minor) < (5, 6)  # what optimum-intel accepts
    assert ov_genai.export_dir("/x/Qwen2.5-Coder-1.5B").name == "Qwen2.5-Coder-1.5B-fp16"


@pytest.mark.unit
def test_a_finished_environment_or_export_is_reused_without_running_anything(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("nothing should run")

    monkeypatch.setattr(ov_genai, "run_logged", refuse)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    reqs = ov_genai.requirements("2.13.0+cpu")
    (venv / ov_genai.MARKER).write_text(json.dumps({"requirements": reqs}))
    assert ov_genai.ensure_venv(venv, reqs) == venv / "bin" / "python"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "m-ov"
    out.mkdir()
    (out / "openvino_model.xml").write_text("")
    (out / ov_genai.MARKER).write_text(json.dumps({"source": str(model), "stamp": ov_genai.source_stamp(model),
                                                   "weight_format": "fp16"}))
    assert ov_genai.ensure_export(venv / "bin" / "python", model, out) == out
    # other requirements, or a changed source: made again (here: the refusal)
    with pytest.raises(AssertionError, match="nothing should run"):
        ov_genai.ensure_venv(venv, [*reqs[:-1], "transformers==5.4.0"])
    (model / "model.safetensors").write_text("new weights")
    with pytest.raises(AssertionError, match="nothing should run"):
        ov_genai.ensure_export(venv / "bin" / "python", model, out)
    with pytest.raises(FileNotFoundError, match="not a transformers model folder"):
        ov_genai.ensure_export(venv / "bin" / "python", tmp_path / "nothing", out)


@pytest.mark.unit
def test_run_logged_passes_output_through_and_fails_with_its_end(capsys):
    ov_genai.run_logged([sys.executable, "-c", "print('hello')"], "step", 60)
    assert "  step: hello" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"(?s)step exited with code 3:.*last words"):
        ov_genai.run_logged([sys.executable, "-c", "print('last words'); raise SystemExit(3)"], "step", 60)
    with pytest.raises(RuntimeError, match="step ran over 1 s"):
        ov_genai.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], "step", 1)


# ---------------------------------------------------------------------------------------------- the protocol


@pytest.mark.unit
def test_serve_answers_each_line_turns_errors_into_answers_and_stops_at_quit():
    def handle(req):
        if req["op"] == "boom":
            raise KeyError("x")
        return {"echo": req["op"]}

    lines = ['{"op": "ready"}', "", "not json", '{"no": "op"}', '{"op": "boom"}', '{"op": "quit"}', '{"op": "late"}']
    out = io.StringIO()
    assert ov_worker.serve(lines, out, handle) == 0
    answers = [json.loads(a) for a in out.getvalue().splitlines()]
    assert answers[0] == {"echo": "ready"}
    assert answers[1]["error"].startswith("JSONDecodeError")
    assert "an object with an 'op' string" in answers[2]["error"]
    assert answers[3] == {"error": "KeyError: 'x'"}
    assert answers[4] == {"echo": "quit"} and len(answers) == 5  # nothing after quit


@pytest.mark.unit
def test_parse_answer_and_parse_generate_refuse_what_is_not_a_generation():
    assert ov_genai.parse_answer('{"load_s": 1.5}', "load") == {"load_s": 1.5}
    with pytest.raises(RuntimeError, match="failed 'generate': ValueError: bad"):
        ov_genai.parse_answer('{"error": "ValueError: bad"}', "generate")
    with pytest.raises(ValueError, match="not JSON"):
        ov_genai.parse_answer("Traceback (most recent call last):", "generate")
    with pytest.raises(ValueError, match="not an object"):
        ov_genai.parse_answer("[1, 2]", "generate")
    stats = {"rounds": 3, "drafts": 2, "draft_tokens": 6, "accepted_tokens": 6}
    good = {"token_ids": [4, 5, 6], "time_s": 0.5, "stats": stats, "perf": {"ttft_ms": 3.0}, "settings": {"k": 1}}
    out = ov_genai.parse_generate(good, 8)
    assert out["token_ids"] == [4, 5, 6] and out["new_tokens"] == 3 and out["time_s"] == 0.5
    assert out["stats"] == stats and out["openvino"] == {"perf": {"ttft_ms": 3.0}, "settings": {"k": 1}}
    for bad, message in (({**good, "token_ids": None}, "no token ids"), ({**good, "token_ids": [1] * 9}, "9 tokens"),
                         ({**good, "time_s": 0}, "no positive time"), ({**good, "stats": {}}, "no 'rounds'")):
        with pytest.raises(ValueError, match=message):
            ov_genai.parse_generate(bad, 8)


@pytest.mark.unit
def test_draft_stats_count_the_steps_genai_counts():
    # a model drafting for itself, 12 tokens, 3 drafts per step: the target emits 1, 4, 4, 3; GenAI reports 6 drafted
    # and 6 accepted (the last step left out), so α 1, τ 1 + 6 / 2 = 4, k 3 over the two steps it counts
    s = ov_worker.draft_stats(12, [1, 4, 4, 3], 6, 6, drafting=True)
    assert {k: s[k] for k in ("rounds", "drafts", "draft_tokens", "accepted_tokens")} == {
        "rounds": 3, "drafts": 2, "draft_tokens": 6, "accepted_tokens": 6}
    assert "but the last" in s["counted"]
    # every draft rejected: 11 steps of one token, 27 drafted
    s = ov_worker.draft_stats(12, [1] * 12, 0, 27, drafting=True)
    assert (s["rounds"], s["drafts"], s["draft_tokens"], s["accepted_tokens"]) == (11, 10, 27, 0)
    # counters that do not match the steps: taken over every step, and said so
    s = ov_worker.draft_stats(12, [1, 4, 4, 3], 8, 8, drafting=True)
    assert s["drafts"] == 3 and "every verification step" in s["counted"]
    alone = ov_worker.draft_stats(5, [1, 1, 1, 1, 1], None, None, drafting=False)
    assert alone == {"rounds": 4, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    assert ov_worker.draft_stats(3, None, 1, 2, drafting=True)["drafts"] == 2  # no steps reported
    assert "no draft counters" in ov_worker.draft_stats(3, None, None, None, drafting=True)["counted"]
    with pytest.raises(ValueError, match="emitted 11 tokens"):
        ov_worker.draft_stats(12, [1, 4, 3, 3], 6, 6, drafting=True)
    with pytest.raises(ValueError, match="7 accepted draft tokens of 6"):
        ov_worker.draft_stats(12, [1, 4, 4, 3], 7, 6, drafting=True)


@pytest.mark.unit
def test_the_generation_config_stops_where_transformers_does(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7, "vocab_size": 100}))
    assert ov_worker.stop_fields(str(folder)) == {"eos": [7]}  # config.json's, no generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643],
                                                               "repetition_penalty": 1.05}))
    fields = ov_worker.stop_fields(str(folder))
    assert fields == {"eos": [151645, 151643], "repetition_penalty": 1.05}
    config = SimpleNamespace(eos_token_id=-1, stop_token_ids=set(), repetition_penalty=1.0, max_new_tokens=8,
                             do_sample=False, set_eos_token_id=lambda e: setattr(config, "eos_token_id", e))
    ov_worker.apply_stops(config, fields)
    assert config.eos_token_id == 151645 and config.stop_token_ids == {151645, 151643}
    assert config.repetition_penalty == 1.05
    settings = ov_worker.settings_of(config)
    assert settings["stop_token_ids"] == [151643, 151645] and settings["max_new_tokens"] == 8
    assert "num_assistant_tokens" not in settings  # not set on this config: left out, not invented
    assert ov_worker.vocab_size(str(folder)) == 100
    assert ov_worker.plugin_properties({"threads": 2}) == {"INFERENCE_PRECISION_HINT": "bf16",
                                                           "INFERENCE_NUM_THREADS": 2}
    with pytest.raises(ValueError, match="threads must be"):
        ov_worker.plugin_properties({"threads": 0})


@pytest.mark.unit
def test_precision_label_says_what_ran_and_what_was_asked():
    info = {"properties": {"INFERENCE_PRECISION_HINT": "bf16"}, "resolved": {"INFERENCE_PRECISION_HINT": "f32"}}
    assert ov_genai.precision_label(info) == "f32 (hint bf16)"
    info["resolved"]["INFERENCE_PRECISION_HINT"] = "bf16"
    assert ov_genai.precision_label(info) == "bf16"


# ---------------------------------------------------------------------------------------------- with the runner

#: A stand-in for benchmarks/ov_worker.py speaking its protocol: it "decodes" with the tiny target's transformers
#: greedy ids passed in its spec, so the runner's bookkeeping is checked without OpenVINO.
FAKE_WORKER = """
import json, sys
sys.path.insert(0, {bench!r})
from ov_worker import draft_stats, serve
spec = json.loads(sys.argv[1])
answers = json.loads(open(spec["target"] + "/answers.json").read())

def handle(req):
    op = req["op"]
    if op == "ready":
        return {{"versions": {{"openvino_genai": "0.0-fake"}}, "properties": {{"INFERENCE_PRECISION_HINT": "bf16",
                "INFERENCE_NUM_THREADS": spec["threads"]}}, "resolved": {{"INFERENCE_PRECISION_HINT": "f32",
                "INFERENCE_NUM_THREADS": str(spec["threads"])}}}}
    if op == "curve":
        return {{"sizes": req["sizes"], "seconds": [0.01 * n for n in req["sizes"]], "prefix_len": req["prefix_len"]}}
    if op == "load":
        return {{"load_s": 0.1}}
    if op == "generate":
        ids = answers[str(req["ids"])][: req["max_new_tokens"]]
        steps = [1] + [1] * (len(ids) - 1)
        return {{"token_ids": ids, "time_s": 0.01, "stats": draft_stats(len(ids), steps, 0, 3, bool(spec["draft"])),
                "perf": {{}}, "settings": {{}}}}
    return {{}}

sys.exit(serve(sys.stdin, sys.stdout, handle))
"""


def _fake_worker(monkeypatch, tmp_path: Path, answers: dict[str, list[int]]) -> None:
    script = tmp_path / "fake_ov_worker.py"
    script.write_text(FAKE_WORKER.format(bench=str(Path(ov_genai.__file__).parent)))
    exported = tmp_path / "exported"
    exported.mkdir(exist_ok=True)
    (exported / "answers.json").write_text(json.dumps(answers))
    monkeypatch.setattr(ov_genai, "WORKER", script)

    def prepare(self):
        self.exports = {"target": str(exported)}
        return Path(sys.executable), exported, exported if self.setup.draft_path else None

    monkeypatch.setattr(ov_genai.OVWorker, "prepare", prepare)


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_the_runner_drives_an_openvino_worker_and_a_failed_environment_fails_only_its_row(tiny, tmp_path,
                                                                                          monkeypatch):
    """ov-speculative (a stand-in worker) decodes every prompt, its curve and precision recorded; ov-target, whose
    environment cannot be made, fails with pip's reason; the transformers reference runs every prompt."""
    target = tiny("llama")
    prompts = {"default": [{"ids": [5, 9, 13], "messages": None}, {"ids": [30, 4], "messages": None}]}
    expected = {str(p["ids"]): reference_greedy(target, p["ids"], 6, eos=[0]) for p in prompts["default"]}
    _fake_worker(monkeypatch, tmp_path, expected)
    real_prepare = ov_genai.OVWorker.prepare

    def prepare(self):
        if self.setup.key == "ov-target":  # the real path, its pip failing
            def pip_fails(cmd, label, timeout_s, env=None):
                if label == "pip":  # `python -m venv` passes (without making one: nothing is made here)
                    raise RuntimeError(f"{label} exited with code 1:\nERROR: No matching distribution found for "
                                       "openvino-genai==2026.4.1.0")

            monkeypatch.setattr(ov_genai, "run_logged", pip_fails)
            return ov_genai.ensure_venv(tmp_path / "no-venv", ["openvino-genai==2026.4.1.0"])
        return real_prepare(self)

    monkeypatch.setattr(ov_genai.OVWorker, "prepare", prepare)
    ov = OVSetup("ov-speculative", str(target), {"target": 0.01}, 1, draft_path=str(target), draft_tokens=3,
                 curves=[("OpenVINO target", "target", [1, 9])])
    setups = {"w": HFSetup("w", "float32", 1, "cpu", str(target), 0.01,
                           curves=[("transformers target", "target", [1, 9])]),
              "ov-speculative": ov,
              "ov-target": OVSetup("ov-target", str(target), {"target": 0.01}, 1, venv=tmp_path / "no-venv")}
    rows = {"ref": Row("ref", "ref", "w", strategy={"kind": "target"}),
            "ov-speculative": Row("ov-speculative", "ov spec", "ov-speculative", anchor="ref"),
            "ov-target": Row("ov-target", "ov target", "ov-target", anchor="ref")}
    runner = Runner(rows, setups, prompts, 6, lambda: None, curve_budget_s=5.0)
    asyncio.run(runner.run(plan_passes([["ref"], ["ov-speculative"], ["ov-target"]], rows, setups, 100.0)))
    assert [p["token_ids"] for p in runner.raw["ref"]["per_prompt"]] == list(expected.values())
    spec = runner.raw["ov-speculative"]
    assert "error" not in spec and [p["token_ids"] for p in spec["per_prompt"]] == list(expected.values())
    assert all(p["stats"]["draft_tokens"] == 3 and "openvino" in p for p in spec["per_prompt"])
    assert runner.raw["ov-target"]["per_prompt"] == []
    assert runner.raw["ov-target"]["error"].startswith("RuntimeError: pip exited with code 1:")
    assert "No matching distribution found for openvino-genai" in runner.raw["ov-target"]["error"]
    info = runner.setup_info["ov-speculative"]
    assert info["openvino"]["resolved"]["INFERENCE_PRECISION_HINT"] == "f32" and info["load_s"] == 0.1
    assert runner.curves["ov-speculative"]["dtype"] == "f32 (hint bf16)"
    assert runner.curves["ov-speculative"]["curves"]["OpenVINO target"]["sizes"] == [1, 9]
    assert runner.curves["w"]["curves"]["transformers target"]["sizes"] == [1, 9]  # both engines' targets


@pytest.mark.unit
def test_a_worker_that_dies_or_hangs_is_an_error_with_its_log(tmp_path, monkeypatch):
    script = tmp_path / "w.py"
    script.write_text("import sys, time\nline = sys.stdin.readline()\nprint('dying words', file=sys.stderr)\n"
                      "sys.stderr.flush()\nif 'hang' in sys.argv[1]: time.sleep(60)\nsys.exit(4)\n")
    monkeypatch.setattr(ov_genai, "WORKER", script)
    monkeypatch.setattr(ov_genai.OVWorker, "prepare", lambda self: (Path(sys.executable), tmp_path, None))
    monkeypatch.setattr(ov_genai, "START_TIMEOUT_S", 2.0)
    w = ov_genai.OVWorker(OVSetup("die", str(tmp_path), {}, 1))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 4:.*dying words"):
        w.start()
    w.close()
    w = ov_genai.OVWorker(OVSetup("hang", str(tmp_path), {}, 1))
    with pytest.raises(RuntimeError, match="did not answer 'ready' within 2 s"):
        w.start()
    w.close()
    assert w.proc is not None and w.proc.returncode is not None


# ---------------------------------------------------------------------------------------------- the report


def _pp(tokens: list[int], time_s: float, **extra) -> dict:
    return {"token_ids": tokens, "new_tokens": len(tokens), "time_s": time_s, "at": 0.0, **extra}


@pytest.mark.unit
def test_the_report_shows_openvino_rows_its_precision_and_each_engines_forward_cost(tmp_path):
    stats = {"rounds": 3, "drafts": 2, "draft_tokens": 6, "accepted_tokens": 4}
    raw = {
        "target-code": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 4.0)]},
        "hf-assistant": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 8.0, stats=stats)]},
        "ov-target": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 9], 2.0, stats={
            "rounds": 7, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}, openvino={})]},
        "ov-speculative": {"pass": 1, "per_prompt": [_pp([1, 2, 3, 4, 5, 6, 7, 8], 1.0, stats=stats, openvino={})]},
    }
    machine = {"cpu": "cpu", "cores": 2, "logical_cpus": 2, "flags": {}, "memory_gib": 8.0, "gpu": None,
               "python": "3", "versions": {}}
    meta = {"start": "2026-01-01T00:00:00", "end": None, "machine": machine, "prompts": 1, "max_new_tokens": 8,
            "ensemble_weight": 0.7, "hf_threads": 2, "openvino": {
                "venv": "/c/openvino/venv", "threads": 2, "precision_hint": "bf16", "draft_tokens": 5,
                "weight_format": "fp16", "versions": None, "resolved": None}}
    setups = {"ov-target": {"openvino": {"versions": {"openvino_genai": "2026.4.1.0-3408-ab01"},
                                         "properties": {"INFERENCE_PRECISION_HINT": "bf16"},
                                         "resolved": {"INFERENCE_PRECISION_HINT": "f32",
                                                      "INFERENCE_NUM_THREADS": "2"}}}}
    curves = {"hf-bf16-2t": {"dtype": "bfloat16", "threads_label": "2 threads", "threads": 2,
                             "models": {"transformers target": "Qwen-1.5B"},
                             "curves": {"transformers target": {"sizes": [1, 9], "seconds": [0.2, 0.5],
                                                                "prefix_len": 64}}},
              "ov-target": {"dtype": "f32 (hint bf16)", "threads_label": "2 threads", "threads": 2,
                            "models": {"OpenVINO target": "Qwen-1.5B"},
                            "curves": {"OpenVINO target": {"sizes": [1, 9], "seconds": [0.1, 0.3],
                                                           "prefix_len": 64}}}}
    report = {"meta": meta, "raw": raw, "anchor_runs": {}, "setups": setups, "curves": curves}
    meta["openvino"] |= dt.ov_meta(report)
    report["rows"] = [dt.summarize(k, report) for k in raw]
    rows = {r["key"]: r for r in report["rows"]}
    assert "alpha" not in rows["ov-target"] and rows["ov-target"]["mismatches"] == 1
    spec = rows["ov-speculative"]
    assert spec["alpha"] == pytest.approx(4 / 6) and spec["tau"] == pytest.approx(1 + 4 / 2)
    assert spec["vs_target"] == pytest.approx(4.0) and spec["vs_hf_same"] == pytest.approx(8.0)
    assert spec["vs_ov_target"] == pytest.approx(2.0) and spec["mismatches"] == 0
    dt.write_markdown(tmp_path / "types.md", report)
    text = (tmp_path / "types.md").read_text()
    assert "OpenVINO GenAI: openvino_genai 2026.4.1.0;" in text
    assert "`INFERENCE_PRECISION_HINT` bf16" in text and "resolved to f32 (hint bf16), 2 threads" in text
    assert "| OpenVINO GenAI speculative | openvino draft model |" in text
    assert "OpenVINO GenAI speculative ÷ its target alone: 2.00× (same pass)" in text
    assert "| model | dtype | threads | 1 | 9 |" in text
    assert "| transformers target `Qwen-1.5B` | bf16 | 2 threads | 200 | 500 |" in text
    assert "| OpenVINO target `Qwen-1.5B` | f32 (hint bf16) | 2 threads | 100 | 300 |" in text


# ---------------------------------------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_the_real_environment_exports_a_tiny_model_and_decodes_it_greedily(tiny):
    """Makes (or reuses) the OpenVINO environment in the cache (about 1.5 GB, minutes the first time), exports the
    tiny float32 Qwen2 target, and checks that GenAI's greedy ids, alone and with the target as its own draft
    model, are transformers' (every draft accepted), and that the forward cost and precision are reported."""
    import tempfile

    folder = tiny("qwen2", "target")
    ids, n = [5, 17, 33, 2, 60, 7], 12
    expected = reference_greedy(folder, ids, n, eos=[0])
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(ov_genai, "ov_root", lambda: Path(tmp))  # the exports in a scratch folder
        venv = _real_venv()  # the bench's own environment (the exports go to the scratch folder)
        setups = [OVSetup("alone", str(folder), {}, 1, venv=venv),
                  OVSetup("spec", str(folder), {}, 1, draft_path=str(folder), draft_tokens=3, venv=venv)]
        for setup in setups:
            w = ov_genai.OVWorker(setup)
            try:
                info = w.start()
                assert info["resolved"]["INFERENCE_PRECISION_HINT"] in ("f32", "bf16")
                curve = w.call("curve", model="target", sizes=[1, 9], prefix_len=16, budget_s=10, repeats=1)
                assert curve["sizes"] == [1, 9] and all(s > 0 for s in curve["seconds"])
                w.load()
                got = [w.generate(ids, n) for _ in range(2)]
            finally:
                w.close()
            assert [g["token_ids"] for g in got] == [expected, expected], setup.key
            if setup.draft_path:
                s = got[1]["stats"]
                assert s["draft_tokens"] > 0 and s["accepted_tokens"] == s["draft_tokens"]


def _real_venv() -> Path:
    from shared.named_models import cache_root

    return cache_root() / "openvino" / "venv"
