"""The llama-cpp-python build (scripts/build_llama_cpp.py) as a supply chain: the sdist pinned by SHA-256, a cached
wheel's SHA-256 stored beside it and checked before it is installed, a cache folder others can write refused.
pip is not run: ``run`` is replaced by a stand-in that writes what pip would (a download, a wheel)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture
def build(monkeypatch, tmp_path):
    """The build script as a module, its cache in ``tmp_path``, and pip's commands recorded (not run)."""
    spec = importlib.util.spec_from_file_location(
        "build_llama_cpp_under_test", Path(__file__).resolve().parent.parent / "scripts" / "build_llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(module, "cache_dir", lambda: cache / "wheels")
    module.commands = []
    module.sdist_bytes = b"the real sdist"

    def fake_run(cmd, env=None):
        module.commands.append(cmd)
        if cmd[3] == "download":
            Path(cmd[cmd.index("-d") + 1], "llama_cpp_python-0.3.36.tar.gz").write_bytes(module.sdist_bytes)
        elif cmd[3] == "wheel":
            Path(cmd[cmd.index("-w") + 1], "llama_cpp_python-0.3.36-cp311-linux_x86_64.whl").write_bytes(b"wheel")

    monkeypatch.setattr(module, "run", fake_run)
    import hashlib

    monkeypatch.setattr(module, "SDIST_SHA256", hashlib.sha256(b"the real sdist").hexdigest())
    return module


@pytest.mark.unit
def test_the_pin_is_a_sha256_of_this_version(build):
    source = Path(build.__file__).read_text()
    assert 'VERSION = "0.3.36"' in source and 'SDIST_SHA256 = "832db069' in source


@pytest.mark.unit
def test_a_wheel_is_built_from_the_checked_sdist_and_its_hash_stored(build):
    options = build.ggml_options({"avx2"})
    wheel = build.build_wheel(options)
    record = wheel.with_name(wheel.name + ".sha256")
    assert record.read_text().split() == [build.sha256_of(wheel), wheel.name]
    wheel_cmd = next(c for c in build.commands if c[3] == "wheel")
    assert wheel_cmd[-1].endswith("llama_cpp_python-0.3.36.tar.gz")  # built from the file whose hash was checked
    assert build.build_wheel(options) == wheel and sum(c[3] == "wheel" for c in build.commands) == 1  # reused


@pytest.mark.unit
def test_an_sdist_with_another_hash_is_refused(build):
    build.sdist_bytes = b"a swapped sdist"
    with pytest.raises(SystemExit, match="not the pinned"):
        build.build_wheel(build.ggml_options(set()))
    assert not any(c[3] == "wheel" for c in build.commands)


@pytest.mark.unit
def test_an_altered_cached_wheel_is_refused_and_one_without_a_record_rebuilt(build):
    options = build.ggml_options(set())
    wheel = build.build_wheel(options)
    wheel.write_bytes(b"tampered")
    with pytest.raises(SystemExit, match="altered"):
        build.build_wheel(options)
    wheel.with_name(wheel.name + ".sha256").unlink()  # no record: not known to be ours
    again = build.build_wheel(options)
    assert again.read_bytes() == b"wheel" and sum(c[3] == "wheel" for c in build.commands) == 2


@pytest.mark.unit
def test_a_cache_folder_others_can_write_is_refused(build, tmp_path):
    wheels = build.cache_dir()
    wheels.mkdir(mode=0o700)
    os.chmod(wheels, 0o777)
    with pytest.raises(SystemExit, match="writable by group or others"):
        build.build_wheel(build.ggml_options(set()))
    os.chmod(wheels, 0o755)
    assert build.private_dir_problem(wheels) is None
    os.chmod(wheels.parent, 0o775)
    assert "chmod go-w" in build.private_dir_problem(wheels.parent)
