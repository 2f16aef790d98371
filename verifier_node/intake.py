"""Request intake: a client's ``generate`` from its arrival to its session.

On the verifier's loop, cheaply: the checks of a ``generate`` (a request id not already running, the session limit,
the tenant's cap, the generation parameters, the drafter type it asks for, what ensemble verification needs) and a
first admission check by memory (:mod:`verifier_node.admission`: the budget and the tenant's share of it) before any
work. A request refused ``busy`` by those limits waits for room a bounded time first
(:mod:`verifier_node.admission_wait`), before or after its preparation. Off the loop, in the preparation
worker (:mod:`verifier_node.request_prep`): the prompt's tokenisation and the grammar's start-up (its compile in a
child process). Once prepared, a request is admitted again by memory (its real prompt length) and handed to the
server, which makes it a session. A request of token ids and no grammar has nothing slow to prepare: it is admitted
at once.

No sockets: the server gives :class:`RequestIntake` a callback that opens a session and one that sends a client the
error of a prepared request; every other refusal is a :class:`ProtocolError` raised to the server's handler (code
``busy``, ``bad_request`` or ``unauthorized``, with the request's id).
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from shared.chat_tools import template_messages
from shared.config import DRAFTER_TYPE_NAMES
from shared.protocol import Generate, ProtocolError, error_frames
from shared.sampling import GenerationParams, ParamError
from verifier_node.admission import MemoryAdmission, fair_share
from verifier_node.admission_wait import RETRY_EVERY_S, AdmissionWait, Waiting
from verifier_node.grammar import GrammarCompiler
from verifier_node.grammar_child import CompilerProcesses
from verifier_node.pool_policy import PoolPolicy
from verifier_node.request_prep import PrepJob, RequestPrep
from verifier_node.session import Session
from verifier_node.tenancy import TenantRule

log = logging.getLogger("pipespec.verifier")

#: Opens the session of an admitted, prepared request (the server's: the session table, its drafter).
OpenSession = Callable[[PrepJob], None]
#: Sends encoded frames to a client (the error of a request that failed while being prepared).
Reply = Callable[[bytes, list], None]


class IntakeSettings(Protocol):
    """What the intake reads of the server's settings (:class:`verifier_node.server.VerifierSettings`)."""

    @property
    def max_sessions(self) -> int: ...
    @property
    def max_sessions_per_tenant(self) -> int | None: ...
    @property
    def max_pending_requests(self) -> int: ...
    @property
    def tenants(self) -> int: ...
    @property
    def admission_wait_s(self) -> float: ...
    @property
    def max_waiting_requests(self) -> int: ...
    @property
    def ensemble_weight(self) -> float | None: ...
    @property
    def grammar_cache_bytes(self) -> int: ...
    @property
    def grammar_compile_timeout_s(self) -> float: ...


