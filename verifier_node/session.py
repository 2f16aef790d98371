"""One generation request on the verifier: the committed sequence, its KV cache, and one verification round.

The committed sequence is the single source of truth. The cache always holds every committed token but the last
(the *pending* token), so a round feeds ``[pending, d1 … dk]`` in one forward and crops back afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.protocol import DrafterStats, TokenLogprob
from shared.sampling import GenerationParams, make_generator, process_block
from shared.spec_rates import acceptance_rate, per_position, tokens_per_round
from shared.target import SequenceHandle, TargetBackend
from verifier_node.acceptance import AcceptRule, accept_greedy, accept_sampling
from verifier_node.detokenize import IncrementalText
from verifier_node.draft_wait import DraftWait
from verifier_node.grammar import GrammarPlan, SessionGrammar
from verifier_node.logprobs import RawLogprob, committed_logprobs
from verifier_node.pending_draft import PendingDraft
from verifier_node.tree import DraftTree, accept_tree_greedy, keep_path, kept_rows, process_tree, tree_forward


class NumericalError(RuntimeError):
    """A round's processed scores are not usable (NaN, +inf, or no finite score in a row): the session ends with an
    error (code ``numerical_error``) instead of a draw from a broken distribution."""


@dataclass
class RoundResult:
    base_len: int
    tokens: list[int]  # committed this round: accepted drafts + the target's own token (cut at EOS / budget)
    accepted: int
    drafted: int
    hidden: torch.Tensor | None  # last hidden states of the newly cached positions, when a drafter needs them
    kv: dict[str, torch.Tensor] | None = None  # K/V rows of the newly cached positions (``kv.{layer}``), when asked
    forward_s: float = 0.0  # the target forward's time (a cost-curve sample of batch_tokens over batch_sessions rows)
    threads: int = 0  # torch threads it ran with
    batch_sessions: int = 1  # sessions in that forward
    batch_tokens: int = 0  # tokens it ran over, every row's
    logprobs: list[RawLogprob] | None = None  # per committed token, when the request asked (params.logprobs)


@dataclass
class RoundPlan:
    """One round of one session, before its forward: the committed length, the budget left, the draft it verifies
    (cut to the budget) and its q rows."""

    base_len: int
    remaining: int
    draft: list[int]
    q: torch.Tensor | None
    started: float
    fed: list[int]  # the pending token and the draft: what the forward feeds
    tree: DraftTree | None = None  # the draft as a token tree (cut to the budget); None: a chain
    grammar: GrammarPlan | None = None  # structured output: the masks of every row, the matcher steps taken


#: The parts of a round's wall time (``RoundTiming``), in the order the metrics list them.
ROUND_PARTS = ("draft_wait", "forward", "accept", "publish", "other")


@dataclass
class RoundTiming:
    """Where one session's decoding time went, summed over its rounds. A round's wall time runs from the moment
    its previous round was published (or its prefill done) to the moment this one's commit and chunk were sent:

    * ``draft_wait``: waiting for its drafter's block (the drafter's steps and the message's transit);
    * ``forward``: the target forward (a batched forward's whole time: the session waited that long);
    * ``accept``: scores, the acceptance rule, cache crop (``finish_round``);
    * ``publish``: encoding and sending the commit and the chunk;
    * ``other``: the rest — the loop, reading and decoding messages, other sessions' rounds and prefills.

    ``overhead`` (all but the forward and the draft wait) is what the runtime adds to the bare forward."""

    rounds: int = 0
    wall_s: float = 0.0
    draft_wait_s: float = 0.0
    forward_s: float = 0.0
    accept_s: float = 0.0
    publish_s: float = 0.0

    def add(self, wall_s: float, draft_wait_s: float, forward_s: float, accept_s: float, publish_s: float) -> None:
        self.rounds += 1
        self.wall_s += wall_s
        self.draft_wait_s += draft_wait_s
        self.forward_s += forward_s
        self.accept_s += accept_s
        self.publish_s += publish_s

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.draft_wait_s - self.forward_s - self.accept_s - self.publish_s)

    def summary(self) -> dict:
        n = max(self.rounds, 1)
        parts = {"draft_wait": self.draft_wait_s, "forward": self.forward_s, "accept": self.accept_s,
                 "publish": self.publish_s, "other": self.other_s}
        return {"rounds": self.rounds, "ms_per_round": {k: round(1000 * parts[k] / n, 3) for k in ROUND_PARTS},
                "wall_ms_per_round": round(1000 * self.wall_s / n, 3),
                "overhead_ms_per_round": round(1000 * (self.accept_s + self.publish_s + self.other_s) / n, 3)}


@dataclass
class SessionMetrics:
    """Counters in vLLM's terms plus the pipeline's own (see docs/metrics.md)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    fallback_rounds: int = 0  # rounds verified without a draft (solo rounds included here; not in the summary's)
    solo_rounds: int = 0  # rounds the drafter's plan gave to the verifier alone (k = 0)
    stale_drafts: int = 0
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_drafted: list[int] = field(default_factory=list)
    verify_s: float = 0.0
    message_s: float = 0.0  # verifier time spent decoding drafts and encoding/sending commits and chunks
    transit_s: float = 0.0  # draft send → receive, summed (same-host clocks)
    bytes_in: int = 0
    bytes_out: int = 0
    drafter_stats: DrafterStats = field(default_factory=DrafterStats)  # the latest draft's (Draft.stats)
    verify_batch_sum: int = 0  # sessions in the target forwards of its rounds, summed (÷ rounds: verify_batch_mean)
    tree_rounds: int = 0  # rounds that verified a token tree (not a chain)
    side_accepted: int = 0  # … whose accepted path took a node that is not its parent's first child (a side leaf)
    timing: RoundTiming = field(default_factory=RoundTiming)
    # Target forwards against the start-up profile's time for the same tokens, threads and context, while its
    # drafter idles ("alone") and while it computes too ("shared"): [forwards, measured s, profiled s] each.
    forward_profile: dict[str, list[float]] = field(
        default_factory=lambda: {"alone": [0, 0.0, 0.0], "shared": [0, 0.0, 0.0]})

    def record_forward(self, shared: bool, measured_s: float, profiled_s: float) -> None:
        sums = self.forward_profile["shared" if shared else "alone"]
        sums[0] += 1
        sums[1] += measured_s
        sums[2] += profiled_s

    def record(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One round that verified ``drafted`` draft tokens and accepted ``accepted`` of them. For a tree, ``drafted``
        counts its nodes and ``depth`` is its deepest position: the per-position counts go by depth (a position
        counts once however many candidates it had, and is accepted when the accepted path reached it)."""
        self.rounds += 1
        if drafted == 0:
            self.fallback_rounds += 1
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        positions = drafted if depth is None else depth
        while len(self.per_position_drafted) < positions:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(positions):
            self.per_position_drafted[i] += 1
            self.per_position_accepted[i] += int(i < accepted)


def _drafter_timing(stats: DrafterStats) -> dict:
    """The drafter's own timing sums (``stats.timing``), per block sent, in ms."""
    timing, blocks = stats.timing, max(stats.blocks, 1)
    out = {f"{k.removesuffix('_s')}_ms_per_block": round(1000 * v / blocks, 3)
           for k, v in vars(timing).items() if k.endswith("_s") and k != "roundtrip_s"}
    if timing.profile_s:  # the drafter's own forwards against its start-up profile
        out["forward_vs_profile"] = round(timing.forward_s / timing.profile_s, 3)
    if timing.roundtrips:
        out["roundtrip_ms"] = round(1000 * timing.roundtrip_s / timing.roundtrips, 3)
    return out


def _forward_vs_profile(sums: dict[str, list[float]]) -> dict:
    """Per kind of forward (``alone``, ``shared``): how many, and measured time ÷ the start-up profile's."""
    return {kind: {"forwards": int(n), "ratio": round(measured / profiled, 3)}
            for kind, (n, measured, profiled) in sums.items() if n and profiled > 0}


def _plan_rates(stats: DrafterStats) -> dict:
    """Per plan the drafter used: rounds, the tokens/s its cost model predicted (mean over the rounds) and the
    tokens/s the rounds gave (committed tokens over the time between commits)."""
    out = {}
    for name, (rounds, tokens, seconds, predicted) in stats.plan_rates.items():
        if rounds:
            out[name] = {"rounds": int(rounds), "predicted_tokens_per_s": round(predicted / rounds, 3),
                         "realised_tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None}
    return out


class Session:
    """State of one request on the verifier."""

    def __init__(
        self, sid: int, backend: TargetBackend, tokenizer, prompt: list[int], params: GenerationParams,
        client: bytes, request_id: int, ensemble_weight: float | None = None, drafter_type: str | None = None,
        wait: DraftWait | None = None, accept: AcceptRule | None = None, grammar: SessionGrammar | None = None,
    ):
        """``backend``: the target's, where its KV memory lives and its forwards run (:mod:`shared.target`)."""
        self.sid = sid
        self.grammar = grammar  # structured output: the request's matcher (verifier_node.grammar)
        self.params = params
        self._end_ids = params.end_token_ids  # a set built per read: once per session, not per round
        self.ensemble_weight = ensemble_weight  # static ensemble verification against w·p + (1 − w)·q (lossy)
        self.accept_rule = accept  # replaces the method's rule: tests' negative controls only (tests/node_entry.py)
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.client = client
        self.request_id = request_id
        # Its KV cache: a handle sized for the prompt and the whole budget (``close`` gives it back).
        self.backend = backend
        self.lm: SequenceHandle = backend.open(len(prompt) + params.max_new_tokens)
        self.prefilled = False
        self.cached_prompt = 0  # prompt tokens the prefill's chunks cached so far
        # What the prefill's chunks collect for the drafter it was started for (its needs: hidden states, K/V rows)
        self.prefill_for = None
        self.prefill_needs: tuple[bool, list[int]] | None = None
        self._chunk_hidden: list[torch.Tensor] = []
        self._chunk_kv: list[dict[str, torch.Tensor]] = []
        self.ready_since = time.monotonic()
        self.timed_from = self.ready_since  # the end of its last round's publish (RoundTiming's clock)
        self.draft: PendingDraft | None = None  # the draft waiting for this round, if any
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.finished: str | None = None  # finish reason once done
        self.text = IncrementalText(tokenizer)
        self.logprobs: list[TokenLogprob] = []  # every committed token's, when the request asks (params.logprobs)
        self.metrics = SessionMetrics()
        self.announced = False  # the current drafter knows this session
        self.drafter = None  # the pool's DrafterLink serving this session (verifier_node.drafters); None: plain steps
        self.drafter_type = drafter_type  # the type the request asked for (None: any)
        self.tenant: str | None = None  # its tenant's opaque id (verifier_node.tenancy; None: no tenant)
        self.wait = wait or DraftWait(3.0)  # how long to wait for its drafter's next draft (verifier_node.draft_wait)
        self.served_by: list[str] = []  # ids of the drafters that served it, in order
        self.tried: set[str] = set()  # drafters demoted for it (not chosen again when it moves)
        self.solo_left = 0  # rounds still to take alone, without waiting for a draft (the drafter chose k = 0)
        # Its drafter needs no state and is announced after the first round (RoundRunner.run_batch): the drafter's
        # own prefill then never runs beside the target's prefill or the forward of the first token.
        self.announce_after_round = False

    def close(self) -> None:
        """The session ended: its KV memory goes back to the backend."""
        self.lm.close()

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def prompt_to_cache(self) -> list[int]:
        """What the prefill still feeds: every prompt token but the last (the first round feeds that one), less the
        tokens earlier chunks cached."""
        return self.tokens[self.cached_prompt : self.prompt_len - 1] if self.prompt_len > 1 else []

    def prefill_chunk(self, limit: int | None) -> list[int]:
        """The prefill's next chunk: the next ``limit`` prompt tokens to cache (None: all of them)."""
        left = self.prompt_to_cache
        return left if limit is None else left[:limit]

    def prefill(
        self, want_hidden: bool = False, kv_layers: list[int] = (), chunk_tokens: int | None = None
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None]:
        """Cache every prompt token but the last, in forwards of its own (of at most ``chunk_tokens`` each; None:
        one); return the hidden states and K/V rows of the cached positions when asked (``kv_layers``: target layer
        indices)."""
        while True:
            t0 = time.monotonic()
            chunk = self.prefill_chunk(chunk_tokens)
            hidden = self.feed_prompt(chunk, want_hidden)
            done = self.chunk_fed(len(chunk), hidden, kv_layers, time.monotonic() - t0)
            if done is not None:
                return done

    def feed_prompt(self, chunk: list[int], want_hidden: bool = False) -> torch.Tensor | None:
        """A chunk of the prompt's forward alone (no logits); its last hidden states when asked."""
        if not chunk:
            return None
        _, hidden = self.lm.feed(chunk, want_hidden=want_hidden, last_logits_only=True)
        return hidden

    def chunk_fed(
        self, count: int, hidden: torch.Tensor | None, kv_layers: list[int] = (), forward_s: float = 0.0
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None] | None:
        """After the forward of the prompt's next ``count`` tokens (its own, or a batch's of several prompts that
        took ``forward_s``): keep the chunk's hidden states and K/V rows (``kv_layers``); once the whole prompt is
        cached, the session is ready for rounds and this returns the hidden states and K/V rows of every cached
        prompt position (None while chunks are left)."""
        if count:
            if hidden is not None:
                self._chunk_hidden.append(hidden)
            if kv_layers:
                self._chunk_kv.append(self.lm.new_rows(list(kv_layers), count, count))
            self.lm.crop(self.lm.length)  # sliding layers: back to their window between chunks
            self.cached_prompt += count
        self.metrics.verify_s += forward_s
        if self.prompt_to_cache:
            return None
        hidden = torch.cat(self._chunk_hidden) if self._chunk_hidden else None
        kv = ({name: torch.cat([c[name] for c in self._chunk_kv], dim=2) for name in self._chunk_kv[0]}
              if self._chunk_kv else None)
        self._chunk_hidden, self._chunk_kv = [], []
        self.prefilled = True
        self.ready_since = self.timed_from = time.monotonic()
        return hidden, kv

    def plan_round(self, draft: list[int], q: torch.Tensor | None, parents: list[int] | None = None) -> RoundPlan:
        """What this round feeds: the pending token and the draft, cut so the round commits at most the tokens the
        budget has left. ``parents``: the draft is a token tree (greedy, no q; see :mod:`verifier_node.tree`), cut
        to the nodes of depth at most the budget."""
        draft, q, parents = self._capped(draft, q, parents)
        base_len = len(self.tokens)
        remaining = self.params.max_new_tokens - (base_len - self.prompt_len)
        if self.grammar is not None:
            # Trees are not masked (a matcher per branch): a grammar session verifies chains only, and a tree's
            # tokens are dropped for this round (the drafter's next block follows the commit as usual).
            if parents is not None:
                draft, q = [], None
            g = self.grammar.plan(list(draft), q, max(0, remaining - 1))
            return RoundPlan(base_len, remaining, g.draft, g.q, time.monotonic(), [self.tokens[-1], *g.draft],
                             grammar=g)
        if parents is not None:
            tree = DraftTree(list(draft), list(parents)).truncate(max(0, remaining - 1))
            room = self.lm.room
            if room is not None and len(tree) + 1 > room:  # near a KV slot's end: a plain step this round
                tree = DraftTree([], [])
            if len(tree):
                return RoundPlan(base_len, remaining, tree.tokens, None, time.monotonic(),
                                 [self.tokens[-1], *tree.tokens], tree)
            draft = []
        draft = draft[: max(0, remaining - 1)]  # the round commits at most len(draft) + 1 tokens
        if q is not None:
            q = q[: len(draft)]
        return RoundPlan(base_len, remaining, draft, q, time.monotonic(), [self.tokens[-1], *draft])

    def _capped(self, draft: list[int], q: torch.Tensor | None, parents: list[int] | None
                ) -> tuple[list[int], torch.Tensor | None, list[int] | None]:
        """The draft cut to the request's ``num_draft_tokens`` (a chain's first k tokens and q rows, a tree's nodes of
        depth at most k): verifying a prefix of a draft is lossless, so a drafter that planned longer costs no
        exactness, only its wasted steps."""
        cap = self.params.num_draft_tokens
        if cap is None or len(draft) <= cap:
            return draft, q, parents
        if parents is not None:
            tree = DraftTree(list(draft), list(parents)).truncate(cap)
            return tree.tokens, None, tree.parents
        return draft[:cap], q[:cap] if q is not None else None, None

    def verify(
        self, draft: list[int], q: torch.Tensor | None, want_hidden: bool = False, kv_layers: list[int] = (),
        parents: list[int] | None = None,
    ) -> RoundResult:
        """Run one round on top of the committed prefix (a forward of its own) and commit its outcome. With
        ``want_hidden`` / ``kv_layers`` the result carries the hidden states / K/V rows of exactly the newly cached
        (committed) positions (chains only). ``parents``: the draft is a token tree."""
        plan = self.plan_round(draft, q, parents)
        t_forward = time.monotonic()
        logits, hidden = self.round_forward(plan, want_hidden)
        return self.finish_round(plan, logits, hidden, time.monotonic() - t_forward, kv_layers)

    def round_forward(self, plan: RoundPlan, want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's forward of its own: ``plan.fed`` onto the cache (a tree with its tree mask and positions)."""
        if plan.tree is not None:
            return tree_forward(self.backend, self.lm, plan.fed[0], plan.tree, want_hidden)
        return self.lm.feed(plan.fed, want_hidden=want_hidden)

    def finish_round(
        self, plan: RoundPlan, logits: torch.Tensor, hidden: torch.Tensor | None, forward_s: float,
        kv_layers: list[int] = (), batch_sessions: int = 1, batch_tokens: int = 0,
    ) -> RoundResult:
        """Accept from the target's ``logits`` over ``plan.fed`` (just appended to this session's cache, alone or in
        a batched forward), commit, and crop the cache back to every committed token but the last."""
        if plan.tree is not None:
            return self._finish_tree(plan, logits, forward_s, batch_sessions, batch_tokens)
        base_len, remaining, draft, q = plan.base_len, plan.remaining, plan.draft, plan.q
        prefix = self.params.context(self.tokens, self.prompt_len)  # what the processors read of the sequence
        masks = plan.grammar.masks if plan.grammar is not None else None
        scores = process_block(
            logits, prefix, torch.tensor(draft, dtype=torch.long), self.params, base_len - self.prompt_len, masks
        )
        self._check_finite(scores, base_len)
        if self.accept_rule is not None:
            out = self.accept_rule(scores, draft, q, self._generator(base_len))
        elif self.params.do_sample:
            out = accept_sampling(scores, draft, q, self._generator(base_len), self.ensemble_weight)
        else:
            out = accept_greedy(scores, draft, q, self.ensemble_weight)
        accepted = len(out) - 1
        out = self._cut_at_end(out, remaining)
        if plan.grammar is not None and not self.finished:
            self.grammar.commit(plan.grammar, out, accepted)  # the matcher follows the committed text
        self.tokens.extend(out)
        # The cache gains len(out) positions: the pending token and the accepted drafts (the rest are cropped).
        kv = self.lm.new_rows(list(kv_layers), len(draft) + 1, len(out)) if kv_layers else None
        self.lm.crop(len(self.tokens) - 1)
        drafted, ours = plan.grammar.drafter_counts(accepted) if plan.grammar is not None else (len(draft), accepted)
        self.metrics.record(drafted, ours)
        self._round_done(plan, batch_sessions)
        if hidden is not None:
            hidden = hidden[: len(out)]
        # row i chose or confirmed out[i]: the accepted drafts, then the correction or the bonus
        return RoundResult(base_len, out, ours, drafted, hidden, kv, forward_s,
                           batch_sessions=batch_sessions, batch_tokens=batch_tokens or len(draft) + 1,
                           logprobs=self._logprobs(scores, list(range(len(out))), out))

    def _finish_tree(self, plan: RoundPlan, logits: torch.Tensor, forward_s: float, batch_sessions: int,
                     batch_tokens: int) -> RoundResult:
        """:meth:`finish_round` for a token tree (greedy only): the longest path of target argmaxes, its K/V moved
        in place behind the pending token, the rest cropped. No hidden states or K/V rows: the verifier takes trees
        only from drafters that need neither."""
        tree, base_len = plan.tree, plan.base_len
        prefix = torch.tensor(self.tokens, dtype=torch.long)
        scores = process_tree(logits, prefix, tree, self.params, base_len - self.prompt_len)
        self._check_finite(scores, base_len)
        outcome = accept_tree_greedy(scores, tree)
        accepted = len(outcome.nodes)
        out = self._cut_at_end(outcome.tokens, plan.remaining)
        self.tokens.extend(out)
        keep_path(self.backend, self.lm, len(tree), outcome.nodes)
        self.lm.crop(len(self.tokens) - 1)
        self.metrics.record(len(tree), accepted, depth=max(tree.depths()))
        self.metrics.tree_rounds += 1
        if any(tree.children(tree.parents[i])[0] != i for i in outcome.nodes):
            self.metrics.side_accepted += 1
        self._round_done(plan, batch_sessions)
        # the pending token's row chose the first token, each accepted node's row the token after it
        return RoundResult(base_len, out, accepted, len(tree), None, None, forward_s,
                           batch_sessions=batch_sessions, batch_tokens=batch_tokens or len(tree) + 1,
                           logprobs=self._logprobs(scores, kept_rows(outcome.nodes), out))

    def _logprobs(self, scores: torch.Tensor, rows: list[int], out: list[int]) -> list[RawLogprob] | None:
        """The committed tokens' log probabilities (verifier_node.logprobs), only when the request asked."""
        if self.params.logprobs is None:
            return None
        return committed_logprobs(scores, rows, out, self.params.logprobs)

    def _check_finite(self, scores: torch.Tensor, base_len: int) -> None:
        # One reduction per row: the max is NaN if any score is, +inf for an overflow, -inf when nothing is left.
        if not torch.isfinite(scores.amax(dim=-1)).all():
            self.lm.crop(base_len - 1)  # the fed positions go: the session ends, but its cache stays consistent
            raise NumericalError(f"session {self.sid}: the target's scores at position {base_len} are not finite")

    def _round_done(self, plan: RoundPlan, batch_sessions: int) -> None:
        """The bookkeeping every committed round ends with (chain or tree)."""
        self.metrics.verify_batch_sum += batch_sessions
        self.metrics.verify_s += time.monotonic() - plan.started
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.ready_since = time.monotonic()

    def _generator(self, base_len: int) -> torch.Generator:
        return make_generator(self.params.seed or 0, base_len, stream=0)

    def _cut_at_end(self, out: list[int], remaining: int) -> list[int]:
        out = out[:remaining]
        ends = self._end_ids
        for i, token in enumerate(out):
            if token in ends:
                self.finished = "stop"
                return out[: i + 1]
        if len(out) >= remaining:
            self.finished = "length"
        return out

    def summary(self, verifier_dtype: str | None = None, drafter_dtype: str | None = None) -> dict:
        """Per-request metrics returned to the client."""
        m, d = self.metrics, self.metrics.drafter_stats
        elapsed = max(time.monotonic() - self.started, 1e-9)
        new = len(self.generated)
        rounds = max(m.rounds, 1)
        return {
            "new_tokens": new,
            "prompt_tokens": self.prompt_len,
            "rounds": m.rounds,
            "drafts": m.drafts,
            "draft_tokens": m.draft_tokens,
            "accepted_tokens": m.accepted_tokens,
            "acceptance_rate": acceptance_rate(m.accepted_tokens, m.draft_tokens, empty=0.0),
            "mean_accepted_length": tokens_per_round(m.accepted_tokens, m.drafts, empty=1.0),
            "per_position_acceptance": per_position(m.per_position_accepted, m.per_position_drafted),
            # the counts behind the rates (summable across requests: the HTTP server's Prometheus counters)
            "per_position_accepted": list(m.per_position_accepted),
            "per_position_drafted": list(m.per_position_drafted),
            "fallback_rounds": m.fallback_rounds - m.solo_rounds,
            "solo_rounds": m.solo_rounds,
            "plans": d.plans,
            "verifier_dtype": verifier_dtype,
            "drafter_dtype": drafter_dtype or d.dtype,
            "stale_drafts": m.stale_drafts,
            "tree_rounds": m.tree_rounds,  # rounds that verified a token tree
            "side_accepted": m.side_accepted,  # … that accepted a side leaf (the drafter's second choice)
            "drafter_tree_blocks": d.tree_blocks,  # trees the drafter sent
            "tokens_per_second": new / elapsed,
            **_ceiling(new, elapsed, self.first_token_at and self.first_token_at - self.started,
                       d.ceiling_tokens_per_second),
            "elapsed_s": elapsed,
            "time_to_first_token_s": (self.first_token_at - self.started) if self.first_token_at else None,
            "verifier_busy_fraction": m.verify_s / elapsed,
            "drafter_busy_fraction": d.busy_s / elapsed,
            "predraft_hits": d.predraft_hits,
            "predraft_hit_rate": d.predraft_hits / max(d.blocks, 1),
            "rolled_back_draft_tokens": d.rolled_back,
            "bytes_per_round": (m.bytes_in + m.bytes_out) / rounds,
            "message_overhead_ms_per_round": 1000 * m.message_s / rounds,
            "draft_transit_ms": 1000 * m.transit_s / m.drafts if m.drafts else 0.0,
            "verify_batch_mean": m.verify_batch_sum / m.rounds if m.rounds else 0.0,
            "draft_batch_mean": d.batch_rows / d.batch_steps if d.batch_steps else 0.0,
            "round_timing": m.timing.summary(),
            "forward_vs_profile": _forward_vs_profile(m.forward_profile),
            "drafter_timing": _drafter_timing(d),
            "plan_rates": _plan_rates(d),
            "plan_check": dict(vars(d.plan_check)) if d.plan_check else None,  # the start-up plan checked
            "seed": self.params.seed,
            # structured output: tokens the grammar forced, drafted for free (not in the draft/accept counts)
            "grammar_forced_tokens": self.grammar.forced_tokens if self.grammar is not None else 0,
            # its masks' fill time over the request (verifier_node.masks: each round's share is budgeted)
            "grammar_mask_ms": round(1000 * self.grammar.mask_s_total, 3) if self.grammar is not None else 0.0,
            "ensemble_weight": self.ensemble_weight,  # not None: lossy by design (output distribution w·p + (1−w)·q)
        }


def _ceiling(new: int, elapsed: float, first_token_s: float | None, ceiling: float | None) -> dict[str, Any]:
    """The request's decoding rate (tokens after the first, over the time after it: the prefill is not decoding)
    against the ceiling the drafter computed (the cost model's best plan at the acceptance this request realised,
    the nodes' measured forward costs, no overhead; docs/metrics.md). None where there is nothing to compare."""
    decode = (new - 1) / (elapsed - first_token_s) if first_token_s is not None and new > 1 and \
        elapsed > first_token_s else None
    return {"decode_tokens_per_second": decode, "ceiling_tokens_per_second": ceiling or None,
            "ceiling_fraction": decode / ceiling if decode and ceiling else None}
