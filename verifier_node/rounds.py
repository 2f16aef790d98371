"""The verifier's forwards: a batch of prompts cached in one prefill, a batch of rounds verified in one target
forward (each row accepted, committed and published on its own), the fallback to one forward per session when a
batched one fails or cannot run, the forward counters and the thread count each forward runs with.

The runner knows no socket: what it announces, publishes and ends goes through :class:`RoundOutput` (the server);
which sessions run, and what their drafters are doing, it reads from the scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shared.config_sections import VerifierConfig
from shared.cores import CoreLeases
from shared.costs.cache import CurveCheck
from shared.models import ThreadPlan, set_threads
from shared.target import Row, SequenceHandle, TargetBackend
from verifier_node.masks import MaskWorkers
from verifier_node.pending_draft import NO_DRAFT
from verifier_node.scheduler import Scheduler
from verifier_node.session import RoundPlan, RoundResult, Session
from verifier_node.tree import tree_row

log = logging.getLogger("pipespec.verifier")
#: ``verifier.grammar_mask_budget_ms``' default (declared there), in seconds.
DEFAULT_MASK_BUDGET_S: float = VerifierConfig.grammar_mask_budget_ms / 1000


@contextlib.contextmanager
def restored_on_failure(lms: list[SequenceHandle]) -> Iterator[None]:
    """Around a batched forward: if it raises, every row's cache holds again exactly what it held before (the
    forward may have grown some rows, or some layers of a row, before it failed), so the per-session forwards that
    follow feed each row from its committed length, not from a stale one."""
    held = [(lm, lm.length) for lm in lms]
    try:
        yield
    except BaseException:
        for lm, length in held:
            lm.restore(length)
        raise


class RoundOutput(Protocol):
    """What the runner's rounds send out and end (the server's side of them)."""

    def announce(self, s: Session, hidden: torch.Tensor | None = None,
                 kv: dict[str, torch.Tensor] | None = None) -> None:
        """Tell the session's drafter about it (with the prompt's state where its drafter needs it)."""

    def publish(self, s: Session, result: RoundResult, decoding: int) -> None:
        """Send a round's commit to the drafter and its chunk to the client."""

    def finish(self, s: Session, reason: str) -> None:
        """End a session that finished (``done`` to its client)."""

    def round_failed(self, s: Session, exc: Exception) -> None:
        """End a session whose round failed (an error to its client)."""

    def demoted(self, s: Session) -> None:
        """Its drafter kept missing for it: move it after this round."""


@dataclass
class PendingRound:
    """One session's part of a verification round between taking its draft and the target forward."""

    session: Session
    plan: RoundPlan | None  # None while a grammar session's plan is in work (verifier_node.masks)
    solo: bool  # a round the drafter's k = 0 plan gave to the verifier alone
    demoted: bool  # its drafter missed once too often: move the session after this round
    drafter_busy: bool  # its drafter pre-drafts while this round runs (the verifier keeps its thread share)
    want_hidden: bool
    kv_layers: list[int]
    timed_from: float = 0.0  # when the session's previous round was published (the round's wall time starts)
    draft_wait_s: float = 0.0  # of that, waiting for its drafter's block
    make_plan: Callable[[], RoundPlan] | None = None  # a grammar session's plan, run on a mask worker


@dataclass
class ForwardCounts:
    """What the verifier's ``pong`` reports of its forwards, and the recent forward time."""

    forwards: int = 0
    batch_sessions_sum: int = 0
    batch_tokens_sum: int = 0
    prefill_forwards: int = 0
    prefill_sessions_sum: int = 0
    forward_s_ema: float = 0.0  # recent verification forward time (bounds the wait for drafts on their way)

    def count_forward(self, sessions: int, tokens: int, seconds: float) -> None:
        self.forward_s_ema = 0.8 * self.forward_s_ema + 0.2 * seconds
        self.forwards += 1
        self.batch_sessions_sum += sessions
        self.batch_tokens_sum += tokens

    def count_prefill(self, sessions: int) -> None:
        self.prefill_forwards += 1
        self.prefill_sessions_sum += sessions

    def pong_stats(self) -> dict[str, int | float]:
        """These counts as the ``pong``'s fields (:class:`shared.protocol.Pong`; a mean over no forwards is 0.0)."""
        n, p = self.forwards, self.prefill_forwards
        return {"forwards": n, "mean_batch_sessions": self.batch_sessions_sum / n if n else 0.0,
                "mean_batch_tokens": self.batch_tokens_sum / n if n else 0.0, "prefill_forwards": p,
                "mean_prefill_sessions": self.prefill_sessions_sum / p if p else 0.0}


