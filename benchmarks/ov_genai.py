"""OpenVINO GenAI as a benchmark setup: a peer CPU users install, measured beside pipespec and llama.cpp.

An :class:`~benchmarks.passes.OVSetup` is one worker process (:mod:`benchmarks.ov_worker`) holding one
``openvino_genai.LLMPipeline`` on the CPU: the target alone, or the target with a separate draft model
(``draft_model=openvino_genai.draft_model(...)``, GenAI's speculative decoding, ``num_assistant_tokens`` drafted
tokens per step). It is started once per pass and kept open across prompts like a pipespec cluster or a
``llama-server``; each generation is greedy, fed the same prompt token ids as the other rows (so its output ids
are compared with the reference's like any row's), timed by the wall time around ``generate`` in the worker.

**Greedy only.** With ``do_sample`` GenAI's speculative decoding does not use the standard lossless acceptance
rule (accept the drafted token x with probability min(1, p_target(x) / p_draft(x)), on a rejection resample from
the normalised max(0, p_target − p_draft)): its sampler (``validate_candidate`` in ``src/cpp/src/sampling/
sampler.cpp``, read for this bench) accepts when a draw from a 101-point grid is at most the draft's probability
of its token divided by the target's probability of the token the target sampled, and on a rejection keeps the
target's sample with a rescaled probability instead of drawing from the residual. Its sampled output is therefore
not guaranteed to follow the target's distribution, and a sampled comparison with pipespec would not compare like
with like. Greedy verification is exact token matching, the same rule as every other row.

**Its own environment.** optimum-intel (the exporter) needs transformers < 5.6 while pipespec runs transformers
5.x, so the bench makes a separate virtual environment (:func:`default_venv`, ``~/.cache/pipespec/openvino/venv``)
with the pinned :data:`REQUIREMENTS` and pipespec's own torch version (an unpinned torch would pull a multi-GB
CUDA build), once; the worker runs in it. The models are exported once (:func:`ensure_export`) from the same
bf16 safetensors folders the other rows load, with ``optimum-cli export openvino --weight-format fp16`` (the
tokenizer converted too, by openvino-tokenizers), into ``~/.cache/pipespec/openvino/models``. A missing or failed
environment or export fails the rows that need it, with the reason, not the run.

**Precision.** The CPU plugin is asked for ``INFERENCE_PRECISION_HINT: bf16`` and ``INFERENCE_NUM_THREADS`` = the
bench's threads; what it resolves them to (on a CPU without native bf16, e.g. AVX2-only, it runs f32) is queried
from a compiled model and recorded in the report.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from benchmarks.passes import OVSetup
from benchmarks.progress import log
from shared.named_models import cache_root

#: What the OpenVINO environment installs besides torch, pinned to versions that install together on Python 3.11
#: (optimum-intel 2.2.0 also wants torchvision, whose wheel from the registry needs a CUDA torch; 2.1.0 does not).
REQUIREMENTS = ("openvino==2026.4.1", "openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
                "optimum-intel[openvino]==2.1.0", "optimum==2.3.0", "nncf==3.4.0", "transformers==5.5.4")
WEIGHT_FORMAT = "fp16"
WORKER = Path(__file__).resolve().with_name("ov_worker.py")
MARKER = ".pipespec-openvino.json"  # written last: a folder without it is not finished
VENV_TIMEOUT_S = 3600.0  # creating the environment: downloads of about 1 GB on a slow link
EXPORT_TIMEOUT_S = 3600.0  # one export: the model traced and converted on a busy two-core machine
START_TIMEOUT_S = 300.0  # the worker's imports and its probe compile
LOAD_TIMEOUT_S = 1200.0  # building a pipeline (compiling the target and the draft model)
REQUEST_TIMEOUT_S = 1800.0  # one generation or one cost curve
LOCK_TIMEOUT_S = 2 * EXPORT_TIMEOUT_S


def ov_root() -> Path:
    """Where the OpenVINO environment and exports live: ``<pipespec cache>/openvino``."""
    return cache_root() / "openvino"


def default_venv() -> Path:
    return ov_root() / "venv"


def export_dir(model_dir: str | Path, weight_format: str = WEIGHT_FORMAT) -> Path:
    """Where the OpenVINO export of the transformers folder ``model_dir`` is kept."""
    return ov_root() / "models" / f"{Path(model_dir).name}-{weight_format}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def requirements(torch_version: str | None = None) -> list[str]:
    """What the environment installs: :data:`REQUIREMENTS` and ``torch`` pinned to pipespec's own version (its
    local label included, ``+cpu`` on a CPU install, so pip takes the same build), installed in one resolve."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    return [f"torch=={torch_version}", *REQUIREMENTS]


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def _locked(path: Path, what: str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive file lock, waited for at most ``timeout_s`` (another bench making the same environment or
    export); TimeoutError after that."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    log(f"another process is making {what} (lock {path}); waiting for it")
                    told = True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: lock {path} still held after {timeout_s:.0f} s") from None
                time.sleep(2.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_logged(cmd: list[str], label: str, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Run ``cmd``, its output passed through as progress lines (``  label: ...``), bounded by ``timeout_s``;
    RuntimeError with the end of its output when it fails or runs over."""
    tail: deque[str] = deque(maxlen=25)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill)  # the read below ends when the killed process closes its output
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith("WARNING: Location ") and "is ignored" in line:
                continue  # pip's note on every missing local index folder: noise, hundreds of lines
            sys.stderr.write(f"  {label}: {line}")
            tail.append(line.rstrip())
        code = proc.wait(60)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    finally:
        timer.cancel()
    if code != 0:
        why = f"ran over {timeout_s:.0f} s" if timed_out.is_set() else f"exited with code {code}"
        raise RuntimeError(f"{label} {why}:\n" + "\n".join(tail))


def ensure_venv(venv: Path, reqs: list[str] | None = None) -> Path:
    """The environment's python, making the environment first (once, under a lock) when it is missing or was
    made with other requirements: ``python -m venv`` from the interpreter pipespec runs on, then one
    ``pip install`` of :func:`requirements`. The marker (written last) records the requirements."""
    reqs = list(reqs or requirements())
    python = venv_python(venv)
    done = _read_marker(venv)
    if done and done.get("requirements") == reqs and python.is_file():
        return python
    with _locked(venv.parent / ".venv.lock", f"the OpenVINO environment {venv}"):
        done = _read_marker(venv)
        if done and done.get("requirements") == reqs and python.is_file():
            return python
        if venv.exists():
            log(f"the OpenVINO environment {venv} is unfinished or has other requirements; making it again")
            shutil.rmtree(venv)
        t0 = time.perf_counter()
        base = getattr(sys, "_base_executable", sys.executable)  # a venv's venv would chain to pipespec's
        log(f"making the OpenVINO environment {venv} (once; about 1.5 GB, a few minutes): {' '.join(reqs)}")
        run_logged([base, "-m", "venv", str(venv)], "venv", 300)
        run_logged([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
                    *reqs], "pip", VENV_TIMEOUT_S)
        (venv / MARKER).write_text(json.dumps({"requirements": reqs, "made": time.time()}))
        log(f"OpenVINO environment ready in {time.perf_counter() - t0:.0f} s")
    return python


def source_stamp(model_dir: str | Path) -> str:
    """A digest of a transformers folder's config and weight files' names, sizes and times: an export made from
    an older folder is made again."""
    folder = Path(model_dir)
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return h.hexdigest()[:16]


def ensure_export(python: Path, model_dir: str | Path, out: Path, weight_format: str = WEIGHT_FORMAT) -> Path:
    """``out``, the OpenVINO export of the transformers folder ``model_dir`` (``openvino_model.xml``, the converted
    tokenizer and detokenizer, the generation config), made once with the environment's ``optimum-cli export
    openvino --weight-format`` into a temporary folder renamed when finished; made again when the source changed."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a transformers model folder (no config.json)")
    want = {"source": str(model_dir), "stamp": source_stamp(model_dir), "weight_format": weight_format}

    def finished() -> bool:
        done = _read_marker(out)
        return bool(done) and all(done.get(k) == v for k, v in want.items()) and (out / "openvino_model.xml").is_file()

    if finished():
        return out
    with _locked(out.parent / f".{out.name}.lock", f"the OpenVINO export {out}"):
        if finished():
            return out
        tmp = out.with_name(out.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        cli = python.with_name("optimum-cli")
        t0 = time.perf_counter()
        log(f"exporting {model_dir.name} to OpenVINO ({weight_format}) into {out} (once; a few minutes)")
        run_logged([str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
                    "--weight-format", weight_format, str(tmp)], "export", EXPORT_TIMEOUT_S)
        missing = [n for n in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
                   if not (tmp / n).is_file()]
        if missing:
            raise RuntimeError(f"the export of {model_dir} has no {', '.join(missing)} (is openvino-tokenizers in "
                               f"the environment?)")
        (tmp / MARKER).write_text(json.dumps(want))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        log(f"{out} exported in {time.perf_counter() - t0:.0f} s")
    return out


def worker_spec(setup: OVSetup, target: Path, draft: Path | None) -> dict[str, Any]:
    """What the worker is started with (exported folders, not the transformers ones)."""
    return {"key": setup.key, "target": str(target), "draft": str(draft) if draft else None,
            "threads": setup.threads, "precision": setup.precision, "draft_tokens": setup.draft_tokens}


def parse_answer(line: str, op: str) -> dict[str, Any]:
    """One answer line of the worker → its object; RuntimeError for an error answer, ValueError for a line that is
    not an answer."""
    try:
        answer = json.loads(line)
    except ValueError:
        raise ValueError(f"the OpenVINO worker answered {op!r} with a line that is not JSON: {line[:300]!r}") from None
    if not isinstance(answer, dict):
        raise ValueError(f"the OpenVINO worker answered {op!r} with {type(answer).__name__}, not an object")
    if "error" in answer:
        raise RuntimeError(f"the OpenVINO worker failed {op!r}: {answer['error']}")
    return answer


def parse_generate(answer: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """A ``generate`` answer → the runner's per-prompt fields (``token_ids``, ``time_s``, ``stats``) and the
    ``openvino`` extras (``perf``, ``settings``); ValueError on ids that are missing or more than asked."""
    tokens = answer.get("token_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"the OpenVINO worker answered no token ids: {tokens!r}")
    if len(tokens) > max_new_tokens:
        raise ValueError(f"the OpenVINO worker returned {len(tokens)} tokens for max_new_tokens {max_new_tokens}")
    time_s = answer.get("time_s")
    if not isinstance(time_s, (int, float)) or time_s <= 0:
        raise ValueError(f"the OpenVINO worker answered no positive time: {time_s!r}")
    stats = answer.get("stats") or {}
    for name in ("rounds", "drafts", "draft_tokens", "accepted_tokens"):
        if not isinstance(stats.get(name), int):
            raise ValueError(f"the OpenVINO worker's stats have no {name!r}: {stats!r}")
    return {"token_ids": tokens, "new_tokens": len(tokens), "time_s": float(time_s), "stats": stats,
            "openvino": {"perf": answer.get("perf", {}), "settings": answer.get("settings", {})}}


def precision_label(info: dict[str, Any]) -> str:
    """``"f32 (hint bf16)"``: what the plugin runs, and what it was asked for when that differs."""
    asked = str(info.get("properties", {}).get("INFERENCE_PRECISION_HINT", "?"))
    got = str(info.get("resolved", {}).get("INFERENCE_PRECISION_HINT", "?"))
    return got if got == asked else f"{got} (hint {asked})"


class OVWorker:
    """Parent side of one OpenVINO GenAI worker: :meth:`start` (blocking: the environment and exports made when
    missing, the process started, its ``ready`` answer kept in :attr:`info`), :meth:`call` per request (bounded),
    :meth:`generate`, :meth:`close`."""

    def __init__(self, setup: OVSetup):
        self.setup = setup
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self.exports: dict[str, str] = {}
        self.tail: deque[str] = deque(maxlen=30)
        self._answers: queue.Queue[str | None] = queue.Queue()

    @property
    def curve_dtype(self) -> str:
        """The precision label of the cost-curve table (:func:`precision_label`)."""
        return precision_label(self.info)

    def prepare(self) -> tuple[Path, Path, Path | None]:
        """The environment's python and the exported target (and draft): made when missing."""
        s = self.setup
        python = ensure_venv(s.venv or default_venv())
        target = ensure_export(python, s.target_path, export_dir(s.target_path))
        draft = ensure_export(python, s.draft_path, export_dir(s.draft_path)) if s.draft_path else None
        self.exports = {"target": str(target), **({"draft": str(draft)} if draft else {})}
        return python, target, draft

    def start(self) -> dict[str, Any]:
        python, target, draft = self.prepare()
        spec = worker_spec(self.setup, target, draft)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        self.proc = subprocess.Popen([str(python), "-I", str(WORKER), json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1)
        threading.Thread(target=self._pass_stderr, daemon=True).start()
        threading.Thread(target=self._read_answers, args=(self.proc.stdout,), daemon=True).start()
        self.info = self.call("ready", timeout_s=START_TIMEOUT_S)
        log(f"{self.setup.key}: OpenVINO {self.info['versions'].get('openvino_genai', '?')}, precision "
            f"{precision_label(self.info)}, {self.setup.threads} threads")
        return self.info

    def _pass_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:  # progress through, the end kept for an error report
            sys.stderr.write(line)
            self.tail.append(line.rstrip())

    def _read_answers(self, stream: IO[str]) -> None:
        for line in stream:
            self._answers.put(line)
        self._answers.put(None)  # the worker closed its output: it exited

    def call(self, op: str, timeout_s: float = REQUEST_TIMEOUT_S, **request: Any) -> dict[str, Any]:
        """Send one request and wait at most ``timeout_s`` for its answer; RuntimeError on an error answer, a dead
        worker (with the end of its log) or a timeout (the worker is then killed: its state is unknown)."""
        if self.proc is None or self.proc.stdin is None:
            raise RuntimeError(f"{self.setup.key}: the OpenVINO worker is not started")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
            line = self._answers.get(timeout=timeout_s)
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError(f"{self.setup.key}: the OpenVINO worker did not answer {op!r} within "
                               f"{timeout_s:.0f} s:\n" + "\n".join(self.tail)) from None
        if line is None:
            code = self.proc.wait(30)
            raise RuntimeError(f"{self.setup.key}: the OpenVINO worker exited with code {code}:\n"
                               + "\n".join(self.tail))
        return parse_answer(line, op)

    def load(self) -> float:
        return float(self.call("load", timeout_s=LOAD_TIMEOUT_S)["load_s"])

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        return parse_generate(self.call("generate", ids=list(ids), max_new_tokens=max_new_tokens), max_new_tokens)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, ValueError):
                self.call("quit", timeout_s=30)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