class RequestIntake:
    """Checks, prepares and admits the requests of the clients (see the module's docstring). ``sessions``: the
    session table (the scheduler's); ``requests``: its index by ``(client, request_id)`` (the server's); both read
    only here. ``tokenizer``, ``vocab_size`` and ``default_eos``: the target's. ``prep_hook``: for tests, run by
    the preparation worker before each request it prepares (a slow tokenizer or compile)."""

    def __init__(self, settings: IntakeSettings, tokenizer: Any, vocab_size: int, default_eos: list[int], *,
                 admission: MemoryAdmission, sessions: Mapping[int, Session],
                 requests: Mapping[tuple[bytes, int], int], policy: PoolPolicy, tenancy: TenantRule,
                 open_session: OpenSession, reply: Reply, prep_hook: Callable[[PrepJob], None] | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self._worker_tokenizers = threading.local()  # each preparation thread's copy (made at its first prompt)
        self.vocab_size = vocab_size
        self.default_eos = default_eos
        self.admission = admission
        self.sessions = sessions
        self.requests = requests
        self.policy = policy
        self.tenancy = tenancy
        self.open_session = open_session
        self.reply = reply
        self.grammars: GrammarCompiler | None = None  # built at the first request with a grammar (xgrammar optional)
        self.grammar_child: CompilerProcesses | None = None  # where grammars compile (started with self.grammars)
        self._grammar_lock = threading.Lock()  # the compile workers build self.grammars once
        # Tokenising and grammar compiles run off the loop, fair per tenant; a finished one wakes it (prep.socket).
        self.prep = RequestPrep(self.prepare_prompt, self.prepare_grammar, settings.max_pending_requests,
                                hook=prep_hook, tenants=settings.tenants)
        self.session_cap = settings.max_sessions_per_tenant  # a tenant's sessions (None: max_sessions only)
        if self.session_cap is None and settings.tenants >= 2:
            self.session_cap = fair_share(settings.max_sessions, settings.tenants)
        self.waiting = AdmissionWait(settings.admission_wait_s, settings.max_waiting_requests, self.session_cap)
        self._retry_at = 0.0
        self._seen_sessions: tuple[int, ...] = ()
        if self.session_cap is not None or admission.per_tenant is not None:
            log.info("verifier: %d tenant(s) configured; each may hold %s sessions and %s of %d KV tokens "
                     "(verifier.max_sessions_per_tenant, verifier.max_kv_tokens_per_tenant)", settings.tenants,
                     self.session_cap or settings.max_sessions, admission.per_tenant or admission.max_kv_tokens,
                     admission.max_kv_tokens)

    # ------------------------------------------------------------------ on the loop
    def receive(self, peer: bytes, msg: Generate, user_id: str | None = None) -> None:
        """Take ``msg`` from client ``peer`` (``user_id``: its ZAP User-Id): admitted at once, or queued for
        preparation. A refusal is a :class:`ProtocolError` with the request's id: ``busy`` (limits, retry later),
        ``unauthorized`` (tenancy) or ``bad_request`` (everything else)."""
        try:
            self._on_generate(peer, msg, user_id)
        except ProtocolError:
            raise  # keeps its code (busy)
        except (ParamError, ValueError) as exc:
            raise ProtocolError(str(exc), code="bad_request", request_id=msg.request_id) from None

    def _on_generate(self, peer: bytes, msg: Generate, user_id: str | None = None) -> None:
        """Cheap checks here, on the loop; the prompt's tokenisation and the grammar's compile in the preparation
        worker (:mod:`verifier_node.request_prep`), after which :meth:`_admit` makes the session. A request of
        token ids and no grammar has nothing slow to prepare: it is admitted at once."""
        rid = msg.request_id
        if (peer, rid) in self.requests or (peer, rid) in self.prep or (peer, rid) in self.waiting:
            raise ParamError(f"request_id {rid} is already running for this client")
        tenant = self.tenancy.tenant_of(msg, user_id)  # (docs/security.md)
        params = self._params(msg)
        wanted = self._wanted_type(msg.drafter_type)
        live = [d for d in self.policy.pool.live() if wanted is None or d.type == wanted]
        if live and all(self.policy.lacks_q(params, d) for d in live):
            raise ParamError(
                f"ensemble verification needs the draft distribution q; drafter type {live[0].type!r} sends none "
                "under greedy decoding (use do_sample=true, or a drafter that sends q when greedy)"
            )
        if params.grammar_spec is not None and self.settings.ensemble_weight is not None:
            raise ParamError("structured output cannot be combined with static ensemble verification")
        job = PrepJob(peer, msg, params, wanted, scope=tenant)
        try:
            self._fits(job)
        except ProtocolError as exc:
            if exc.code != "busy":
                raise
            self.waiting.add(job, False, exc, time.monotonic())  # waits for room (or raises its busy)
            return
        self._start(job)

    def _fits(self, job: PrepJob) -> None:
        """``busy`` where ``job`` does not fit now: the session limit, its tenant's cap, the KV budget (its tenant's
        share), checked with one prompt token before a text prompt is tokenised."""
        msg = job.msg
        if len(self.sessions) + len(self.prep) >= self.settings.max_sessions:
            raise ProtocolError(f"verifier is at its limit of {self.settings.max_sessions} sessions", "busy",
                                msg.request_id)
        self._check_tenant_cap(job.scope, msg.request_id)
        self._admission_check(job, len(msg.token_ids) if msg.token_ids is not None else 1)  # before any work

    def _start(self, job: PrepJob) -> None:
        """A request that fits: to the preparation worker (its own ``busy`` where its queue is full), or its session
        at once."""
        msg = job.msg
        if msg.token_ids is None or job.params.grammar_spec is not None:
            self.prep.submit(job)
            return
        self.prepare(job)
        self._admit(job)

    def _check_tenant_cap(self, tenant: str | None, rid: int) -> None:
        """``busy`` where ``tenant`` holds its cap of sessions (being prepared counts)."""
        cap = self.session_cap
        if cap is None:
            return
        held = sum(1 for s in self.sessions.values() if s.tenant == tenant) + sum(
            1 for job in self.prep.pending.values() if job.scope == tenant)  # being prepared counts too
        if held >= cap:
            raise ProtocolError(f"your requests hold {held} of your {cap} sessions (verifier.max_sessions_per_tenant)"
                                ": retry later", "busy", rid)

    def _params(self, msg: Generate) -> GenerationParams:
        """The request's generation parameters: the target's end tokens unless it names its own, a seed if none."""
        params_in = dict(msg.params)
        params_in.setdefault("eos_token_ids", self.default_eos)
        params = GenerationParams.from_dict(params_in, self.vocab_size)
        if params.seed is None:
            params.seed = secrets.randbits(62)
        return params

    def _wanted_type(self, value: str | None) -> str | None:
        """``generate.drafter_type``: None (any drafter), or a type name known to pipespec or present in the pool.
        A known type with no live drafter is not an error: the request takes plain steps until one joins."""
        if value is None:
            return None
        known = set(DRAFTER_TYPE_NAMES) | self.policy.pool.types()
        if value not in known:
            raise ParamError(f"drafter_type must be one of {', '.join(sorted(known))}, got {value!r}")
        return value

    def _admission_check(self, job: PrepJob, prompt_len: int) -> None:
        in_use = own = 0
        for s in self.sessions.values():
            held = s.prompt_len + s.params.max_new_tokens
            in_use += held
            if s.tenant == job.scope:
                own += held
        self.admission.check(prompt_len, job.params.max_new_tokens, in_use, job.msg.request_id, own)

    def admit_prepared(self) -> None:
        """Admit the requests the preparation worker has finished and those waiting for room that fit now (or send
        their errors); never blocks."""
        for job in self.prep.finished():
            try:
                if job.error is not None:
                    raise job.error
                try:
                    self._admit(job)
                except ProtocolError as exc:
                    if exc.code != "busy":
                        raise
                    self.waiting.add(job, True, exc, time.monotonic())
            except ProtocolError as exc:
                self._refuse(job, exc.code, str(exc))
            except (ParamError, ValueError) as exc:
                self._refuse(job, "bad_request", str(exc))
        if len(self.waiting):
            self._retry_waiting()

    def _refuse(self, job: PrepJob, code: str, message: str) -> None:
        self.reply(job.peer, error_frames(message, code, request_id=job.msg.request_id))

    def _retry_waiting(self) -> None:
        """The waiting requests whose wait ended get their ``busy``; the others are tried again where the sessions
        changed since the last try, or :data:`RETRY_EVERY_S` passed."""
        now = time.monotonic()
        for entry in self.waiting.expired(now):
            self._refuse(entry.job, "busy", f"{entry.refusal} (after waiting {self.waiting.wait_s:g} s for room, "
                                            "verifier.admission_wait_s)")
        seen = tuple(self.sessions)
        if seen == self._seen_sessions and now < self._retry_at:
            return
        self._seen_sessions, self._retry_at = seen, now + RETRY_EVERY_S
        self.waiting.retry(self._attempt)

    def _attempt(self, entry: Waiting) -> None:
        """Try a waiting request again: ``busy`` raised (it waits on); any other refusal is answered here."""
        try:
            if entry.prepared:
                self._admit(entry.job)
            else:
                self._fits(entry.job)  # busy: it waits on
                try:
                    self._start(entry.job)
                except ProtocolError as exc:  # the preparation queue's busy too: answered, not waited on
                    self._refuse(entry.job, exc.code, str(exc))
        except ProtocolError as exc:
            if exc.code == "busy":
                raise
            self._refuse(entry.job, exc.code, str(exc))
        except (ParamError, ValueError) as exc:
            self._refuse(entry.job, "bad_request", str(exc))

    def _admit(self, job: PrepJob) -> None:
        """A prepared request becomes a session, if its tokens fit (:mod:`verifier_node.admission`)."""
        assert job.prompt is not None
        self._admission_check(job, len(job.prompt))
        self.open_session(job)

    def cancel(self, key: tuple[bytes, int]) -> bool:
        """Drop the request ``key`` if it is being prepared (its result is thrown away) or waits for room; whether
        it was."""
        return self.prep.cancel(key) is not None or self.waiting.cancel(key) is not None

    def clients(self) -> set[bytes]:
        """The clients with requests being prepared or waiting for room (sessions aside)."""
        return self.prep.clients() | self.waiting.clients()

    def drop_client(self, peer: bytes) -> list[int]:
        """Drop every request of client ``peer`` being prepared or waiting (it vanished); their request ids."""
        keys = [k for k in (*self.prep.pending, *self.waiting.keys()) if k[0] == peer]
        for key in keys:
            self.cancel(key)
        return [rid for _, rid in keys]

    def close(self) -> None:
        """Stop the preparation worker and the grammar child (a compile in work ends now)."""
        if self.grammar_child is not None:
            self.grammar_child.kill()  # a compile in work ends now, so the worker can stop
        self.prep.close()
        if self.grammar_child is not None:
            self.grammar_child.close()

    # ------------------------------------------------------------------ in the preparation worker
    def prepare(self, job: PrepJob) -> None:
        """Fill ``job``: the prompt's ids and the grammar's matcher (on the loop: a request with nothing slow to
        prepare)."""
        self.prepare_prompt(job)
        self.prepare_grammar(job)

    def prepare_prompt(self, job: PrepJob) -> None:
        """The prompt's ids (a tokenising thread of :class:`RequestPrep`)."""
        job.prompt = self._prompt_ids(job.msg)

    def prepare_grammar(self, job: PrepJob) -> None:
        """The grammar's matcher (a compile worker of :class:`RequestPrep`)."""
        job.grammar = self._grammar(job.params, job.scope)

    def _grammar(self, params: GenerationParams, scope: str | None = None):
        """The request's grammar matcher (structured output), or None. Compiled in a child process (cached per
        ``(scope, kind, value)``), from a compile worker; a spec the engine refuses, one that compiles too long, or
        a verifier without xgrammar, is a ``ParamError`` (the client's 400; the spec's bounds were checked before)."""
        spec = params.grammar_spec
        if spec is None:
            return None
        try:
            with self._grammar_lock:
                if self.grammars is None:
                    grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.default_eos,
                                               cache_bytes=self.settings.grammar_cache_bytes)
                    self.grammar_child = CompilerProcesses(grammars.xgr, grammars.info, self.vocab_size,
                                                           self.settings.grammar_compile_timeout_s)
                    grammars.compile_with = self.grammar_child.compile
                    self.grammars = grammars
            return self.grammars.session(spec, params.end_token_ids, scope)
        except ParamError:
            raise
        except Exception as exc:  # the engine failed on this tokenizer or matcher: this request only, never the node
            log.exception("structured output failed to start")
            raise ParamError(f"structured output could not start on this target: {exc!r:.300}") from None

    def _prompt_ids(self, msg: Generate) -> list[int]:
        """The prompt's token ids. Runs in a tokenising thread, with a copy of the tokenizer of its own: the loop
        detokenises with ``self.tokenizer`` meanwhile, and a Rust tokenizer object is not meant to be shared."""
        # decode checked the types and that exactly one of token_ids, prompt and messages is given
        if msg.token_ids is not None:
            ids = msg.token_ids
        else:
            mine = getattr(self._worker_tokenizers, "tokenizer", None)
            if mine is None:
                mine = self._worker_tokenizers.tokenizer = copy.deepcopy(self.tokenizer)
            ids = _encode(mine, msg)
        if not ids:
            raise ParamError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ParamError(f"token ids must be in [0, {self.vocab_size})")
        return list(ids)


def _encode(tokenizer: Any, msg: Generate) -> list[int]:
    """``msg``'s prompt text or chat messages as token ids (a ParamError where the tokenizer or template refuses)."""
    if msg.prompt is not None:
        try:
            return tokenizer(msg.prompt, add_special_tokens=True)["input_ids"]
        except Exception as exc:  # a tokenizer may refuse odd text (lone surrogates, …)
            raise ParamError(f"the target's tokenizer cannot encode the prompt: {exc!r:.300}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("the target's tokenizer has no chat template; send prompt or token_ids")
    try:
        # tools: only when given (a template that takes none may still test `tools is defined`)
        extra = {"tools": msg.tools} if msg.tools is not None else {}
        return tokenizer.apply_chat_template(template_messages(msg.messages), add_generation_prompt=True,
                                             tokenize=True, return_dict=True, **extra)["input_ids"]
    except Exception as exc:  # the template's own raise_exception, or one that fails on these messages
        raise ParamError(f"the target's chat template failed on these messages: {exc!r:.300}") from None