#: A prompt of at most this many tokens to cache is announced to a drafter that needs no state at its first chunk:
#: the drafter prefills its copy beside ours in about a drafting step's time, and the first round can use its draft
#: (a request of two or three tokens would otherwise never be drafted for). A longer prompt's drafter is announced
#: after the first round, so its prefill never runs beside ours: on a shared CPU two prompt forwards at once made a
#: long prompt's first token (and request) slower than the target alone.
SHORT_PROMPT_TOKENS = 64


class ThreadSwitch:
    """The node's torch thread count now: its share while a drafter computes at the same time, every core while
    none does (``threads: auto``). ``apply`` sets it (``set_threads``; tests record it)."""

    def __init__(self, plan: ThreadPlan, apply: Callable[[int], None] = set_threads):
        self.plan = plan
        self.apply = apply
        self.now = plan.share  # set by the node's start-up

    def use(self, count: int) -> None:
        if count != self.now:
            self.apply(count)
            self.now = count


class RoundRunner:
    """Runs the prefills and rounds the scheduler picked. ``forward_delay_s`` (tests): seconds slept before each
    target forward, a target slow enough that other work gets ahead."""

    def __init__(self, backend: TargetBackend, scheduler: Scheduler, out: RoundOutput, threads: ThreadSwitch,
                 curve_check: CurveCheck, forward_delay_s: float = 0.0, cores: CoreLeases | None = None,
                 mask_budget_s: float = DEFAULT_MASK_BUDGET_S):
        self.backend = backend  # the target's: every forward of the verifier runs through it (shared.target)
        self.scheduler = scheduler
        self.out = out
        self.threads = threads
        self.curve_check = curve_check
        self.forward_delay_s = forward_delay_s
        self.cores = cores  # each forward's lease on the CPU cores (shared.cores); None: threads as planned
        self.counts = ForwardCounts()
        self.masks = MaskWorkers(mask_budget_s)  # grammar sessions' masks: off the loop, within a budget

    @contextlib.contextmanager
    def computing(self) -> Iterator[int]:
        """Around a forward: lease the cores the thread plan wants now (fewer where another process's forward holds
        some); yields the thread count the forward runs with."""
        if self.cores is None:
            yield self.threads.now
            return
        with self.cores.hold(self.threads.now) as granted:
            yield granted

    # ------------------------------------------------------------------ prefills
    @property
    def chunk_tokens(self) -> int:
        """Most prompt tokens of one session a prefill forward feeds (a longer prompt takes several turns)."""
        return self.scheduler.limits.max_prefill_tokens

    def prefill_batch(self, sessions: list[Session]) -> None:
        """Cache the next chunk of each prompt of ``sessions`` (one forward over all of them when there are several;
        a chunk is at most ``max_prefill_tokens``, so a long prompt takes several turns and the running sessions'
        rounds come between them). A session whose whole prompt is cached is announced to its drafter (with the
        prompt's state, collected over its chunks, where its drafter needs it). A failure ends only the session it
        belongs to."""
        # A prompt is one long forward: every core. A drafter that needs the prompt's state is announced after the
        # last chunk; one that needs none after the first round (the first token comes at the target's own speed,
        # then the drafter prefills its copy while we wait for its block), or at the first chunk for a short prompt
        # (see SHORT_PROMPT_TOKENS).
        self.threads.use(self.threads.plan.full)
        for s in list(sessions):
            try:
                if s.prefill_needs is None:  # its first chunk: what its drafter needs is collected over the chunks
                    d = s.drafter
                    s.prefill_for = d
                    s.prefill_needs = (bool(d and d.needs_hidden), list(d.kv_layers) if d else [])
                    if not any(s.prefill_needs) and len(s.prompt_to_cache) <= SHORT_PROMPT_TOKENS:
                        self.out.announce(s)
            except Exception as exc:
                self.out.round_failed(s, exc)
                sessions.remove(s)
        chunks = [s.prefill_chunk(self.chunk_tokens) for s in sessions]
        with self.computing():
            fed = self._prompt_forward(sessions, chunks)
        for s, chunk, done in zip(sessions, chunks, fed):
            if done is None:
                continue  # its forward failed (reported)
            try:
                want_hidden, kv_layers = s.prefill_needs
                state = s.chunk_fed(len(chunk), done[0] if want_hidden else None, kv_layers, done[1])
                if state is None:
                    continue  # chunks left: the next on a later turn
                d = s.drafter
                if d is not None and not s.announced and not (d.needs_hidden or d.kv_layers):
                    s.announce_after_round = True  # after the first token (run_batch)
                elif d is not s.prefill_for:  # moved while its chunks ran: announced as a move announces
                    self.out.announce(s, kv=s.lm.held_rows(d.kv_layers) if d is not None and d.kv_layers else None)
                elif want_hidden or kv_layers:
                    self.out.announce(s, *state)
                s.wait.ready(len(s.tokens), s.ready_since)
            except Exception as exc:
                self.out.round_failed(s, exc)

    def _prompt_forward(self, sessions: list[Session], chunks: list[list[int]]) -> list[tuple | None]:
        """The forward of the prompts' next ``chunks``: one over every chunk when batching allows it, else one each.
        Per session: (hidden states or None, forward seconds), or None where its forward failed (the session
        ended)."""
        self._forward_delay()
        rows = [i for i, chunk in enumerate(chunks) if chunk]
        want_hidden = [bool(s.prefill_needs and s.prefill_needs[0]) for s in sessions]

        def together() -> list[tuple]:
            t0 = time.monotonic()
            with restored_on_failure([sessions[i].lm for i in rows]):
                outs = self.backend.feed_rows([Row(sessions[i].lm, chunks[i]) for i in rows],
                                              want_hidden=any(want_hidden[i] for i in rows), logits=False)
            seconds = time.monotonic() - t0
            self.counts.count_prefill(len(rows))
            hidden = {i: o.hidden for i, o in zip(rows, outs)}
            return [(hidden.get(i), seconds) for i in range(len(sessions))]

        def alone(i: int) -> tuple:
            s, t0 = sessions[i], time.monotonic()
            hidden = s.feed_prompt(chunks[i], want_hidden[i])
            if chunks[i]:
                self.counts.count_prefill(1)
            return hidden, time.monotonic() - t0

        return self.together_or_each("prefill", len(rows), sessions, together, alone)

    def together_or_each(self, what: str, rows: int, sessions: list[Session], together: Callable[[], list],
                         alone: Callable[[int], Any]) -> list:
        """``together()``: one batched forward's per-session results, when batching is on and there are several
        ``rows``; if it raises (its caches rolled back to where they were: :func:`restored_on_failure`) or does not
        apply, ``alone(i)`` for each session, where a
        failure ends that session only and gives None."""
        if rows > 1 and self.scheduler.limits.batching:
            try:
                return together()
            except Exception:  # every session gets a forward of its own instead
                log.exception("a batched %s over %d sessions failed; running them one by one", what, rows)
        results = []
        for i, s in enumerate(sessions):
            try:
                results.append(alone(i))
            except Exception as exc:
                self.out.round_failed(s, exc)
                results.append(None)
        return results

    # ------------------------------------------------------------------ rounds
    def begin_round(self, s: Session) -> PendingRound:
        """Take the session's draft (or none: a plain step) for this round and note what its drafter needs back."""
        d = s.drafter
        now = time.monotonic()
        could_use = self.scheduler.may_wait(s, now) or (s.draft is not None and s.solo_left == 0)
        waited = (s.draft.arrived if s.draft is not None else now) - s.ready_since
        demoted = could_use and s.wait.outcome(s.draft is not None, max(0.0, waited))
        draft = s.draft or NO_DRAFT
        s.draft = None
        if draft.idle_rounds:
            s.solo_left = draft.idle_rounds
        solo = s.solo_left > 0
        s.solo_left = max(0, s.solo_left - 1)
        drafter_busy = bool(draft.tokens and draft.overlap and d is not None and d.alive() and not solo)
        gap = max(0.0, now - s.timed_from)
        draft_wait = min(gap, max(0.0, waited)) if could_use else 0.0
        r = PendingRound(s, None, solo, demoted, drafter_busy, bool(d and d.needs_hidden),
                         list(d.kv_layers) if d else [], s.timed_from, draft_wait)
        if s.grammar is not None:  # its masks are filled on a mask worker (verifier_node.masks)
            r.make_plan = lambda: s.plan_round(draft.tokens, draft.q, draft.parents)
        else:
            r.plan = s.plan_round(draft.tokens, draft.q, draft.parents)
        return r

    def _begin_rounds(self, batch: list[Session]) -> list[PendingRound]:
        """The rounds of ``batch`` ready for the forward: plain ones at once, grammar ones whose plans are ready
        (one held over from an earlier batch, or one done within a short wait: the whole budget only when no other
        session could use the loop meanwhile). A grammar session whose plan is still in work joins a later batch."""
        rounds, planning = [], []
        self.masks.forget(set(self.scheduler.sessions))
        for s in batch:
            try:
                held = self.masks.take(s)
                r = held if held is not None else self.begin_round(s)
                if r.plan is None:
                    self.masks.start(r)  # fills while the other rows begin
                    planning.append(r)
                else:
                    rounds.append(r)
            except Exception as exc:
                self.out.round_failed(s, exc)
        if planning:
            alone = not rounds and len(self.scheduler.sessions) == len(planning)
            ready, failed = self.masks.collect(
                planning, self.masks.budget_s if alone else self.masks.grace_s(self.counts.forward_s_ema))
            rounds.extend(ready)
            for s, exc in failed:
                self.out.round_failed(s, exc)
        return rounds

    def run_batch(self, batch: list[Session]) -> None:
        """One verification round for every session of ``batch``: one target forward over all of them (batched
        verification), each row accepted, committed and published on its own. A failure in one row ends that
        session only."""
        rounds = self._begin_rounds(batch)
        if not rounds:
            return
        # Every core while the drafters idle (k = 0, synchronous blocks, no drafter); the share while one pre-drafts
        # for a row of this round or drafts a block for a session left out of it (its drafter computes meanwhile).
        busy = any(r.drafter_busy for r in rounds) or self.scheduler.drafting_elsewhere(batch, time.monotonic())
        self.threads.use(self.threads.plan.share if busy else self.threads.plan.full)
        decoding = self.scheduler.decoding()
        with self.computing() as threads:
            forwards = self._forward(rounds)
        # A lease short of the plan's count: another process computed meanwhile (a "shared" forward).
        busy = busy or threads < self.threads.now
        if not busy and len(rounds) == 1 and forwards[0][0] is not None:  # timed alone: a sample of the profile
            self._check_profile(threads, forwards[0][4], forwards[0][2], len(rounds[0].session.tokens))
        profile = self.curve_check.profile
        for r, (logits, hidden, forward_s, rows, tokens) in zip(rounds, forwards):
            if logits is None:
                continue  # that row's own forward failed (already reported)
            s = r.session
            if profile is not None and profile.curves:
                profiled = profile.curve(threads).cost(tokens, len(s.tokens))
                s.metrics.record_forward(busy, forward_s, profiled)
            try:
                t_accept = time.monotonic()
                result = s.finish_round(r.plan, logits, hidden, forward_s, r.kv_layers, rows, tokens)
                result.threads = threads
                if r.solo:
                    s.metrics.solo_rounds += 1
                s.wait.ready(len(s.tokens), s.ready_since)
                t_publish = time.monotonic()
                self.out.publish(s, result, decoding)
                s.timed_from = done = time.monotonic()
                s.metrics.timing.add(done - r.timed_from, r.draft_wait_s, forward_s, t_publish - t_accept,
                                     done - t_publish)
                if s.grammar is not None and not s.finished:
                    self.masks.peek(s)  # the next round's first mask, off the loop
                if s.finished:
                    self.out.finish(s, s.finished)
                elif r.demoted:
                    self.out.demoted(s)
                elif s.announce_after_round:
                    s.announce_after_round = False
                    if not s.announced and s.drafter is not None:  # not announced meanwhile (a move, a hello)
                        self.out.announce(s)
            except Exception as exc:
                self.out.round_failed(s, exc)

    def _check_profile(self, threads: int, tokens: int, seconds: float, context: int) -> None:
        """Compare a forward timed alone with the profile; a profile that keeps missing is re-measured next start
        (the drafters' plans follow the measured forwards meanwhile: every commit carries its forward's time)."""
        ratio = self.curve_check.forward(threads, tokens, context, seconds)
        if ratio is not None:
            log.warning("verifier: forwards take %.2fx what the cached profile says (measured on a busy machine, or "
                        "the machine changed); the profile is measured again at the next start", ratio)

    def _forward(self, rounds: list[PendingRound]) -> list[tuple]:
        """The target forward(s) of a round: one over every row when batching is on and the target allows it, else
        one per row. Per row: (logits, hidden, forward seconds, sessions in its forward, tokens in its forward); a
        row whose forward failed gets ``None`` logits."""
        self._forward_delay()

        def together() -> list[tuple]:
            tokens = sum(len(r.plan.fed) for r in rounds)
            t0 = time.monotonic()
            with restored_on_failure([r.session.lm for r in rounds]):
                rows = [Row(r.session.lm, r.plan.fed) if r.plan.tree is None else
                        tree_row(r.session.lm, r.plan.fed[0], r.plan.tree) for r in rounds]
                outs = self.backend.feed_rows(rows, any(r.want_hidden for r in rounds))
            forward_s = time.monotonic() - t0
            self.counts.count_forward(len(rounds), tokens, forward_s)
            return [(o.logits, o.hidden if r.want_hidden else None, forward_s, len(rounds), tokens)
                    for r, o in zip(rounds, outs)]

        def alone(i: int) -> tuple:
            r, t0 = rounds[i], time.monotonic()
            logits, hidden = r.session.round_forward(r.plan, want_hidden=r.want_hidden)
            forward_s = time.monotonic() - t0
            self.counts.count_forward(1, len(r.plan.fed), forward_s)
            return logits, hidden, forward_s, 1, len(r.plan.fed)

        results = self.together_or_each("forward", len(rounds), [r.session for r in rounds], together, alone)
        return [(None, None, 0.0, 1, 0) if out is None else out for out in results]

    def _forward_delay(self) -> None:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)  # injected by tests: a target slow enough that other work gets ahead
