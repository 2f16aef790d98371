"""The processes that compile grammars for the verifier (structured output), and the pool that keeps them warm.

A compile runs xgrammar's C++ on a spec a client sent: it may run long, and a bug in it must not take the node. So it
runs in a child process (``python -m verifier_node.grammar_child``) spoken to over its stdin and stdout with
length-prefixed JSON; the compiled grammar comes back as xgrammar's JSON (``CompiledGrammar.serialize_json``). A
compile past its deadline kills the child (the runaway compile burns nothing after it). The child is confined:

- its environment is scrubbed (:data:`CHILD_ENV_KEEP`: no run secret, no API key, nothing the launcher passed);
- once it has imported xgrammar, its address space may grow by at most :data:`CHILD_MEMORY_HEADROOM_BYTES`
  (``RLIMIT_AS``): a compile that wants more fails its own request;
- a reply longer than :data:`MAX_REPLY_BYTES` is refused (the child is killed) before it is read;
- xgrammar's own compile cache is **off** in the child (``cache_enabled=False``): it would be shared by every tenant,
  so a quick compile would tell one tenant that another had sent the same spec. pipespec's cache
  (:class:`verifier_node.grammar.GrammarCompiler`, keyed per tenant) is the only one a tenant can hit.

:class:`CompilerProcesses` gives each compile worker thread a child of its own and keeps one more started and idle
(the *warm spare*): a worker whose child was killed takes the spare at once, and a new spare starts in the
background, so a timed-out compile costs the next request no start-up (2 to 7 s: the child imports xgrammar and
torch). The replacement is taken before the timed-out request's error is raised: the tenant whose compile ran long
waits for it, not the next tenant.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from shared.sampling import GrammarSpec, ParamError

log = logging.getLogger("pipespec.verifier.prep")

#: The child process's start-up (imports xgrammar and torch) is bounded apart from the compile limit.
CHILD_START_TIMEOUT_S = 120.0
#: The most bytes of one reply (a compiled grammar as JSON; the largest measured, ``[a-z]{1,100000}`` on a
#: 151,936-token vocabulary, is 11 MB). A longer one fails its request and the child is killed.
MAX_REPLY_BYTES = 128 * 1024 * 1024
#: How far the child's address space may grow past its size after start-up (``RLIMIT_AS``).
CHILD_MEMORY_HEADROOM_BYTES = 2 * 1024 * 1024 * 1024
#: The only environment variables the child gets (and every ``LC_*``): what Python, torch and xgrammar need to start.
CHILD_ENV_KEEP = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "HOME", "OMP_NUM_THREADS",
                  "MKL_NUM_THREADS", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED")
_LEN = struct.Struct(">I")


class CompileOverBudget(ParamError):
    """A compile ran past its deadline or its memory limit (the child was killed); the request's 400. The spec is
    remembered and refused at once for a while (:class:`verifier_node.request_prep.TimedOutSpecs`)."""


class CompileTimeout(CompileOverBudget):
    """A compile ran past its deadline (the child was killed); the request's 400."""


def child_env() -> dict[str, str]:
    """The child's environment: :data:`CHILD_ENV_KEEP` of this process's, and this repository on ``PYTHONPATH``."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV_KEEP or k.startswith("LC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return env


# ---------------------------------------------------------------------------------------------------- the wire
# To the child: length-prefixed JSON (the setup, then one compile request each). From the child: a length prefix,
# one status byte (R: ready, K: compiled, E: error) and the payload as it is (the compiled grammar's JSON is not
# escaped again: it is the bulk of the traffic).
def _write(stream: Any, obj: Any) -> None:
    _write_raw(stream, json.dumps(obj).encode())


def _write_raw(stream: Any, data: bytes) -> None:
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; None when ``deadline`` (monotonic) passes first. EOFError: the writer is gone."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the grammar compiler process exited")
        out += chunk
    return bytes(out)


def _read_raw(fd: int, deadline: float | None, max_bytes: int | None = None) -> bytes | None:
    """One message's bytes; None past ``deadline``. ValueError: longer than ``max_bytes`` (nothing more is read)."""
    head = _read_exact(fd, _LEN.size, deadline)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"a reply of {size} bytes, over the {max_bytes}-byte bound")
    return _read_exact(fd, size, deadline)


