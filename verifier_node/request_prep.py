"""Request preparation off the verifier's loop: tokenising / chat-templating prompts and compiling grammars.

The verifier has one I/O loop (:mod:`verifier_node.server`); a 4 MiB prompt or a grammar that takes seconds to
compile must not stall every other session's rounds. So a ``generate`` is checked cheaply on the loop (ids, limits,
session and queue counts) and handed to :class:`RequestPrep`: one worker thread, at most
``verifier.max_pending_requests`` requests waiting or in work (more get ``busy``). A request waiting there is
*pending*: it has no session yet, so the scheduler never sees it; a ``cancel`` or a silent client drops it (its
result, when the worker finishes, is thrown away). The worker wakes the loop through an inproc PAIR socket in the
loop's poller, and the loop admits the finished request (:mod:`verifier_node.admission`) or sends its error.

Grammars compile in a child process (:class:`GrammarChild`, started at the first grammar request, so a verifier
without grammars pays nothing): the compiled grammar comes back as xgrammar's JSON (``CompiledGrammar.serialize_json``,
a millisecond or two for a small schema on a tiny vocabulary). A compile that runs past
``verifier.grammar_compile_timeout_s`` fails its request with a 400 and the child is killed (a runaway compile
burns no thread or core after its deadline) and started afresh at the next grammar request. Before compiling, a JSON
schema's nesting depth and size are checked (:func:`check_schema_bounds`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from shared.protocol import Generate, ProtocolError
from shared.sampling import GenerationParams, GrammarSpec, ParamError

log = logging.getLogger("pipespec.verifier.prep")

#: A JSON schema deeper than this many nested objects / arrays (of its JSON text), or with more values in all, is
#: refused before compiling: xgrammar's compile time grows fast with nesting (nested anyOf: super-exponentially).
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 5000
#: The child process's start-up (imports xgrammar and torch) is bounded apart from the compile limit.
CHILD_START_TIMEOUT_S = 120.0
_LEN = struct.Struct(">I")


def check_schema_bounds(spec: GrammarSpec, max_depth: int = MAX_SCHEMA_DEPTH,
                        max_nodes: int = MAX_SCHEMA_NODES) -> None:
    """Refuse (:class:`ParamError`) a ``json_schema`` spec nested deeper than ``max_depth`` or with more than
    ``max_nodes`` JSON values. The depth is measured on the text before parsing (a deeply nested text would make
    ``json.loads`` recurse out of its stack)."""
    if spec.kind != "json_schema":
        return
    depth = deepest = 0
    in_string = escaped = False
    for ch in spec.value:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > max_depth:
        raise ParamError(f"json_schema: nested {deepest} levels deep; at most {max_depth} levels (objects and "
                         "arrays of its JSON text) are accepted")
    try:
        stack = [json.loads(spec.value)]
    except ValueError as exc:
        raise ParamError(f"json_schema: not valid JSON: {exc}") from None
    nodes = 0
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ParamError(f"json_schema: more than {max_nodes} JSON values; at most {max_nodes} are accepted")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# ------------------------------------------------------------------------------------------- the compiling child
def _write(stream: Any, obj: Any) -> None:
    data = json.dumps(obj).encode()
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
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the grammar compiler process exited")
        out += chunk
    return bytes(out)


def _read(fd: int, deadline: float | None) -> Any:
    head = _read_exact(fd, _LEN.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0], deadline)
    return None if body is None else json.loads(body)


class GrammarChild:
    """The process that compiles grammars (``python -m verifier_node.request_prep``), spoken to over its stdin and
    stdout with length-prefixed JSON. :meth:`compile` is a ``compile_with`` for
    :class:`verifier_node.grammar.GrammarCompiler`. One caller at a time (the preparation worker)."""

    def __init__(self, xgr: Any, info: Any, vocab_size: int, cache_bytes: int, timeout_s: float):
        self.xgr, self.info = xgr, info
        self.vocab_size, self.cache_bytes, self.timeout_s = vocab_size, cache_bytes, timeout_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0  # processes started (a killed one is replaced at the next compile)

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "verifier_node.request_prep"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=root)
        self.proc = proc
        self.starts += 1
        try:
            _write(proc.stdin, {"info": self.info.serialize_json(), "vocab_size": self.vocab_size,
                                "cache_bytes": self.cache_bytes})
            ready = _read(proc.stdout.fileno(), time.monotonic() + CHILD_START_TIMEOUT_S)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise ParamError(f"structured output could not start its compiler process: {exc}") from None
        if ready != {"ready": True}:
            self.close()
            raise ParamError(f"structured output could not start its compiler process: {ready!r:.300}")
        log.info("grammar compiler process %d started", proc.pid)
        return proc

    def compile(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` in the child, within ``timeout_s`` (past it: the child is killed, :class:`ParamError`)."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        try:
            _write(proc.stdin, {"kind": spec.kind, "value": spec.value, "strict": spec.strict})
            reply = _read(proc.stdout.fileno(), time.monotonic() + self.timeout_s)
        except (OSError, EOFError, ValueError) as exc:  # the child crashed on this spec: this request fails
            self.close()
            raise ParamError(f"{spec.kind}: the grammar engine failed on it ({exc})") from None
        if reply is None:
            log.warning("grammar compile of a %s spec ran past %.3g s: compiler process killed", spec.kind,
                        self.timeout_s)
            self.close()
            raise ParamError(f"{spec.kind}: compiling it took longer than verifier.grammar_compile_timeout_s "
                             f"({self.timeout_s:g} s); simplify the schema or grammar")
        if "error" in reply:
            raise ParamError(reply["error"])
        return self.xgr.CompiledGrammar.deserialize_json(reply["ok"], self.info)

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
    compiler = GrammarCompiler(None, setup["vocab_size"], [], cache_bytes=setup["cache_bytes"], info=info)
    _write(out, {"ready": True})
    while True:
        try:
            request = _read(fd, None)
        except EOFError:
            return
        try:
            compiled = compiler.compile_uncached(GrammarSpec(request["kind"], request["value"],
                                                                 bool(request.get("strict", True))))
            _write(out, {"ok": compiled.serialize_json()})
        except ParamError as exc:
            _write(out, {"error": str(exc)})
        except Exception as exc:  # any failure is this spec's, reported to its request
            _write(out, {"error": f"{request['kind']}: the grammar engine failed on it: {exc!r:.300}"})


# ---------------------------------------------------------------------------------------------- the worker thread
@dataclass
class PrepJob:
    """One request being prepared: what the loop checked (``params``, the drafter type it wants), and what the
    worker made of it (``prompt`` ids and ``grammar`` matcher, or ``error``)."""

    peer: bytes
    msg: Generate
    params: GenerationParams
    wanted: str | None
    scope: str | None = None  # the request's tenant (opaque id): the grammar cache's scope too (None: shared)
    prompt: list[int] | None = None
    grammar: Any = None
    error: ProtocolError | None = None
    cancelled: bool = False

    @property
    def key(self) -> tuple[bytes, int]:
        return self.peer, self.msg.request_id


class RequestPrep:
    """The bounded preparation worker (see the module's docstring). ``prepare(job)`` fills a job in the worker
    thread (raising :class:`ParamError` / :class:`ProtocolError` for the request); ``hook``, for tests, runs in the
    worker before each job (a slow tokenizer or compile)."""

    def __init__(self, prepare: Callable[[PrepJob], None], max_pending: int, *,
                 hook: Callable[[PrepJob], None] | None = None, ctx: zmq.Context | None = None):
        self.prepare = prepare
        self.max_pending = max_pending
        self.hook = hook
        self.pending: dict[tuple[bytes, int], PrepJob] = {}
        self._todo: queue.Queue[PrepJob | None] = queue.Queue()
        self._done: collections.deque[PrepJob] = collections.deque()
        ctx = ctx or zmq.Context.instance()
        address = f"inproc://pipespec-prep-{id(self)}"
        self.socket = ctx.socket(zmq.PAIR)  # the loop's end: readable when a job is done
        self.socket.bind(address)
        self._wake = ctx.socket(zmq.PAIR)  # the worker's end (used by the worker thread only)
        self._wake.connect(address)
        self._thread: threading.Thread | None = None

    def __contains__(self, key: tuple[bytes, int]) -> bool:
        return key in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, job: PrepJob) -> None:
        """Queue ``job``; beyond ``max_pending`` requests it is refused with ``busy``."""
        if len(self.pending) >= self.max_pending:
            raise ProtocolError(f"verifier is preparing {len(self.pending)} requests, its limit "
                                f"(verifier.max_pending_requests = {self.max_pending}): retry later", "busy",
                                job.msg.request_id)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="pipespec-prep", daemon=True)
            self._thread.start()
        self.pending[job.key] = job
        self._todo.put(job)

    def cancel(self, key: tuple[bytes, int]) -> PrepJob | None:
        """Drop a pending request (its result is thrown away); the job, or None if it was not pending."""
        job = self.pending.pop(key, None)
        if job is not None:
            job.cancelled = True
        return job

    def clients(self) -> set[bytes]:
        return {peer for peer, _ in self.pending}

    def finished(self) -> list[PrepJob]:
        """The jobs the worker has finished since the last call (cancelled ones left out); never blocks."""
        with contextlib.suppress(zmq.Again):
            while True:
                self.socket.recv(zmq.NOBLOCK)
        out = []
        while self._done:
            job = self._done.popleft()
            if self.pending.get(job.key) is job:
                del self.pending[job.key]
                out.append(job)
        return out

    def _work(self) -> None:
        while (job := self._todo.get()) is not None:
            if job.cancelled:
                continue
            try:
                if self.hook is not None:
                    self.hook(job)
                self.prepare(job)
            except ProtocolError as exc:
                job.error = exc
            except ParamError as exc:
                job.error = ProtocolError(str(exc), "bad_request", job.msg.request_id)
            except Exception as exc:  # a bug fails this request, never the worker
                log.exception("preparing request %d failed", job.msg.request_id)
                job.error = ProtocolError(f"the verifier failed to prepare this request: {exc!r:.300}",
                                          "internal_error", job.msg.request_id)
            self._done.append(job)
            with contextlib.suppress(zmq.Again):  # the loop has wake-ups unread already: one is enough
                self._wake.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Stop the worker (after the job it is on) and close the sockets."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout=2)  # a compile in work ends when its child is killed (GrammarChild.kill)
        self._wake.close(linger=0)
        self.socket.close(linger=0)


if __name__ == "__main__":
    _child_main()
