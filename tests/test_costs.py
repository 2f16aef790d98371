"""Cost profiles (shared/costs/) and the profiling CLI (runtime/profile.py), on tiny models: curve arithmetic,
online refinement, validation of dicts from peers, measuring within a budget, the disk cache, ``dtype: auto``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig

from runtime import profile as profile_cli
from runtime.config import load_config
from shared.costs import cache, dtype_choice, hardware
from shared.costs import measure as measuring
from shared.costs.curve import CostCurve, NodeProfile, verify_score
from shared.models import DTYPES, load_causal_lm

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test gets its own profile cache (never ~/.cache)."""
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PIPESPEC_PROFILE_DIR", raising=False)  # conftest points nodes elsewhere
    return tmp_path / "cache" / "profiles"


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Profiles measured here count as taken on a quiet machine (other jobs may run beside the tests; the one test
    of a busy machine sets its own readings)."""
    monkeypatch.setattr(measuring, "_cpu_times", lambda: (0.0, 0.0))


def curve(sizes=(1, 4, 8), seconds=(0.010, 0.020, 0.040), prefix=64, slope=0.0) -> CostCurve:
    return CostCurve(list(sizes), list(seconds), prefix, slope)


# ------------------------------------------------------------------------------------------ CostCurve arithmetic


def test_cost_interpolates_between_points_and_extends_the_last_segment():
    c = curve()
    assert c.cost(0) == 0.0
    assert c.cost(1) == pytest.approx(0.010)
    assert c.cost(2) == pytest.approx(0.010 + 0.010 / 3)
    assert c.cost(6) == pytest.approx(0.030)
    assert c.cost(8) == pytest.approx(0.040)
    assert c.cost(12) == pytest.approx(0.040 + 4 * 0.005)  # the last segment's slope, 5 ms per token
    below = curve(sizes=(3, 6), seconds=(0.02, 0.03))
    assert below.cost(1) == pytest.approx(0.02)


def test_cost_never_decreases_beyond_the_last_point():
    noisy = curve(seconds=(0.010, 0.030, 0.025))
    assert noisy.cost(20) == pytest.approx(0.025)
    single = curve(sizes=(1,), seconds=(0.01,))
    assert single.cost(5) == pytest.approx(0.01)


def test_context_term_and_its_floor():
    c = curve(slope=1e-5)
    assert c.cost(1) == pytest.approx(0.010)
    assert c.cost(1, context=64) == pytest.approx(0.010)
    assert c.cost(1, context=164) == pytest.approx(0.010 + 100e-5)
    assert c.cost(4, context=0) == pytest.approx(0.020 - 64e-5)
    steep = curve(slope=1e-3)
    assert steep.cost(1, context=0) == pytest.approx(0.005)  # 0.010 − 0.064 would be negative: floored at 50 %
    assert steep.cost(0, context=1000) == 0.0


# ------------------------------------------------------------------------------------------ observe


def test_observe_moves_a_measured_point_by_the_weight():
    c = curve()
    c.observe(4, 0.030)
    assert c.seconds == pytest.approx([0.010, 0.022, 0.040])
    c.observe(4, 0.030, weight=1.0)
    assert c.seconds[1] == pytest.approx(0.030)


def test_observe_inserts_an_unmeasured_size_in_order():
    c = curve()
    c.observe(6, 0.050, weight=0.5)  # the curve said 30 ms at 6: halfway to 50 ms
    assert c.sizes == [1, 4, 6, 8]
    assert c.seconds[2] == pytest.approx(0.040)
    c.observe(20, 0.1, weight=0.5)
    assert c.sizes == [1, 4, 6, 8, 20]


def test_observe_removes_the_context_term_first():
    c = curve(slope=1e-5)
    c.observe(1, 0.021, context=164, weight=0.5)  # 1 ms of it is the 100 extra context tokens
    assert c.seconds[0] == pytest.approx(0.015)


@pytest.mark.parametrize(("context", "sample"), [(None, 0.012), (0, 0.004), (10, 0.012), (64, 0.012), (500, 0.5)])
def test_observe_with_full_weight_reproduces_the_sample(context, sample):
    """observe inverts cost(): afterwards the curve predicts exactly what was seen, with or without the floor (at
    contexts 0 and 10 the 1 ms/token slope would go negative: the sample is the floored cost)."""
    c = curve(slope=1e-3)
    c.observe(4, sample, context=context, weight=1.0)
    assert c.cost(4, context=context) == pytest.approx(sample)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -0.01, "0.1", None])
def test_observe_ignores_unusable_samples(bad):
    c = curve()
    before = c.to_dict()
    c.observe(4, bad)
    c.observe(0, 0.01)
    assert c.to_dict() == before


def test_observe_keeps_at_most_32_points():
    c = curve(sizes=(1, 2), seconds=(0.01, 0.011))
    for n in range(3, 60):
        c.observe(n, 0.01 + 0.001 * n, weight=1.0)
    assert len(c.sizes) <= 32
    assert c.sizes == sorted(set(c.sizes))
    assert c.sizes[0] == 1 and c.sizes[-1] == 59  # the ends survive: only interior points are dropped


# ------------------------------------------------------------------------------------------ dicts from peers


def test_curve_and_profile_round_trip_through_json():
    c = curve(slope=2e-6)
    assert CostCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    p = NodeProfile("m", "cpu", "bfloat16", {1: c, 2: curve(seconds=(0.005, 0.01, 0.02))}, measured_s=3.5,
                    candidates={"float32": 0.02, "bfloat16": 0.015})
    back = NodeProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p
    assert sorted(back.curves) == [1, 2]


GOOD = {"sizes": [1, 2], "seconds": [0.01, 0.02], "prefix_len": 64, "per_context_token_s": 0.0}


@pytest.mark.parametrize("change", [
    {"sizes": ["1", "2"]},
    {"sizes": [True, 2]},
    {"sizes": [1.5, 2]},
    {"sizes": [0, 2]},
    {"sizes": [1, 5000]},
    {"sizes": [2, 1]},
    {"sizes": [1, 1]},
    {"sizes": [1]},
    {"sizes": "1,2"},
    {"sizes": []},
    {"sizes": list(range(1, 66)), "seconds": [0.01] * 65},
    {"seconds": [0.01, math.nan]},
    {"seconds": [0.01, math.inf]},
    {"seconds": [0.01, -0.02]},
    {"seconds": [0.0, 0.02]},
    {"seconds": [0.01, 4000.0]},
    {"seconds": ["0.01", 0.02]},
    {"prefix_len": -1},
    {"prefix_len": "64"},
    {"prefix_len": None},
    {"per_context_token_s": -1e-6},
    {"per_context_token_s": math.nan},
])
def test_curve_from_dict_rejects_bad_fields(change):
    with pytest.raises(ValueError, match="cost curve"):
        CostCurve.from_dict({**GOOD, **change})


@pytest.mark.parametrize("bad", [None, [], "curve", 3])
def test_curve_from_dict_rejects_non_mappings(bad):
    with pytest.raises(ValueError, match="must be a mapping"):
        CostCurve.from_dict(bad)


PROFILE = {"model": "m", "device": "cpu", "dtype": "float32", "curves": {"1": GOOD}, "measured_s": 1.0,
           "cached": False, "candidates": {}}


@pytest.mark.parametrize("change", [
    {"dtype": "auto"},
    {"dtype": "float64"},
    {"model": ""},
    {"model": 7},
    {"model": "x" * 1000},
    {"curves": {}},
    {"curves": [GOOD]},
    {"curves": {str(t): GOOD for t in range(1, 10)}},
    {"curves": {"-1": GOOD}},
    {"curves": {"abc": GOOD}},
    {"curves": {"2000": GOOD}},
    {"curves": {"1": {**GOOD, "seconds": [0.01, math.nan]}}},
    {"measured_s": -1.0},
    {"cached": "yes"},
    {"candidates": {"float32": math.nan}},
    {"candidates": {"int8": 0.1}},
    {"candidates": [0.1]},
])
def test_profile_from_dict_rejects_bad_fields(change):
    with pytest.raises(ValueError, match=r"node profile|cost curve"):
        NodeProfile.from_dict({**PROFILE, **change})


def test_profile_curve_picks_the_nearest_thread_count():
    one, four = curve(), curve(seconds=(0.005, 0.01, 0.02))
    p = NodeProfile("m", "cpu", "float32", {1: one, 4: four})
    assert p.curve(1) is one and p.curve(4) is four
    assert p.curve(2) is one and p.curve(3) is four and p.curve(16) is four
    tie = NodeProfile("m", "cpu", "float32", {1: one, 3: four})
    assert tie.curve(2) is one


# ------------------------------------------------------------------------------------------ measuring


def test_shape_first_order_measures_the_ends_then_the_middles():
    order = measuring._shape_first_order([1, 2, 3, 4, 6, 8, 12, 17])
    assert order[:3] == [1, 17, 8]
    assert sorted(order) == [1, 2, 3, 4, 6, 8, 12, 17]


def test_sizes_up_to():
    assert measuring.sizes_up_to(17) == [1, 2, 3, 4, 6, 8, 12, 16, 17]
    assert measuring.sizes_up_to(9) == [1, 2, 3, 4, 6, 8, 9]
    assert measuring.sizes_up_to(1) == [1]


@pytest.fixture(scope="module")
def llama(tiny):
    path = tiny("llama")
    return path, load_causal_lm(str(path), "cpu", "float32")


def test_measure_curve_on_a_tiny_model(llama):
    _, model = llama
    requested = [1, 2, 4, 8]
    c = measuring.measure_curve(model, requested, prefix_len=16, budget_s=2.0)
    assert set(c.sizes) <= set(requested) and 1 in c.sizes
    assert all(math.isfinite(s) and s > 0 for s in c.seconds)
    assert c.prefix_len == 16 and c.per_context_token_s >= 0
    assert CostCurve.from_dict(c.to_dict()) == c  # what it measures passes a peer's validation


def test_measure_curve_with_no_budget_measures_the_first_size_only(llama):
    _, model = llama
    c = measuring.measure_curve(model, [2, 3, 5], prefix_len=8, budget_s=0.0)
    assert c.sizes == [2]
    assert c.per_context_token_s == 0.0
    assert c.cost(5) == pytest.approx(c.seconds[0])


def test_load_or_measure_caches_and_the_key_separates_thread_counts(llama, cache_dir):
    path, model = llama
    threads_before = torch.get_num_threads()
    lines = []
    first = measuring.load_or_measure(model, str(path), "cpu", "float32", [1], [1, 2, 4], budget_s=1.0,
                                  progress=lines.append)
    assert not first.cached and sorted(first.curves) == [1]
    assert any("1 thread" in line and "ms" in line for line in lines)
    assert len(list(cache_dir.glob("*.json"))) == 1
    # A hit must not touch the model: with None in its place, measuring would fail.
    again = measuring.load_or_measure(None, str(path), "cpu", "float32", [1], [1, 2, 4], budget_s=1.0)
    assert again.cached and again.curves == first.curves
    other = measuring.load_or_measure(model, str(path), "cpu", "float32", [2], [1, 2, 4], budget_s=1.0)
    assert not other.cached and sorted(other.curves) == [2]
    assert len(list(cache_dir.glob("*.json"))) == 2
    assert torch.get_num_threads() == threads_before


def test_a_corrupt_cache_file_is_measured_again_and_overwritten(llama, cache_dir):
    path, model = llama
    args = (str(path), "cpu", "float32", [1], [1, 2])
    measuring.load_or_measure(model, *args, budget_s=0.5)
    (file,) = cache_dir.glob("*.json")
    file.write_text('{"key": "', encoding="utf-8")
    redone = measuring.load_or_measure(model, *args, budget_s=0.5)
    assert not redone.cached
    assert json.loads(file.read_text(encoding="utf-8"))["key"] == file.stem
    assert measuring.load_or_measure(None, *args, budget_s=0.5).cached


def test_profile_key_changes_with_what_changes_the_numbers(tiny, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny("llama"), folder)
    base = cache.profile_key(str(folder), "cpu", "float32", [1, 2], [1, 2, 4])
    assert cache.profile_key(str(folder), "cpu", "float32", [2, 1, 2], [4, 2, 1]) == base  # order-free
    for other in (cache.profile_key(str(folder), "cpu", "bfloat16", [1, 2], [1, 2, 4]),
                  cache.profile_key(str(folder), "cpu", "float32", [1], [1, 2, 4]),
                  cache.profile_key(str(folder), "cpu", "float32", [1, 2], [1, 2]),
                  cache.profile_key(str(folder), "cpu", "float32", [1, 2], [1, 2, 4], variant="early_exit:1")):
        assert other != base
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    (folder / "config.json").write_text(json.dumps(config))
    assert cache.profile_key(str(folder), "cpu", "float32", [1, 2], [1, 2, 4]) != base


def test_resolve_auto_dtype_on_cpu_measures_both_then_loads_only_the_winner(tiny):
    path = str(tiny("llama"))
    loads = []

    def load(dtype):
        loads.append(dtype)
        return load_causal_lm(path, "cpu", dtype)

    model, profile = dtype_choice.resolve_auto_dtype(load, path, "cpu", [1], [1, 2, 4], budget_s=1.0)
    assert sorted(loads[:2]) == ["bfloat16", "float32"] and len(loads) <= 3  # a third load: the winner again
    assert set(profile.candidates) == {"float32", "bfloat16"}
    assert profile.dtype == min(profile.candidates, key=profile.candidates.get)
    assert {p.dtype for p in model.parameters()} == {DTYPES[profile.dtype]}
    del model
    loads.clear()
    model, again = dtype_choice.resolve_auto_dtype(load, path, "cpu", [1], [1, 2, 4], budget_s=1.0)
    assert loads == [profile.dtype]  # both profiles cached: only the winner is loaded
    assert again.cached and again.dtype == profile.dtype and again.candidates == profile.candidates
    assert {p.dtype for p in model.parameters()} == {DTYPES[profile.dtype]}


def test_resolve_auto_dtype_with_a_probe_loads_the_whole_model_once(tiny):
    """Peak memory: the candidates are measured on the cut model, and only the winner is ever loaded whole."""
    from shared.models import probe_config

    path = str(tiny("llama"))
    cut = probe_config(path)
    assert cut is None  # two layers: too shallow to cut; a deeper copy of its config is
    deep = AutoConfig.from_pretrained(path)
    deep.num_hidden_layers = 8
    cut = probe_config(path, deep)
    assert cut.num_hidden_layers == 2 and deep.num_hidden_layers == 8  # the given config is left as it was
    whole, probes = [], []

    def load(dtype):
        whole.append(dtype)
        return load_causal_lm(path, "cpu", dtype)

    def load_probe(dtype):
        probes.append(dtype)
        return load_causal_lm(path, "cpu", dtype, config=cut)

    model, profile = dtype_choice.resolve_auto_dtype(load, path, "cpu", [1], [1, 2, 4], budget_s=1.0,
                                                     load_probe=load_probe)
    assert sorted(probes) == ["bfloat16", "float32"] and whole == [profile.dtype]
    assert profile.dtype == min(profile.candidates, key=profile.candidates.get)
    assert {p.dtype for p in model.parameters()} == {DTYPES[profile.dtype]}
    assert model.config.num_hidden_layers == 2  # the whole model
    assert dtype_choice.dtype_reason(profile).startswith(f"dtype auto: measured faster here, {profile.dtype} ")
    probes.clear()
    whole.clear()
    dtype_choice.resolve_auto_dtype(load, path, "cpu", [1], [1, 2, 4], budget_s=1.0, load_probe=load_probe)
    assert probes == [] and whole == [profile.dtype]  # the probes' profiles are cached


def test_hardware_description():
    flags = hardware.hardware_flags()
    assert set(flags) == {"avx2", "avx512_bf16", "amx", "gpu"}
    assert all(isinstance(flags[k], bool) for k in ("avx2", "avx512_bf16", "amx"))
    assert isinstance(hardware.cpu_model_name(), str) and hardware.cpu_model_name()


# ------------------------------------------------------------------------------------------ CLI


def _write_config(tmp_path: Path, verifier: Path, drafter: Path | None, threads: int | str = 1,
                  **drafter_keys) -> Path:
    config = {"verifier": {"model": str(verifier), "dtype": "float32", "threads": threads},
              "drafter": {"model": str(drafter) if drafter else None, "dtype": "float32", "threads": threads,
                          "max_draft_tokens": 3, **drafter_keys}}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIPESPEC_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("PIPESPEC_PROFILE_DIR", None)
    return subprocess.run([sys.executable, "-m", "runtime.profile", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


@pytest.mark.process
def test_cli_profiles_both_nodes_and_writes_json_and_png(tiny, tmp_path):
    config = _write_config(tmp_path, tiny("llama"), tiny("llama", "random"), threads="auto", dtype="auto")
    out = tmp_path / "out"
    result = _cli("--config", str(config), "--out", str(out), "--budget", "4", cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "profiling" in result.stderr
    table = result.stdout
    assert "1 tok" in table and "4 tok" in table and "avx512_bf16" in table
    assert "verifier dtype float32 (explicit)" in table
    assert "drafter dtype auto →" in table and "bfloat16" in table
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "profile.json").read_text())
    verifier = NodeProfile.from_dict(report["nodes"]["verifier"]["profile"])
    drafter = NodeProfile.from_dict(report["nodes"]["drafter"]["profile"])
    assert verifier.dtype == "float32" and verifier.candidates == {}
    assert set(drafter.candidates) == {"float32", "bfloat16"}
    assert report["nodes"]["verifier"]["sizes"] == [1, 2, 3, 4]
    cores = len(os.sched_getaffinity(0))
    assert sorted(verifier.curves) == sorted({max(1, cores // 2), cores})  # threads: auto: its share and every core


@pytest.mark.process
def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    config = _write_config(tmp_path, tmp_path / "missing-model", None)
    result = _cli("--config", str(config), "--out", str(tmp_path / "out"), cache=tmp_path / "cache")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile: error: verifier.model")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "verifier.dtype=float64"], "verifier.dtype"),
    (["--set", "drafter.nope=1"], "drafter.nope"),
    (["--budget", "0"], "--budget"),
])
def test_cli_rejects_bad_settings(tiny, tmp_path, capsys, args, message):
    config = _write_config(tmp_path, tiny("llama"), tiny("llama", "random"))
    assert profile_cli.main(["--config", str(config), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("profile: error:") and message in err[0]


def test_auto_dtype_from_the_file_or_an_override(tiny, tmp_path):
    config = _write_config(tmp_path, tiny("llama"), tiny("llama", "random"), dtype="auto")
    loaded = load_config(str(config))
    assert loaded["drafter"]["dtype"] == "auto" and loaded["verifier"]["dtype"] == "float32"
    loaded = load_config(str(config), ["drafter.dtype=bfloat16", "verifier.dtype=auto"])
    assert loaded["drafter"]["dtype"] == "bfloat16" and loaded["verifier"]["dtype"] == "auto"


def test_plan_profiles_early_exit_cut_and_skips_prompt_lookup(tiny, tmp_path):
    target = tiny("llama")
    config = load_config({"verifier": {"model": str(target)},
                          "drafter": {"type": "early_exit", "assistant_early_exit": 1, "max_draft_tokens": 3}})
    nodes, skipped = profile_cli.plan_nodes(config)
    assert skipped is None and [n.role for n in nodes] == ["verifier", "drafter"]
    assert nodes[1].model_config.num_hidden_layers == 1 and nodes[1].variant == "early_exit:1"
    assert nodes[1].label == f"{target.name} (first 1 layers)"
    config = load_config({"verifier": {"model": str(target)}, "drafter": {"type": "prompt_lookup"}})
    nodes, skipped = profile_cli.plan_nodes(config)
    assert [n.role for n in nodes] == ["verifier"] and "prompt_lookup" in skipped


def test_plan_reads_what_to_profile_off_the_types_spec(tiny, monkeypatch):
    """A type's spec says whether and how its model is profiled; runtime/profile.py names no type."""
    from drafter_node.spec import DrafterSpec
    from drafter_node.types import DRAFTER_TYPES, drafter_spec
    from testkit.fake_types import register_type

    target, drafter = tiny("llama"), tiny("llama", "random")
    config = {"verifier": {"model": str(target)}, "drafter": {"type": "toy", "model": str(drafter)}}
    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy", profile_skip="toy is not profiled"))
    nodes, skipped = profile_cli.plan_nodes(load_config(config))
    assert [n.role for n in nodes] == ["verifier"] and skipped == "toy is not profiled"
    seen = []

    def reshape(d, path):
        seen.append((d["type"], path))
        return AutoConfig.from_pretrained(path), "reshaped"

    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy", profile_model=reshape,
                                           profile_variant=lambda settings, own: f"toy:{settings.max_draft_tokens}"))
    nodes, skipped = profile_cli.plan_nodes(load_config(config))
    assert skipped is None and seen == [("toy", str(drafter))]
    assert nodes[1].label == f"{drafter.name} (reshaped)" and nodes[1].variant.startswith("toy:")
    assert nodes[1].model_config.num_hidden_layers == AutoConfig.from_pretrained(drafter).num_hidden_layers

    def refuse(d, path):
        raise ValueError("drafter.model: not a toy checkpoint")

    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy", profile_model=refuse))
    with pytest.raises(profile_cli.ConfigError, match=r"drafter\.model: not a toy checkpoint"):
        profile_cli.plan_nodes(load_config(config))
    config["drafter"]["type"] = "assistant"  # a plain causal LM: its own label, no variant
    nodes, skipped = profile_cli.plan_nodes(load_config(config))
    assert skipped is None and (nodes[1].label, nodes[1].model_config, nodes[1].variant) == (drafter.name, None, "")
    for name in ("mtp", "mtp_drafter"):
        assert "not profiled" in drafter_spec(name).profile_skip
    text = Path(profile_cli.__file__).read_text(encoding="utf-8")
    assert [name for name in DRAFTER_TYPES if name != "toy" and f'"{name}"' in text] == []


