"""benchmarks/sweep.py: a sweep file's grid (named axes, config-key axes, mapping values, invalid points skipped
with their error), the file's errors, the summary's token-identity check, the ``pipespec bench --sweep / --ray``
command line, and one real 2-point sweep on tiny models (process backend) writing its table, json and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config

import benchmarks.sweep as sw


def _write(folder: Path, spec: dict | str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.unit
def test_grid_expands_named_axes_mapping_values_and_skips_invalid_points(tmp_path):
    spec = {"base": "cpu.yaml", "set": {"drafter.overlap": False}, "prompts": 1, "max_new_tokens": 8,
            "grid": {"drafter.type": ["assistant", "prompt_lookup"], "k": [4, 8],
                     "pair": [{"name": "small", "verifier.model": "qwen2.5-coder-0.5b-instruct",
                               "drafter.model": "qwen2.5-coder-0.5b-instruct"}],
                     "link_delay_ms": [0, 5]}}
    sweep = sw.read_sweep(_write(tmp_path, spec))
    points = sw.expand(sweep)
    assert len(points) == 2 * 2 * 1 * 2
    first = points[0]
    assert first.labels == {"drafter.type": "assistant", "k": "4", "pair": "small", "link_delay_ms": "0"}
    assert first.label == "type=assistant, k=4, pair=small, link_delay_ms=0"
    assert first.error is None
    assert first.overrides == {"drafter.overlap": False, "drafter.type": "assistant", "drafter.num_draft_tokens": 4,
                               "verifier.model": "qwen2.5-coder-0.5b-instruct",
                               "drafter.model": "qwen2.5-coder-0.5b-instruct", "launch.link_delay_ms": 0,
                               "drafter.draft_schedule": "constant"}
    lookup = next(p for p in points if p.labels["drafter.type"] == "prompt_lookup" and p.labels["k"] == "8")
    assert lookup.overrides["drafter.prompt_lookup_num_tokens"] == 8  # its own block length follows k
    delayed = [p for p in points if p.labels["link_delay_ms"] == "5"]
    assert len(delayed) == 4 and all("launch.link_delay_ms" in p.error for p in delayed)  # process backend
    assert all(p.error is None for p in points if p not in delayed)
    # the command line's --ray: every point on the ray backend, where link delay is valid
    on_ray = sw.expand(sweep, {"launch.backend": "ray"})
    assert all(p.error is None and p.overrides["launch.backend"] == "ray" for p in on_ray)


@pytest.mark.unit
def test_k_is_refused_for_a_type_that_fixes_it_and_a_schedule_axis_wins_over_constant(tmp_path):
    spec = {"grid": {"drafter.type": ["mtp", "assistant"], "k": [3], "schedule": ["cost", "constant"]}}
    points = sw.expand(sw.read_sweep(_write(tmp_path, spec)))
    mtp = [p for p in points if p.labels["drafter.type"] == "mtp"]
    assert mtp and all("k cannot be set" in p.error for p in mtp)
    cost = next(p for p in points if p.labels["drafter.type"] == "assistant" and p.labels["schedule"] == "cost")
    assert cost.error is None and cost.overrides["drafter.draft_schedule"] == "cost"
    assert cost.overrides["drafter.num_draft_tokens"] == 3  # the starting k of the cost schedule


@pytest.mark.unit
def test_a_value_that_does_not_validate_is_a_skipped_point_with_the_config_error(tmp_path):
    spec = {"grid": {"drafter.num_draft_tokens": [4, 0]}}
    points = sw.expand(sw.read_sweep(_write(tmp_path, spec)))
    assert points[0].error is None
    assert "drafter.num_draft_tokens" in points[1].error


BAD_FILES = [
    ("grid: [1, 2]\n", "grid: a mapping"),
    ("colour: red\n", "colour: unknown key"),
    ("base: no-such.yaml\n", "base: config file 'no-such.yaml' not found"),
    ("set: {drafter.nonsense: 1}\n", "set.drafter.nonsense"),
    ("set: [1]\n", "set: a mapping"),
    ("prompts: 0\n", "prompts:"),
    ("prompts: [hello, 3]\n", "prompts:"),
    ("max_new_tokens: -4\n", "max_new_tokens:"),
    ("grid: {k: 4}\n", "grid.k: a non-empty list"),
    ("grid: {k: [4, x]}\n", "grid.k[1]: k must be a positive integer"),
    ("grid: {schedule: [[cost]]}\n", "grid.schedule[0]: a single value"),
    ("grid: {drafter.colour: [red]}\n", "grid.drafter.colour"),
    ("grid: {pair: [qwen]}\n", "grid.pair[0]: axis 'pair' is not a config key"),
    ("grid: {pair: [{name: a, verifier.colour: 1}]}\n", "grid.pair[0].verifier.colour"),
    ("grid: {pair: [{name: a}]}\n", "grid.pair[0]: sets nothing"),
    ("grid: {pair: [{name: a, k: 2}, {name: a, k: 4}]}\n", "grid.pair: the value 'a' comes twice"),
    ("grid: {k: [2], drafter.num_draft_tokens: [4]}\n", "sets drafter.num_draft_tokens, as grid.k does"),
    ("grid: {k: [2\n", "not valid YAML"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("text", "message"), BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_a_bad_sweep_file_is_one_error_naming_the_key(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(sw.SweepError, match=None) as caught:
        sw.read_sweep(path)
    assert message in str(caught.value) and str(path) in str(caught.value)
    assert sw.main(["--sweep", str(path), "--dry-run"], prog="pipespec bench") == 2
    err = capsys.readouterr().err
    assert f"pipespec bench: {path}" in err and message in err and "Traceback" not in err


@pytest.mark.unit
def test_the_base_is_found_beside_the_sweep_file(tmp_path):
    (tmp_path / "mine.yaml").write_text("drafter: {type: prompt_lookup}\n", encoding="utf-8")
    sweep = sw.read_sweep(_write(tmp_path, {"base": "mine.yaml", "grid": {"k": [2]}}))
    assert sweep.base == str(tmp_path / "mine.yaml")
    (point,) = sw.expand(sweep)
    assert point.overrides["drafter.prompt_lookup_num_tokens"] == 2  # the base's type, seen by the k axis


def _record(index: int, target: str, tokens: list[list[int]], dtype: str = "float32") -> dict:
    metrics = {"drafts": 2, "draft_tokens": 8, "accepted_tokens": 6, "elapsed_s": 1.0, "verifier_busy_fraction": 0.5,
               "drafter_busy_fraction": 0.25, "verifier_dtype": dtype}
    return {"index": index, "label": f"p{index}", "axes": {"x": str(index)}, "status": "ok", "error": None,
            "target": target, "hardware": {"verifier": {"host": "h", "cpu": "c", "gpu": None, "threads": 2},
                                           "drafter": {"host": "h2", "cpu": "c", "gpu": "G", "threads": 1}},
            "per_prompt": [{"token_ids": t, "new_tokens": len(t), "time_s": 0.5, "metrics": metrics} for t in tokens]}


@pytest.mark.unit
def test_summary_reports_a_mismatch_against_the_first_point_of_the_same_target(tmp_path):
    report = {"meta": {}, "points": [
        _record(1, "a", [[1, 2, 3], [4, 5]]),
        _record(2, "a", [[1, 2, 3], [4, 6]]),  # prompt 2 differs from token 1
        _record(3, "b", [[9, 9], [9]]),  # another target: its own reference
        _record(4, "a", [[1, 2, 3], [4, 5]], dtype="bfloat16"),  # another dtype: its own reference
        _record(5, "a", [[1, 2, 3], [4, 5]]),
        {"index": 6, "label": "p6", "axes": {"x": "6"}, "status": "skipped", "error": "bad", "per_prompt": []}]}
    rows = sw.summarize(report)
    assert [r.get("mismatches") for r in rows] == ["ref", "1/2 vs #1", "ref", "ref", "0/2 vs #1", None]
    assert rows[1]["mismatch_detail"] == [{"prompt": 1, "first_diff": 1}]
    assert rows[0]["tokens_per_s"] == pytest.approx(5 / 1.0)
    assert rows[0]["alpha"] == pytest.approx(0.75) and rows[0]["tau"] == pytest.approx(4.0)
    assert rows[0]["k"] == pytest.approx(4.0) and rows[0]["verifier_busy"] == pytest.approx(0.5)
    report["meta"] = {"start": "2026-12-06T10:00:00+00:00", "end": None, "command": "pipespec bench --sweep s.yaml",
                      "sweep_file": "s.yaml", "base": "cpu.yaml", "set": {}, "command_set": {}, "prompts": [1, 2],
                      "max_new_tokens": 3, "warmup_tokens": 8, "axes": ["x"],
                      "machine": {"cpu": "c", "cores": 2, "logical_cpus": 2, "flags": {}, "gpu": None,
                                  "python": "3", "versions": {}}}
    report["rows"] = rows
    sw.write_markdown(tmp_path / "sweep.md", report)
    text = (tmp_path / "sweep.md").read_text()
    assert "| 2 | `2` | ok | 5.00 | 0.75 | 4.00 | 4.0 | 50% | 25% | h: c, 2 threads | h2: G, 1 thread | 1/2 vs #1 |" \
        in text
    assert "output differs from point 1 on prompt 2 from token 1" in text
    assert "point 6 (p6) skipped:" in text and "skipped (see notes)" in text


@pytest.mark.unit
def test_bench_hands_sweep_flags_over_and_ray_needs_ray(tmp_path, capsys, monkeypatch):
    from runtime import cli

    path = _write(tmp_path, {"grid": {"link_delay_ms": [0, 5]}})
    assert cli.main(["bench", "--sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("link_delay_ms=0: launch.link_delay_ms=0")
    assert "skipped: launch.link_delay_ms" in out.splitlines()[1]
    assert cli.main(["bench", "--ray", str(path), "--ray-address", "10.0.0.1:6379", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all("launch.backend=ray" in line and "launch.ray_address=10.0.0.1:6379" in line for line in lines)
    monkeypatch.setattr(sw.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else object())
    assert cli.main(["bench", "--ray", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'pipespec[ray]'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as caught:
        cli.main(["bench", "--sweep", str(path), "--ray-address", "x:1"])
    assert caught.value.code == 2


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_a_two_point_sweep_on_tiny_models_writes_table_json_and_plot(tiny, tmp_path):
    from benchmarks.prompts import chat_prompts
    from shared.models import load_tokenizer
    from testkit.tiny_models import reference_greedy

    target, drafter = tiny("llama"), tiny("llama", "random")
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump(tiny_config(target, drafter)), encoding="utf-8")
    prompts = ["def add(a, b):", "for i in range(10):"]
    spec = {"base": "tiny.yaml", "prompts": prompts, "max_new_tokens": 10,
            "grid": {"drafter.type": ["assistant", "prompt_lookup"], "link_delay_ms": [0, 3]}}
    out = tmp_path / "out"
    assert sw.main(["--sweep", str(_write(tmp_path, spec)), "--out", str(out)], prog="pipespec bench") == 0
    report = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in report["points"]] == ["ok", "skipped", "ok", "skipped"]
    ran = [p for p in report["points"] if p["status"] == "ok"]
    # greedy: both drafters give the target's own tokens, and the table says so from the token ids
    ids = [p["ids"] for p in chat_prompts(load_tokenizer(str(target)), [[{"role": "user", "content": t}]
                                                                        for t in prompts])]
    expected = [reference_greedy(target, x, 10, eos=[0]) for x in ids]
    for p in ran:
        assert [r["token_ids"] for r in p["per_prompt"]] == expected
        assert p["hardware"]["verifier"]["cpu"] and "drafter" in p["hardware"]
    assert [r.get("mismatches") for r in report["rows"]] == ["ref", None, "0/2 vs #1", None]
    assert report["rows"][0]["alpha"] is not None and report["rows"][0]["tokens_per_s"] > 0
    assert report["meta"]["git"] and report["meta"]["machine"] and report["meta"]["end"]
    text = (out / "sweep.md").read_text()
    assert "# pipespec sweep" in text and "command: `pipespec bench --sweep" in text
    assert "| 3 | `prompt_lookup` | `0` | ok |" in text and "0/2 vs #1" in text
    assert "points 2, 4 skipped:" in text and "launch.link_delay_ms: only the ray backend" in text
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
def test_a_point_that_fails_is_reported_the_next_runs_and_the_json_keeps_what_ran(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    seen_on_disk = []

    async def fake_run_point(sweep, point, record, messages, save):
        seen_on_disk.append([p["status"] for p in json.loads((out / "sweep.json").read_text())["points"]])
        if point.index == 2:
            raise RuntimeError("the verifier died\n--- end of verifier log ---\nboom")
        record |= {"target": "t", "hardware": {"verifier": {"host": "h", "cpu": "c", "gpu": None, "threads": 1}}}
        record["per_prompt"].append({"token_ids": [point.index], "new_tokens": 1, "time_s": 0.5,
                                     "metrics": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}})
        save()

    monkeypatch.setattr(sw, "run_point", fake_run_point)
    path = _write(tmp_path, {"prompts": ["hi"], "grid": {"k": [2, 3, 4]}})
    assert sw.main(["--sweep", str(path), "--out", str(out)]) == 1
    assert seen_on_disk == [["running", "pending", "pending"], ["ok", "running", "pending"],
                            ["ok", "failed", "running"]]
    report = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in report["points"]] == ["ok", "failed", "ok"]
    assert report["points"][1]["error"].startswith("RuntimeError: the verifier died")
    assert [r.get("mismatches") for r in report["rows"]] == ["ref", None, "1/1 vs #1"]  # different tokens: reported
    text = (out / "sweep.md").read_text()
    assert "failed (see notes)" in text and "boom" in text and (out / "sweep.png").exists()
    assert "point 2 (k=3) failed: the verifier died" in capsys.readouterr().err


@pytest.mark.unit
def test_the_documented_format_and_the_example_file_read_and_expand(tmp_path):
    import re
    import textwrap

    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "benchmarks.md").read_text(encoding="utf-8").split("## Sweeps", 1)[1]
    in_docs = re.search(r"```text\n(.*?)```", docs, re.S).group(1)
    in_module = textwrap.dedent(sw.__doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0])
    for i, text in enumerate([in_docs, in_module]):
        points = sw.expand(sw.read_sweep(_write(tmp_path, text, f"doc{i}.yaml")), {"launch.backend": "ray"})
        assert len(points) == 2 * 2 * 2 * 2 and all(p.error is None for p in points), [p.error for p in points]
    example = sw.read_sweep(root / "scripts" / "sweeps" / "example.yaml")
    assert sum(p.error is not None for p in sw.expand(example)) == 4  # the link delay points, process backend
    assert all(p.error is None for p in sw.expand(example, {"launch.backend": "ray"}))