def _read(fd: int, deadline: float | None) -> Any:
    data = _read_raw(fd, deadline)
    return None if data is None else json.loads(data)


# ----------------------------------------------------------------------------------------------- one child
class GrammarChild:
    """One compiling process. :meth:`compile` is a ``compile_with`` for
    :class:`verifier_node.grammar.GrammarCompiler`; one caller at a time. A child that was killed or crashed starts
    afresh at the next :meth:`compile` (:class:`CompilerProcesses` replaces it with its spare instead)."""

    def __init__(self, xgr: Any, info: Any, vocab_size: int, timeout_s: float, *,
                 max_reply_bytes: int = MAX_REPLY_BYTES, memory_headroom: int = CHILD_MEMORY_HEADROOM_BYTES):
        self.xgr, self.info = xgr, info
        self.vocab_size, self.timeout_s = vocab_size, timeout_s
        self.max_reply_bytes, self.memory_headroom = max_reply_bytes, memory_headroom
        self.proc: subprocess.Popen | None = None
        self.starts = 0  # processes started

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> GrammarChild:
        """Start the process and wait (at most :data:`CHILD_START_TIMEOUT_S`) until it is ready to compile."""
        root = str(Path(__file__).resolve().parents[1])
        proc = subprocess.Popen([sys.executable, "-m", "verifier_node.grammar_child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=child_env(), cwd=root)
        self.proc = proc
        self.starts += 1
        try:
            _write(proc.stdin, {"info": self.info.serialize_json(), "vocab_size": self.vocab_size,
                                "memory_headroom": self.memory_headroom})
            ready = _read_raw(proc.stdout.fileno(), time.monotonic() + CHILD_START_TIMEOUT_S, 4096)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise ParamError(f"structured output could not start its compiler process: {exc}") from None
        if ready != b"R":
            self.close()
            raise ParamError(f"structured output could not start its compiler process: {ready!r:.300}")
        log.info("grammar compiler process %d started", proc.pid)
        return self

    def compile(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` in the child within ``timeout_s`` (past it: child killed, :class:`CompileTimeout`)."""
        if not self.alive:
            self.start()
        proc = self.proc
        assert proc is not None
        try:
            _write(proc.stdin, {"kind": spec.kind, "value": spec.value, "strict": spec.strict})
            reply = _read_raw(proc.stdout.fileno(), time.monotonic() + self.timeout_s, self.max_reply_bytes)
        except ValueError as exc:  # too long a reply: this request (the rest of it is never read)
            self.close()
            raise ParamError(f"{spec.kind}: its compiled grammar is too large ({exc}); simplify it") from None
        except (OSError, EOFError) as exc:  # crashed on this spec: this request
            self.close()
            raise ParamError(f"{spec.kind}: the grammar engine failed on it ({exc})") from None
        if reply is None:
            log.warning("grammar compile of a %s spec ran past %.3g s: compiler process killed", spec.kind,
                        self.timeout_s)
            self.close()
            raise CompileTimeout(f"{spec.kind}: compiling it took longer than verifier.grammar_compile_timeout_s "
                                 f"({self.timeout_s:g} s); simplify the schema or grammar")
        status, payload = reply[:1], reply[1:].decode("utf-8", "replace")
        if status == b"M":  # past its memory limit: a fresh child (the spare) for the next compile
            self.close()
            raise CompileOverBudget(payload[:1000])
        if status != b"K":
            raise ParamError(payload[:1000] if status == b"E" else f"{spec.kind}: the grammar engine failed on it")
        return self.xgr.CompiledGrammar.deserialize_json(payload, self.info)

    def kill(self) -> None:
        """Kill the child now (any thread): a compile in work fails at once. For shutting down."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


# ------------------------------------------------------------------------------------------ the warm pool
class CompilerProcesses:
    """Compile children for several worker threads, and one warm spare (see the module's docstring).
    :meth:`compile` runs ``spec`` in the calling thread's own child. Starts are made one at a time, in the
    background, so they never compete with each other for the CPU."""

    def __init__(self, xgr: Any, info: Any, vocab_size: int, timeout_s: float, **child_args: Any):
        self._make = lambda: GrammarChild(xgr, info, vocab_size, timeout_s, **child_args)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._children: list[GrammarChild] = []  # every child made and not closed (to kill them at shutdown)
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipespec-grammar-start")
        self._spare: concurrent.futures.Future[GrammarChild] | None = None
        self._closed = False
        self.starts = 0  # processes started

    def _new_child(self) -> GrammarChild:
        child = self._make()
        with self._lock:
            if self._closed:
                raise ParamError("the verifier is stopping")
            self._children.append(child)
            self.starts += 1
        try:
            return child.start()
        except BaseException:
            self._forget(child)
            raise

    def _forget(self, child: GrammarChild) -> None:
        with self._lock:
            if child in self._children:
                self._children.remove(child)

    def _take(self) -> GrammarChild:
        """The spare (waiting for it if it is still starting); a new spare starts behind it."""
        with self._lock:
            if self._closed:
                raise ParamError("the verifier is stopping")
            taken = self._spare if self._spare is not None else self._starter.submit(self._new_child)
            self._spare = self._starter.submit(self._new_child)
        try:
            return taken.result(timeout=2 * CHILD_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise ParamError("structured output could not start its compiler process in time") from None
        except concurrent.futures.CancelledError:  # the verifier is stopping (close cancelled the start)
            raise ParamError("the verifier is stopping") from None

    def spare_ready(self, timeout_s: float) -> bool:
        """Whether a warm spare is started (waiting at most ``timeout_s`` for it). For tests."""
        spare = self._spare
        if spare is None:
            return False
        with contextlib.suppress(concurrent.futures.TimeoutError, ParamError):
            return spare.result(timeout=timeout_s).alive
        return False

    def compile(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` in this thread's child; a child that died on it (killed past its deadline, crashed) is
        replaced with the spare before the request's error is raised."""
        child: GrammarChild | None = getattr(self._local, "child", None)
        if child is None or not child.alive:
            if child is not None:
                self._forget(child)
            child = self._local.child = self._take()
        try:
            return child.compile(spec)
        finally:
            if not child.alive and not self._closed:
                self._forget(child)
                with contextlib.suppress(ParamError):
                    self._local.child = self._take()

    def kill(self) -> None:
        """Kill every child now (any thread): a compile in work fails at once. For shutting down."""
        with self._lock:
            self._closed = True
            children = list(self._children)
        for child in children:
            child.kill()

    def close(self) -> None:
        self.kill()
        self._starter.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()


# ------------------------------------------------------------------------------------------- in the child
def _limit_memory(headroom: int) -> None:
    """``RLIMIT_AS``: this process's address space now plus ``headroom`` (the imports are already in)."""
    import resource

    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _child_main() -> None:
    """The compiling child: answers one compile per request until its stdin closes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr: stdout carries the replies only
    with contextlib.suppress(Exception):  # Linux: die with the verifier, even in the middle of a compile
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    fd = sys.stdin.fileno()
    setup = _read(fd, None)
    from verifier_node.grammar import GrammarCompiler, _import_xgrammar

    xgr = _import_xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(setup["info"])
    compiler = GrammarCompiler(None, setup["vocab_size"], [], cache_bytes=0, info=info)
    # xgrammar's cache would be shared by every tenant (a timing oracle): off; pipespec's, per tenant, is the cache
    compiler.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    with contextlib.suppress(ImportError, OSError, ValueError):  # not on this platform: no limit rather than no child
        _limit_memory(int(setup["memory_headroom"]))
    _write_raw(out, b"R")
    while True:
        try:
            request = _read(fd, None)
        except EOFError:
            return
        kind = request["kind"]
        try:
            compiled = compiler.compile_uncached(GrammarSpec(kind, request["value"], bool(request.get("strict", True))))
            _write_raw(out, b"K" + compiled.serialize_json().encode())
        except Exception as exc:  # any failure is this spec's, reported to its request
            if isinstance(exc, MemoryError) or "bad_alloc" in str(exc):  # xgrammar's std::bad_alloc: the limit
                _write_raw(out, f"M{kind}: compiling it needs more memory than the compiler process may use "
                                f"(verifier_node/grammar_child.py); simplify it".encode())
            elif isinstance(exc, ParamError):
                _write_raw(out, b"E" + str(exc).encode())
            else:
                _write_raw(out, b"E" + f"{kind}: the grammar engine failed on it: {exc!r:.300}".encode())


if __name__ == "__main__":
    _child_main()
