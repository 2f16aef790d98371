"""llama.cpp's own ``llama-server`` as a benchmark setup: the CPU user's alternative to pipespec, measured beside it.

A :class:`~benchmarks.passes.LlamaSetup` is one ``llama-server`` process on a loopback port (a target GGUF, and for
speculative decoding a draft GGUF), started once per pass and kept open across prompts like a pipespec cluster.
Each generation is one ``POST /completion`` with the prompt as token ids (the same ids the other rows decode),
greedy (``temperature`` 0, ``top_k`` 1, no penalties), no prompt cache and the generated ids returned; its speed is
the wall time around the request, and the server's own ``timings`` are kept in the raw results. Draft counts come
from the server's Prometheus counters (``--metrics``), read before and after each request (outside the timed part).

The pure parts (:func:`server_command`, :func:`completion_body`, :func:`parse_completion`, :func:`parse_metrics`)
are what the tests check without a binary; :class:`LlamaServer` runs the process. A bf16 GGUF of a target is made
once with llama.cpp's ``convert_hf_to_gguf.py`` (:func:`convert_to_gguf`) when a setup needs one that is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks.passes import LlamaSetup
from benchmarks.progress import log
from shared.named_models import cache_root

#: Where the tools are when neither ``--llama-bin`` nor ``$PIPESPEC_LLAMA_BIN`` says
#: (``python scripts/build_llama_cpp.py --tools`` puts them there).
DEFAULT_BIN = cache_root() / "llama.cpp" / "build" / "bin"
SERVER = "llama-server"
# no backticks: the message goes into the report's markdown inside a code span
BUILD_HINT = ("build it with 'python scripts/build_llama_cpp.py --tools DIR' and pass --llama-bin DIR/build/bin "
              "(or set PIPESPEC_LLAMA_BIN)")
START_TIMEOUT_S = 300.0  # loading a 3 GiB bf16 GGUF from a cold disk on a busy two-core machine
REQUEST_TIMEOUT_S = 1800.0  # one generation; bounded so that a wedged server fails its row instead of the run
CONVERT_TIMEOUT_S = 3600.0
#: The server's draft counters (Prometheus names without the ``llamacpp:`` prefix) → the bench's stats names.
DRAFT_COUNTERS = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
                  "spec_decode_num_accepted_tokens_total": "accepted_tokens"}


def default_bin_dir() -> Path:
    """``$PIPESPEC_LLAMA_BIN`` if set and non-empty, else :data:`DEFAULT_BIN`."""
    env = os.environ.get("PIPESPEC_LLAMA_BIN")
    return Path(env).expanduser() if env else DEFAULT_BIN


def source_dir(bin_dir: Path) -> Path:
    """The llama.cpp source tree beside a tools build (``DIR/build/bin`` → ``DIR/src``, the layout of
    ``build_llama_cpp.py --tools DIR``): where ``convert_hf_to_gguf.py`` and ``gguf-py`` are."""
    return bin_dir.resolve().parent.parent / "src"


def server_binary(bin_dir: Path) -> Path:
    """The ``llama-server`` executable in ``bin_dir``; FileNotFoundError with how to build it when it is missing."""
    path = bin_dir / SERVER
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"{SERVER} not found in {bin_dir}: {BUILD_HINT}")
    return path


def server_command(setup: LlamaSetup, port: int) -> list[str]:
    """The ``llama-server`` command line of ``setup`` on ``127.0.0.1:port``: one slot, ``setup.threads`` for
    generation and prompt processing (the draft model's threads default to the same), a context that fits the
    longest prompt and its new tokens, the counters on, the web UI and the host-memory prompt cache off; with a
    draft model, llama.cpp's ``draft-simple`` speculative decoding with ``draft_max`` / ``draft_min``."""
    cmd = [str(setup.bin_dir / SERVER), "-m", str(setup.target), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(setup.threads), "-tb", str(setup.threads), "-c", str(setup.ctx_size), "-np", "1",
           "--metrics", "--no-webui", "--cache-ram", "0"]
    if setup.draft is not None:
        # this llama.cpp wants the type named: -md alone infers only the sidecar types (MTP, EAGLE-3, DFlash)
        cmd += ["--spec-type", "draft-simple", "-md", str(setup.draft), "--spec-draft-n-max", str(setup.draft_max),
                "--spec-draft-n-min", str(setup.draft_min)]
    return cmd


def completion_body(ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """``POST /completion``'s body: ``ids`` as the prompt (no BOS added to a token prompt), greedy with every
    sampler that could move the argmax off (penalties, DRY, top-p / min-p) neutral, no prompt cache (each prompt is
    processed in full, as in the other rows), the generated ids returned."""
    return {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
            "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "cache_prompt": False, "return_tokens": True, "stream": False, "seed": 0}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{name without "llamacpp:": value}`` for the unlabeled samples."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:([A-Za-z_][A-Za-z0-9_]*)\s+(\S+)$", line.strip())
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1)] = float(m.group(2))
    return out


def parse_completion(body: dict[str, Any], max_new_tokens: int, before: dict[str, float] | None = None,
                     after: dict[str, float] | None = None) -> dict[str, Any]:
    """A ``/completion`` answer → ``token_ids``, ``timings`` (the server's own), ``stop_type`` and ``stats``
    (``rounds``, ``drafts``, ``draft_tokens``, ``accepted_tokens``: the draft counters' change between ``before``
    and ``after``, else the timings' ``draft_n`` / ``draft_n_accepted`` with drafts taken as rounds). Raises
    ValueError on an answer that has no generated ids (a server that ignored ``return_tokens``) or more than asked."""
    if not isinstance(body, dict):
        raise ValueError(f"/completion answered {type(body).__name__}, not an object")
    if "error" in body:
        raise ValueError(f"/completion answered an error: {body['error']}")
    tokens = body.get("tokens")
    timings = body.get("timings") or {}
    predicted = timings.get("predicted_n", body.get("tokens_predicted"))
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"/completion answered no token ids (`tokens`: {tokens!r}); does this llama-server know "
                         "return_tokens?")
    if (predicted and not tokens) or len(tokens) > max_new_tokens:
        raise ValueError(f"/completion returned {len(tokens)} token ids for {predicted} predicted tokens "
                         f"(n_predict {max_new_tokens})")
    stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    if before is not None and after is not None and any(f"{c}" in after for c in DRAFT_COUNTERS):
        for counter, name in DRAFT_COUNTERS.items():
            stats[name] = int(after.get(counter, 0.0) - before.get(counter, 0.0))
    elif "draft_n" in timings:
        stats["draft_tokens"] = int(timings["draft_n"])
        stats["accepted_tokens"] = int(timings.get("draft_n_accepted", 0))
    # a verification step emits its accepted drafts and one token of its own; the first token comes from the
    # prompt's forward, so the target ran len(tokens) - accepted steps after it
    stats["rounds"] = max(len(tokens) - stats["accepted_tokens"], 0)
    if stats["draft_tokens"] and not stats["drafts"]:
        stats["drafts"] = stats["rounds"]  # no counters: every step drafted (n-min 0, p-min 0)
    return {"token_ids": tokens, "timings": timings, "stop_type": body.get("stop_type"), "stats": stats}