def test_verify_score_prefers_the_dtype_fast_at_its_best_shape():
    # emulated bf16 on two cores: one token at every core is cheap, blocks are dear; fp32: flat-ish but slow
    bf16 = NodeProfile("m", "cpu", "bfloat16", {1: CostCurve([1, 8], [0.40, 2.50], 64),
                                                2: CostCurve([1, 8], [0.22, 1.26], 64)})
    fp32 = NodeProfile("m", "cpu", "float32", {1: CostCurve([1, 8], [0.43, 1.39], 64),
                                               2: CostCurve([1, 8], [0.41, 1.35], 64)})
    sizes = [1, 2, 4, 8]
    assert verify_score(bf16, sizes) < verify_score(fp32, sizes)
    assert abs(verify_score(bf16, [1]) - 0.22) < 1e-9  # k = 0 at every core


def test_a_thread_count_the_budget_cut_short_takes_the_shape_of_the_richest():
    measured = {1: {1: 0.4, 9: 3.0}, 2: {1: 0.3}}
    measuring.fill_from_richest(measured)
    assert measured[2] == {1: 0.3, 9: 0.3 * 3.0 / 0.4}
    assert measured[1] == {1: 0.4, 9: 3.0}


def test_observe_counts_one_slow_sample_as_at_most_twice_the_estimate():
    c = curve()
    c.observe(4, 1.0)  # 50x the 0.02 s estimate: a forward that shared the cores with a prefill
    assert c.seconds[1] == pytest.approx(0.020 + 0.2 * (2 * 0.020 - 0.020))
    for _ in range(30):  # a lasting slowdown still moves it all the way
        c.observe(4, 0.1)
    assert c.seconds[1] == pytest.approx(0.1, rel=0.01)


