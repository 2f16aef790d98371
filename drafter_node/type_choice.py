"""``drafter.type: auto``: the fastest drafter this host can run for the configured model, with the reason.

The embedded default (``configs/cpu.yaml``) names ``auto``. The config loader resolves it before anything else is
checked, on the host that loads the config:

* ``gguf`` (the draft model's GGUF in llama.cpp) where llama-cpp-python is installed, the llama.cpp probe passed on
  this CPU (one forward of a tiny GGUF in a child process, so a build that dies with SIGILL or SIGSEGV is caught),
  the drafter runs on the CPU and its model is a named model or a ``.gguf`` file. llama.cpp's step of the 0.5B is
  2.4-2.8x torch's on every CPU measured (docs/drafter-types.md), so where it runs it is the faster drafter;
* else ``assistant`` (the same model in torch), with what stood in the way (not installed, probe failed, a model
  folder that is no GGUF, a GPU drafter).

The probe's outcome is cached per llama-cpp-python install (its files' sizes and times) and CPU in the cache folder
(``llama_cpp_probe.json``), written by ``scripts/build_llama_cpp.py --probe`` (``make setup``) or by the first load
that needs it, so a config load costs a file read. Nothing here imports torch or llama.cpp.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTO = "auto"
#: The probe's child processes (building the tiny GGUF, then one forward) are each bounded by this.
PROBE_TIMEOUT_S = 300.0
PROBE_FILE = "llama_cpp_probe.json"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` resolved to, and why (one clause, shown at start-up)."""

    type: str
    why: str


def _cache_file() -> Path:
    from shared.named_models import cache_root

    return cache_root() / PROBE_FILE


def llama_cpp_install() -> Path | None:
    """The installed llama_cpp package's folder, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)  # a namespace package (or a stand-in) has none
    if not isinstance(origin, str) or not origin:
        return None
    return Path(origin).parent


def install_key(package: Path) -> str:
    """Identifies one build of llama-cpp-python on one CPU: the package's files (names, sizes, times) and the
    CPU's flags, so a rebuild, a reinstall or a move to another machine kind probes again."""
    h = hashlib.sha256(str(package.resolve()).encode())
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".so", ".dylib") or ".so." in path.name:
            with contextlib.suppress(OSError):
                st = path.stat()
                h.update(f"{path.relative_to(package)}:{st.st_size}:{st.st_mtime_ns}".encode())
    with contextlib.suppress(OSError):
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
        h.update(flags.encode())
    return h.hexdigest()[:32]


def cached_probe(package: Path) -> tuple[bool, str] | None:
    """The recorded probe outcome of this install on this CPU, or None (never probed, or another install)."""
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != install_key(package) or not isinstance(data.get("ok"), bool):
        return None
    return data["ok"], str(data.get("message", ""))


def record_probe(package: Path, ok: bool, message: str) -> None:
    """Remember a probe's outcome for this install (atomically; a cache that cannot be written only costs a probe
    at the next load)."""
    path = _cache_file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": install_key(package), "ok": ok, "message": message[-2000:]}),
                       encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def probe_llama_cpp(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Run llama.cpp once on this CPU, in child processes: write a tiny Qwen2 as GGUF, then one forward of it
    (``python -m drafter_node.gguf --check``). (True, its output) or (False, what happened); recorded in the cache."""
    from drafter_node.gguf_check import run_probe

    package = llama_cpp_install()
    if package is None:
        return False, "llama-cpp-python is not installed"
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="pipespec-gguf-probe-") as tmp:
        build = (
            "import sys; from pathlib import Path; from testkit.tiny_models import build_tokenizer, build_model; "
            "from testkit.tiny_gguf import write_qwen2_gguf; d = Path(sys.argv[1]); build_tokenizer(d / 'tok'); "
            "build_model(d / 'm', 'qwen2', d / 'tok', seed=1); write_qwen2_gguf(d / 'm', d / 'probe.gguf')")
        try:
            made = subprocess.run([sys.executable, "-c", build, tmp], cwd=root, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"writing the probe's tiny GGUF did not finish in {timeout_s:.0f} s"
        if made.returncode != 0:  # not llama.cpp's fault: not recorded, so the next load tries again
            return False, f"could not write the probe's tiny GGUF: {made.stderr.strip()[-500:]}"
        ok, message = run_probe([sys.executable, "-m", "drafter_node.gguf", "--in-process", "--check",
                                 str(Path(tmp) / "probe.gguf")], timeout_s)
    record_probe(package, ok, message)
    return ok, message


def _gguf_model(model: Any) -> str | None:
    """Why ``model`` cannot be drafted from as a GGUF file, or None (a named model: its GGUF is installed as it
    is; or a readable file with the GGUF magic)."""
    from drafter_node.type_specs.gguf import gguf_file_problem
    from shared.named_models import NAMED_MODELS

    if not isinstance(model, str) or not model:
        return "no draft model is named"
    if model in NAMED_MODELS:
        return None
    problem = gguf_file_problem(model)
    return None if problem is None else f"the draft model {model!r} is a torch model ({problem})"


def choose(drafter: Mapping[str, Any], probe: bool = True) -> Choice:
    """Resolve ``auto`` for the validated-to-be ``drafter`` section. ``probe``: run llama.cpp's probe when this
    install has none recorded (False: treat an unprobed install as unusable)."""
    fallback = "assistant"
    if drafter.get("device") not in (None, "cpu"):
        return Choice(fallback, f"the drafter runs on {drafter['device']} (llama.cpp's build here is CPU-only)")
    problem = _gguf_model(drafter.get("model"))
    if problem is not None:
        return Choice(fallback, problem)
    package = llama_cpp_install()
    if package is None:
        return Choice(fallback, "llama-cpp-python is not installed (make setup-gguf builds it for the host CPU)")
    outcome = cached_probe(package)
    if outcome is None and probe:
        print("[pipespec] drafter.type auto: probing llama.cpp once (one forward of a tiny model) ...",
              file=sys.stderr, flush=True)
        outcome = probe_llama_cpp()
    if outcome is None:
        return Choice(fallback, "llama.cpp was not probed here (scripts/build_llama_cpp.py --probe)")
    ok, message = outcome
    if not ok:
        first = message.strip().splitlines()[0] if message.strip() else "no output"
        return Choice(fallback, f"llama.cpp cannot run here: {first}")
    return Choice("gguf", "llama.cpp runs here (its probe passed) and drafts 2.4-2.8x faster than torch")


def resolve(drafter: Mapping[str, Any]) -> dict[str, Any]:
    """The ``drafter`` keys that resolve ``type: auto`` (the chosen ``type`` and, for the start-up line, why in
    ``type_reason``); empty when the type is not ``auto``. The caller sets them: nothing here changes ``drafter``."""
    if drafter.get("type") != AUTO:
        return {}
    choice = choose(drafter)
    return {"type": choice.type, "type_reason": f"auto: {choice.why}"}