def server_version(bin_dir: Path) -> str | None:
    """``llama-server --version``'s text on one line (its version, commit and compiler), None when it cannot run."""
    try:
        r = subprocess.run([str(server_binary(bin_dir)), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip()]
    wanted = [ln for ln in lines if ln.startswith(("version", "built with"))]
    return "; ".join(wanted or lines[-2:]) or None


def convert_to_gguf(model_dir: str | Path, out: Path, src: Path, outtype: str = "bf16") -> Path:
    """Write ``out``, a GGUF of the transformers folder ``model_dir`` in ``outtype``, with llama.cpp's own
    ``convert_hf_to_gguf.py`` from the source tree ``src`` (its ``gguf-py`` first on the path), its progress passed
    through; written to a temporary name first, so an interrupted conversion leaves no file that looks whole."""
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{out} is missing and llama.cpp's convert_hf_to_gguf.py is not in {src} to make it "
                                f"(the source tree beside the tools: {BUILD_HINT})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    shim = tempfile.mkdtemp(prefix="pipespec-convert-")
    paths = [str(src / "gguf-py")]
    if importlib.util.find_spec("sentencepiece") is None and not (Path(model_dir) / "tokenizer.model").is_file():
        # the converter imports sentencepiece before it looks for tokenizer.model, and only without that file falls
        # back to the tokenizer.json BPE vocabulary (Qwen's); an import that succeeds lets it get there
        Path(shim, "sentencepiece.py").write_text(_SENTENCEPIECE_SHIM)
        paths.append(shim)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
    log(f"making {out.name} ({outtype}) from {model_dir} with {script} (once; a few minutes)")
    t0 = time.perf_counter()
    tail: deque[str] = deque(maxlen=20)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # progress through, the end kept for an error
            sys.stderr.write(f"  convert: {line}")
            tail.append(line.rstrip())
        code = proc.wait(CONVERT_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait(10)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(shim, ignore_errors=True)
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py exited with code {code}:\n" + "\n".join(tail))
    os.replace(tmp, out)
    log(f"{out} written in {time.perf_counter() - t0:.0f} s ({out.stat().st_size / 2**30:.2f} GiB)")
    return out


_SENTENCEPIECE_SHIM = '''"""Stand-in for sentencepiece: convert_hf_to_gguf.py on a model without tokenizer.model."""


class SentencePieceProcessor:
    def __init__(self, *args, **kwargs):
        raise ImportError("this model needs the sentencepiece package to convert: pip install sentencepiece")
'''


def free_port() -> int:
    """A free TCP port on the loopback interface (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One ``llama-server`` process of a :class:`LlamaSetup`: :meth:`start` (blocking, bounded),
    :meth:`generate` per prompt, :meth:`close`. Its output goes to a log file whose end an error carries."""

    def __init__(self, setup: LlamaSetup):
        self.setup = setup
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.command: list[str] = []
        self._logdir = Path(tempfile.mkdtemp(prefix=f"pipespec-{setup.key}-"))
        self.log_path = self._logdir / "llama-server.log"

    def prepare(self) -> None:
        """Check the binary and the GGUF files, making the target's when the setup says how (a bf16 conversion)."""
        server_binary(self.setup.bin_dir)
        s = self.setup
        if not s.target.is_file():
            if s.convert_from is None:
                raise FileNotFoundError(f"target GGUF {s.target} is missing" + (f": {s.missing_hint}"
                                                                                  if s.missing_hint else ""))
            convert_to_gguf(s.convert_from, s.target, s.convert_src or source_dir(s.bin_dir))
        if s.draft is not None and not s.draft.is_file():
            raise FileNotFoundError(f"draft GGUF {s.draft} is missing" + (f": {s.missing_hint}" if s.missing_hint
                                                                          else ""))

    def log_tail(self, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        self.prepare()
        self.port = free_port()
        self.command = server_command(self.setup, self.port)
        log(f"{self.setup.key}: starting {' '.join(self.command)}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{SERVER} exited with code {code} while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{SERVER} not ready within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def _request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self._url(path), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{SERVER} answered {exc.code} to {path}: {exc.read()[:500]!r}") from None
        except (OSError, urllib.error.URLError) as exc:
            code = self.proc.poll() if self.proc else None
            state = f"exited with code {code}" if code is not None else "running"
            raise RuntimeError(f"{SERVER} ({state}) did not answer {path}: {exc}\n{self.log_tail()}") from None

    def counters(self) -> dict[str, float]:
        return parse_metrics(self._request("/metrics").decode(errors="replace"))

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """One greedy generation: ``token_ids``, ``time_s`` (wall time around the request), ``timings``,
        ``stats``."""
        before = self.counters()
        t0 = time.perf_counter()
        raw = self._request("/completion", completion_body(ids, max_new_tokens), timeout=REQUEST_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        out = parse_completion(json.loads(raw), max_new_tokens, before, self.counters())
        return {**out, "time_s": elapsed}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._logdir, ignore_errors=True)