def test_a_busy_measurement_is_repeated_and_not_reused_from_the_cache(llama, cache_dir, monkeypatch):
    path, model = llama
    readings = {"others": 0.0}

    def busy_times():  # between any two readings other processes used a core-second more than this one
        readings["others"] += 1.0
        return readings["others"] + 1e6, 0.0

    def measure(progress=None):
        return measuring.load_or_measure(model, str(path), "cpu", "float32", [1], [1, 2], budget_s=0.5,
                                         progress=progress)

    monkeypatch.setattr(measuring, "_cpu_times", busy_times)
    monkeypatch.setattr(measuring, "BUSY_RETRY_PAUSE_S", 0.0)
    lines: list[str] = []
    busy = measure(lines.append)
    assert not busy.quiet and any("busy" in line for line in lines) and any("next start" in line for line in lines)
    assert not measure().cached, "a busy profile is measured again at the next start"
    monkeypatch.setattr(measuring, "_cpu_times", lambda: (0.0, 0.0))  # a quiet machine
    quiet = measure()
    assert quiet.quiet and not quiet.cached
    cached = measure()
    assert cached.cached and cached.key == quiet.key
    assert cache.mark_stale(cached.key)  # a node's rounds found it wrong: measured again next time
    assert not measure().cached


def test_curve_check_flags_a_profile_its_forwards_keep_missing():
    from shared.costs.cache import CurveCheck

    ok = CurveCheck()
    assert all(ok.observe(0.010, 0.011) is None for _ in range(64))
    off = CurveCheck()
    verdicts = [off.observe(0.010, 0.020 if i % 4 else 0.010) for i in range(40)]
    flagged = [v for v in verdicts if v is not None]
    assert len(flagged) == 1 and flagged[0] == pytest.approx(2.0)  # once, with the median ratio


