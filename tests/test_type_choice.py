"""``drafter.type: auto`` (the embedded default): llama.cpp's ``gguf`` where it runs on this CPU, else the torch
``assistant``, with the reason — checked against the real llama-cpp-python install, a missing one and a build that
crashes at its first forward (a fake ``llama_cpp`` package that dies with SIGSEGV, run in the probe's child)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from drafter_node import type_choice
from runtime.config import load_config

pytestmark = pytest.mark.unit

NAMED = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own: no probe outcome recorded yet."""
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.process
def test_a_real_llama_cpp_that_runs_is_chosen_and_its_probe_remembered(cache, monkeypatch):
    choice = type_choice.choose({"device": "cpu", "model": NAMED})
    assert choice.type == "gguf", choice.why
    assert "probe passed" in choice.why
    recorded = json.loads((cache / type_choice.PROBE_FILE).read_text())
    assert recorded["ok"] is True and recorded["key"] == type_choice.install_key(type_choice.llama_cpp_install())

    def no_second_probe(*args, **kwargs):
        raise AssertionError("the recorded outcome should have been used")

    monkeypatch.setattr(type_choice, "probe_llama_cpp", no_second_probe)
    assert type_choice.choose({"device": "cpu", "model": NAMED}).type == "gguf"


def test_without_llama_cpp_the_torch_assistant_drafts_and_says_why(cache, monkeypatch):
    monkeypatch.setattr(type_choice, "llama_cpp_install", lambda: None)
    choice = type_choice.choose({"device": "cpu", "model": NAMED})
    assert choice == type_choice.Choice("assistant", choice.why)
    assert "not installed" in choice.why and "make setup-gguf" in choice.why


@pytest.mark.process
def test_a_crashing_llama_cpp_build_falls_back_to_torch(cache, tmp_path, monkeypatch):
    """A build this CPU cannot run: the probe's child dies with SIGSEGV (as a native AMX build did on a KVM guest);
    the choice is the assistant, the signal is named, and the failure is remembered for this install."""
    fake = tmp_path / "fake"
    (fake / "llama_cpp").mkdir(parents=True)
    (fake / "llama_cpp" / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{':'.join(p for p in sys.path if p)}")
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    importlib.invalidate_caches()
    assert type_choice.llama_cpp_install() == fake / "llama_cpp"
    choice = type_choice.choose({"device": "cpu", "model": NAMED})
    assert choice.type == "assistant"
    assert "SIGSEGV" in choice.why, choice.why
    assert type_choice.cached_probe(fake / "llama_cpp")[0] is False


@pytest.mark.parametrize(("drafter", "expected"), [
    ({"device": "cuda", "model": NAMED}, "CPU-only"),
    ({"device": "cpu", "model": None}, "no draft model"),
])
def test_where_llama_cpp_does_not_apply_the_assistant_drafts(cache, drafter, expected):
    choice = type_choice.choose(drafter)
    assert choice.type == "assistant" and expected in choice.why


def test_a_torch_model_folder_is_drafted_in_torch(cache, tiny):
    folder = tiny("llama", "random")
    choice = type_choice.choose({"device": "cpu", "model": str(folder)})
    assert choice.type == "assistant" and "torch model" in choice.why


def test_the_default_config_resolves_auto_before_validating(cache, tiny):
    """cpu.yaml names ``auto``: a torch drafter folder loads as the assistant, with the reason kept for the start-up
    line; a config that names its type keeps it, with no reason."""
    from runtime.first_run import type_line

    target, drafter = tiny("llama", "target"), tiny("llama", "random")
    config = load_config("cpu.yaml", {"verifier.model": str(target), "drafter.model": str(drafter)})
    assert config["drafter"]["type"] == "assistant"
    assert config["drafter"]["type_reason"].startswith("auto: ")
    assert type_line(config).startswith("drafter type assistant (auto: ")
    named = load_config("cpu.yaml", {"drafter.type": "assistant", "verifier.model": str(target),
                                     "drafter.model": str(drafter)})
    assert named["drafter"]["type"] == "assistant" and named["drafter"]["type_reason"] == ""
