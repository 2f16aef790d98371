"""What a node does with a GGUF file before its own llama.cpp loads it: the file treated as untrusted input.

* :func:`check_sha256` — the file's SHA-256 against the configured one (``drafter.gguf_sha256``): a file swapped
  or altered since the operator chose it is refused before anything parses it;
* :func:`probe_gguf` — llama.cpp loads the file and runs one forward in a child process with resource limits
  (address space ``RLIMIT_AS``, CPU seconds ``RLIMIT_CPU``, files of at most 1 MiB ``RLIMIT_FSIZE``: its output
  goes to files, so what the parent reads back is bounded; no core dump), a
  scrubbed environment (no run secret) and a wall-clock bound: a file that crashes, hangs or balloons llama.cpp
  takes down the child, not the node that holds keys and sees prompts.

The header's bounds (:mod:`shared.gguf_header`) are checked first, in :class:`shared.llama_engine.LlamaEngine` and
by :func:`vet_gguf` before the probe. None of this makes a hostile file safe to load: a crafted file that exploits
llama.cpp without crashing it runs as the node's user in the probe and then in the node (docs/security.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.gguf_header import check_gguf_header

log = logging.getLogger("pipespec.llama")

#: The probe child's address space beyond the file's size (Python, llama.cpp, one small context), its CPU seconds
#: and its wall-clock bound.
PROBE_HEADROOM_BYTES = 3 << 30
PROBE_CPU_S = 120
PROBE_TIMEOUT_S = 180.0
_SHA256 = re.compile(r"[0-9a-f]{64}")

# The child: limits first (before llama.cpp or even numpy is imported), then a load, a context and one forward of
# four tokens, and a walk over the vocabulary's texts (what the node reads for its fingerprint).
_CHILD = r"""
import resource, sys
path, address_space, cpu_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # its own output files: nothing larger
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import ctypes, math
import llama_cpp as L
L.llama_backend_init()
@L.llama_log_callback
def _log(level, text, user):
    if level in (3, 4):  # ggml's warnings and errors: the reason a load failed
        sys.stderr.write(text.decode("utf-8", "replace"))
L.llama_log_set(_log, ctypes.c_void_p(0))
mparams = L.llama_model_default_params()
mparams.n_gpu_layers = 0
model = L.llama_model_load_from_file(path.encode(), mparams)
if not model:
    sys.exit("llama.cpp could not load the file")
vocab = L.llama_model_get_vocab(model)
n_vocab = int(L.llama_vocab_n_tokens(vocab))
if n_vocab < 1:
    sys.exit("the file has no vocabulary")
cparams = L.llama_context_default_params()
cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 256, 64, 64, 1
cparams.n_threads = cparams.n_threads_batch = 1
ctx = L.llama_init_from_model(model, cparams)
if not ctx:
    sys.exit("llama.cpp could not create a context for the file")
ids = [min(i, n_vocab - 1) for i in (0, 1, 2, 3)]
if L.llama_decode(ctx, L.llama_batch_get_one((L.llama_token * 4)(*ids), 4)) != 0:
    sys.exit("llama.cpp could not run a forward of the file")
logits = L.llama_get_logits_ith(ctx, -1)
if not all(math.isfinite(logits[i]) for i in range(n_vocab)):
    sys.exit("llama.cpp returned non-finite logits")
for i in range(n_vocab):
    L.llama_vocab_get_text(vocab, i)
print(f"forward ok ({n_vocab} tokens)")
"""


class GGUFRefused(ValueError):
    """A GGUF file a node will not load: its hash, header or probe says no (the message says which and why)."""


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of ``path``'s bytes (read in chunks)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_problem(value: object) -> str | None:
    """Why ``value`` is not a SHA-256 in hex (64 hex digits, any case), or None."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        return f"{str(value)[:80]!r} is not a SHA-256 (64 hex digits)"
    return None


def check_sha256(path: Path, expected: str, key: str = "drafter.gguf_sha256") -> None:
    """Raise :class:`GGUFRefused` unless ``path``'s SHA-256 is ``expected`` (the config's ``key``)."""
    got = file_sha256(path)
    if got != expected.lower():
        raise GGUFRefused(f"{path}: its SHA-256 is {got}, not {key} = {expected.lower()}: the file is not the one "
                          f"the config names (swapped or altered); refused before llama.cpp reads it")


def probe_env() -> dict[str, str]:
    """The child's environment: enough to run Python, nothing of the node's (no run secret, no keys' paths)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    return env


def probe_gguf(path: Path, timeout_s: float = PROBE_TIMEOUT_S, cpu_s: int = PROBE_CPU_S,
               headroom: int = PROBE_HEADROOM_BYTES) -> str:
    """Load ``path`` in llama.cpp and run one forward in a limited child process: its output line, or
    :class:`GGUFRefused` saying how the child failed (a signal, an exit, the limits, the time)."""
    limit = path.stat().st_size + headroom
    command = [sys.executable, "-I", "-c", _CHILD, str(path), str(limit), str(cpu_s)]
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            done = subprocess.run(command, stdout=out, stderr=err, timeout=timeout_s, env=probe_env(),
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise GGUFRefused(f"{path}: llama.cpp did not load the file and run one forward in {timeout_s:.0f} s "
                              "(a probe child with limits); refused") from None
        stdout, stderr = _tail(out), _tail(err)
    if done.returncode == 0:
        log.info("llama.cpp probe of %s passed in %.1f s (a child with %d GiB of address space, %d CPU s)",
                 path.name, time.monotonic() - started, limit >> 30, cpu_s)
        return stdout.strip()
    tail = " / ".join(line for line in stderr.strip().splitlines()[-3:] if line)[-600:]
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        why = {"SIGXCPU": f"it used more than {cpu_s} CPU seconds"}.get(name, f"llama.cpp died with {name}")
        what = f"{why} loading it in a probe child"
    else:
        what = f"the probe child failed (exit {done.returncode}): {tail or 'no reason given'}"
    raise GGUFRefused(f"{path}: {what}; a file llama.cpp cannot load safely is refused (a file that crashes the "
                      f"loader may be built to exploit it; a build this CPU cannot run fails the same way: "
                      f"`python -m drafter_node.gguf --check` tells them apart with a known-good file)")


def _tail(fh: Any, limit: int = 4096) -> str:
    """The last ``limit`` bytes a probe child wrote to ``fh`` (a file it could not make larger than 1 MiB)."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(max(0, size - limit))
    return fh.read().decode("utf-8", errors="replace")


def vet_gguf(path: Path, sha256: str | None = None, max_vocab: int | None = None, probe: bool = True) -> None:
    """Everything a node checks before its own llama.cpp loads ``path``: the SHA-256 (where configured), the header's
    bounds (:func:`shared.gguf_header.check_gguf_header`) and the limited probe. Raises :class:`GGUFRefused` or
    :class:`shared.gguf_header.GGUFHeaderError` (both ValueErrors) with the reason."""
    if sha256:
        check_sha256(path, sha256)
    check_gguf_header(path, max_vocab)
    if probe:
        probe_gguf(path)