def test_measured_points_never_fall_with_more_tokens():
    assert measuring.nondecreasing([0.258, 0.290, 0.691, 0.302]) == [0.258, 0.290, 0.302, 0.302]
    assert measuring.nondecreasing([0.1, 0.2, 0.3]) == [0.1, 0.2, 0.3]


def test_the_curve_type_loads_without_torch():
    """shared.costs.curve is the type the wire and the cost model need; measuring (torch) lives beside it."""
    code = "import sys, shared.costs.curve\nassert 'torch' not in sys.modules, 'shared.costs.curve imported torch'"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_context_slope_is_a_median_of_back_to_back_pairs(monkeypatch):
    """One long-prefix forward caught in a host's slow-down must not become the context cost (the 5.3 ms per cached
    token of a 0.5B drafter that priced every drafting plan out on a 2-core Xeon): pairs, each short and long back to
    back, and the median of their differences."""
    from shared.costs import measure

    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    class FakeLM:
        def __init__(self, length: int, costs: list[float]):
            self.length, self.costs = length, costs

        def feed(self, ids: list[int]) -> None:
            clock[0] += self.costs.pop(0)
            self.length += len(ids)

        def crop(self, keep: int) -> None:
            self.length = keep

    short = FakeLM(16, [0.100, 0.100, 0.100])
    long = FakeLM(64, [0.101, 0.500, 0.1012])  # the second long forward hit a slow-down
    slope = measure._context_slope(short, long, [7], lambda: None)
    assert slope == pytest.approx(0.0012 / 48)  # the median of 1 ms, 400 ms and 1.2 ms
    assert short.length == 16 and long.length == 64  # both caches back where they were
    assert measure._context_slope(FakeLM(16, [0.1] * 3), FakeLM(64, [0.09] * 3), [7], lambda: None) == 0.0
