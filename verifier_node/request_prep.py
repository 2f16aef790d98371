"""Request preparation off the verifier's loop, fair to every tenant: tokenising prompts and compiling grammars.

The verifier has one I/O loop (:mod:`verifier_node.server`); a 4 MiB prompt or a grammar that takes seconds to
compile must not stall every other session's rounds, nor one tenant's requests every other tenant's. So a
``generate`` is checked cheaply on the loop (ids, limits, session and queue counts) and handed to
:class:`RequestPrep`, where it is *pending*: it has no session yet, so the scheduler never sees it; a ``cancel`` or a
silent client drops it, and its payload with it. It goes through two stages, each a small pool of threads of its own
fed by a :class:`FairQueue` (one queue per tenant, taken round robin, at most one request per tenant in work):

1. **tokenising** (:data:`PREP_THREADS` threads): the spec's bounds (nesting, size, repeat counts:
   :func:`verifier_node.schema_check.check_spec_bounds`) and the prompt's ids or chat template. Never queued behind
   a compile.
2. **compiling** (:data:`COMPILE_WORKERS` threads, requests with a grammar only): each worker compiles in a child
   process of its own (:mod:`verifier_node.grammar_child`, a warm spare ready for one that is killed). A tenant with
   slow specs queued waits for its own compiles; another tenant's take the other worker.

At most ``verifier.max_pending_requests`` requests are pending (more get ``busy``), and where two or more tenants
share the verifier (``verifier.tenants``) one tenant at most half of them, so another tenant always finds room. A
compile past ``verifier.grammar_compile_timeout_s`` fails its request with a 400, and the same spec from the same
tenant (kept by a hash, per tenant: another tenant learns nothing from it) is refused at once, without compiling, for
:data:`TIMED_OUT_REFUSE_S` (at most :data:`TIMED_OUT_KEPT` specs kept). The workers wake the loop through an inproc
PAIR socket in the loop's poller, and the loop admits the finished request (:mod:`verifier_node.admission`) or sends
its error.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from shared.protocol import Generate, ProtocolError
from shared.sampling import GenerationParams, GrammarSpec, ParamError
from verifier_node.grammar_child import CompileOverBudget
from verifier_node.schema_check import (  # noqa: F401 - the bounds are part of this module's interface
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    check_schema_bounds,
    check_spec_bounds,
)

log = logging.getLogger("pipespec.verifier.prep")

#: Threads that tokenise prompts (and check specs' bounds).
PREP_THREADS = 2
#: Threads that compile grammars, each with a child process of its own.
COMPILE_WORKERS = 2
#: A spec whose compile ran past its deadline is refused at once, for its tenant, for this long.
TIMED_OUT_REFUSE_S = 300.0
#: Timed-out specs remembered at most (the oldest is forgotten first).
TIMED_OUT_KEPT = 4096

Scope = str | None


@dataclass
class PrepJob:
    """One request being prepared: what the loop checked (``params``, the drafter type it wants), and what the
    workers made of it (``prompt`` ids and ``grammar`` matcher, or ``error``)."""

    peer: bytes
    msg: Generate
    params: GenerationParams
    wanted: str | None
    scope: str | None = None  # the request's tenant (opaque id): the grammar cache's scope too (None: shared)
    prompt: list[int] | None = None
    grammar: Any = None
    error: ProtocolError | None = None
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)  # a burst's prompt gather waits for recent arrivals

    @property
    def key(self) -> tuple[bytes, int]:
        return self.peer, self.msg.request_id


class FairQueue:
    """Jobs waiting for a pool of threads, one queue per tenant: :meth:`take` serves the tenants round robin and
    never gives out a second job of a tenant that has one in work (until :meth:`done`). Thread-safe."""

    def __init__(self) -> None:
        self._tenants: OrderedDict[Scope, OrderedDict[tuple[bytes, int], PrepJob]] = OrderedDict()
        self._busy: set[Scope] = set()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return sum(len(jobs) for jobs in self._tenants.values())

    def put(self, job: PrepJob) -> None:
        with self._cond:
            if job.cancelled:  # cancelled on the loop while a worker was handing it on: dropped here
                return
            self._tenants.setdefault(job.scope, OrderedDict())[job.key] = job
            self._cond.notify()

    def remove(self, job: PrepJob) -> bool:
        """Drop ``job`` if it is waiting (the queue holds nothing of it afterwards)."""
        with self._cond:
            jobs = self._tenants.get(job.scope)
            if jobs is None or jobs.get(job.key) is not job:
                return False
            del jobs[job.key]
            if not jobs:
                del self._tenants[job.scope]
            return True

    def take(self) -> PrepJob | None:
        """The next job, blocking until one may be taken; None once closed."""
        with self._cond:
            while not self._closed:
                for scope, jobs in self._tenants.items():
                    if scope not in self._busy:
                        _, job = jobs.popitem(last=False)
                        del self._tenants[scope]
                        if jobs:  # back of the round
                            self._tenants[scope] = jobs
                        self._busy.add(scope)
                        return job
                self._cond.wait()
            return None

    def done(self, job: PrepJob) -> None:
        """``job`` (taken) is no longer in work: its tenant may have the next one."""
        with self._cond:
            self._busy.discard(job.scope)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._tenants.clear()
            self._cond.notify_all()


def _spec_key(scope: Scope, spec: GrammarSpec) -> tuple[Scope, str, bool, str]:
    return scope, spec.kind, spec.strict, hashlib.sha256(spec.value.encode("utf-8", "surrogatepass")).hexdigest()


class TimedOutSpecs:
    """The specs whose compile ran past its deadline, per tenant, refused at once for ``refuse_s``. Thread-safe."""

    def __init__(self, refuse_s: float = TIMED_OUT_REFUSE_S, kept: int = TIMED_OUT_KEPT):
        self.refuse_s, self.kept = refuse_s, kept
        self._specs: OrderedDict[tuple, tuple[float, str]] = OrderedDict()  # key -> (when, the error)
        self._lock = threading.Lock()

    def add(self, scope: Scope, spec: GrammarSpec, error: str) -> None:
        with self._lock:
            key = _spec_key(scope, spec)
            self._specs.pop(key, None)
            self._specs[key] = (time.monotonic(), error)
            while len(self._specs) > self.kept:
                self._specs.popitem(last=False)

    def check(self, scope: Scope, spec: GrammarSpec) -> None:
        """:class:`ParamError` if ``spec`` timed out for ``scope`` less than ``refuse_s`` ago."""
        key = _spec_key(scope, spec)
        with self._lock:
            entry = self._specs.get(key)
            if entry is None:
                return
            ago = time.monotonic() - entry[0]
            if ago >= self.refuse_s:
                del self._specs[key]
                return
        raise ParamError(f"{entry[1]} ({ago:.0f} s ago; this spec is refused without compiling for "
                         f"{self.refuse_s - ago:.0f} s more)")


class RequestPrep:
    """The bounded, fair preparation pools (see the module's docstring). ``tokenise(job)`` fills a job's prompt
    (stage 1), ``compile(job)`` its grammar (stage 2, requests with a grammar only); either raises
    :class:`ParamError` / :class:`ProtocolError` for the request. ``hook``, for tests, runs in stage 1 before each
    job (a slow tokenizer or compile)."""

    def __init__(self, tokenise: Callable[[PrepJob], None], compile: Callable[[PrepJob], None], max_pending: int,
                 *, hook: Callable[[PrepJob], None] | None = None, ctx: zmq.Context | None = None,
                 threads: int = PREP_THREADS, compile_workers: int = COMPILE_WORKERS, tenants: int = 1):
        self.tokenise, self.compile = tokenise, compile
        self.max_pending = max_pending
        self.tenants = tenants  # >= 2: one tenant holds at most half of max_pending (a single user holds them all)
        self.hook = hook
        self.timed_out = TimedOutSpecs()
        self.pending: dict[tuple[bytes, int], PrepJob] = {}
        self._stage1, self._stage2 = FairQueue(), FairQueue()
        self._sizes = {"tokenise": threads, "compile": compile_workers}
        self._threads: dict[str, list[threading.Thread]] = {"tokenise": [], "compile": []}
        self._done: collections.deque[PrepJob] = collections.deque()
        ctx = ctx or zmq.Context.instance()
        address = f"inproc://pipespec-prep-{id(self)}"
        self.socket = ctx.socket(zmq.PAIR)  # the loop's end: readable when a job is done
        self.socket.bind(address)
        self._wake = ctx.socket(zmq.PAIR)  # the workers' end (one sender at a time: _wake_lock)
        self._wake.connect(address)
        self._wake_lock = threading.Lock()
        self._closed = False

    def __contains__(self, key: tuple[bytes, int]) -> bool:
        return key in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def tenant_limit(self) -> int:
        """Requests one tenant may have pending: half of ``max_pending`` (at least one) where two or more tenants
        share the verifier, else all of them."""
        return max(1, self.max_pending // 2) if self.tenants >= 2 else self.max_pending

    # ------------------------------------------------------------------ on the loop
    def submit(self, job: PrepJob) -> None:
        """Queue ``job``; ``busy`` past ``max_pending`` requests or the tenant's share of them, ``bad_request`` for
        a spec of this tenant that ran past its compile deadline lately."""
        rid = job.msg.request_id
        if len(self.pending) >= self.max_pending:
            raise ProtocolError(f"verifier is preparing as many requests as it may (verifier.max_pending_requests "
                                f"= {self.max_pending}): retry later", "busy", rid)
        held = sum(1 for other in self.pending.values() if other.scope == job.scope)
        if held >= self.tenant_limit:
            raise ProtocolError(f"this tenant has {held} requests being prepared, its most (half of "
                                f"verifier.max_pending_requests = {self.max_pending}): retry later", "busy", rid)
        spec = job.params.grammar_spec
        if spec is not None:
            try:
                self.timed_out.check(job.scope, spec)
            except ParamError as exc:
                raise ProtocolError(str(exc), "bad_request", rid) from None
        self._start("tokenise", self._tokenise_loop)
        self.pending[job.key] = job
        self._stage1.put(job)

    def cancel(self, key: tuple[bytes, int]) -> PrepJob | None:
        """Drop a pending request: out of its queue with its payload (a job in work has its result thrown away);
        the job, or None if it was not pending."""
        job = self.pending.pop(key, None)
        if job is not None:
            job.cancelled = True  # before removing: a worker handing it on sees the flag (FairQueue.put)
            self._stage1.remove(job)
            self._stage2.remove(job)
        return job

    def clients(self) -> set[bytes]:
        return {peer for peer, _ in self.pending}

    def finished(self) -> list[PrepJob]:
        """The jobs the workers have finished since the last call (cancelled ones left out); never blocks."""
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

    # ------------------------------------------------------------------ in the workers
    def _start(self, stage: str, loop: Callable[[], None]) -> None:
        threads = self._threads[stage]
        while len(threads) < self._sizes[stage]:
            threads.append(threading.Thread(target=loop, name=f"pipespec-prep-{stage}-{len(threads)}", daemon=True))
            threads[-1].start()

    def _tokenise_loop(self) -> None:
        while (job := self._stage1.take()) is not None:
            try:
                if job.cancelled:
                    continue
                spec = job.params.grammar_spec if self._run(job, self._first_stage) else None
                if spec is not None and self._run(job, self._not_timed_out):
                    self._start("compile", self._compile_loop)
                    self._stage2.put(job)
                else:
                    self._finish(job)
            finally:
                self._stage1.done(job)

    def _first_stage(self, job: PrepJob) -> None:
        if self.hook is not None:
            self.hook(job)
        spec = job.params.grammar_spec
        if spec is not None:
            check_spec_bounds(spec)  # before the prompt: a spec past the bounds never waits for anything
        self.tokenise(job)

    def _not_timed_out(self, job: PrepJob) -> None:
        spec = job.params.grammar_spec
        if spec is not None:
            self.timed_out.check(job.scope, spec)

    def _compile_loop(self) -> None:
        while (job := self._stage2.take()) is not None:
            try:
                if job.cancelled:
                    continue
                if self._run(job, self._not_timed_out):
                    self._run(job, self.compile)
                self._finish(job)
            finally:
                self._stage2.done(job)

    def _run(self, job: PrepJob, step: Callable[[PrepJob], None]) -> bool:
        """``step(job)``; a failure becomes the job's error (False)."""
        try:
            step(job)
            return True
        except ProtocolError as exc:
            job.error = exc
        except ParamError as exc:
            if isinstance(exc, CompileOverBudget) and job.params.grammar_spec is not None:
                self.timed_out.add(job.scope, job.params.grammar_spec, str(exc))
            job.error = ProtocolError(str(exc), "bad_request", job.msg.request_id)
        except Exception as exc:  # a bug fails this request, never the worker
            log.exception("preparing request %d failed", job.msg.request_id)
            job.error = ProtocolError(f"the verifier failed to prepare this request: {exc!r:.300}",
                                      "internal_error", job.msg.request_id)
        return False

    def _finish(self, job: PrepJob) -> None:
        self._done.append(job)
        with self._wake_lock, contextlib.suppress(zmq.Again):  # the loop has wake-ups unread already: one is enough
            if not self._closed:
                self._wake.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Stop the workers (after the job each is on) and close the sockets."""
        self._stage1.close()
        self._stage2.close()
        deadline = time.monotonic() + 2  # a compile in work ends when its child is killed (CompilerProcesses.kill)
        for thread in self._threads["tokenise"] + self._threads["compile"]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._wake_lock:
            self._closed = True
            self._wake.close(linger=0)
        self.socket.close(linger=0)
