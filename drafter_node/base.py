"""The one interface every drafter type implements, and the shared bookkeeping behind it.

A drafter type is a factory (:class:`Drafter`) that opens one :class:`DraftSession` per request. A session keeps
the committed tokens (only ever taken from the verifier's commits) and a speculative *chain* of drafted tokens
beyond them. The node calls three things:

* ``propose(n)`` — extend the chain by up to ``n`` tokens (one cheap step at a time, so the node stays responsive);
* ``observe_commit(tokens, extras)`` — the verifier committed ``tokens``; keep the chain's matching part, drop the
  rest (calling ``rollback``);
* ``rollback(keep)`` — cut the chain to its first ``keep`` tokens and undo any state built on the dropped ones.

Types differ only in how ``propose`` chooses tokens and what ``_truncate`` must undo (a KV cache, nothing, …).

Batched drafting: a type whose step is one forward of a causal LM over its own sequence handle
(:class:`shared.target.SequenceHandle`) may also express that step as :meth:`DraftSession.batch_step` — the rows it
feeds plus a ``finish`` that applies their outputs — so the node runs many sessions' steps as one forward of its
backend's ``feed_rows``. Types that cannot (no model, target state, several forwards per step) return None and step
alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from shared.backend import TargetBackend
from shared.costs.curve import NodeProfile
from shared.models import ProfileSpec
from shared.protocol import Capabilities
from shared.sampling import GenerationParams
from shared.target import Row, RowOutput


@dataclass
class DraftToken:
    token: int
    alt: int | None = None  # the drafter's next-best token here (greedy): its guess for a correction
    prob: float | None = None  # the drafter's probability of ``token`` (greedy; softmax of the processed scores)
    alt_prob: float | None = None  # … and of ``alt``: together they rank a block's outcomes (drafter_node/branches)
    q_idx: torch.Tensor | None = None  # support of q: the distribution it was drawn from (sampling), or the
    q_prob: torch.Tensor | None = None  # drafter's top-m softmax, not renormalised (greedy, when ``want_q``)


@dataclass
class BatchStep:
    """One session's next drafter step as part of a batched forward: the ``rows`` it feeds (on its own caches) and
    ``finish(outputs)``, which applies their outputs (one :class:`~shared.batch.RowOutput` per row, in order) as the
    session's own step would. Until ``finish`` the session's drafting state is unchanged (its cache is at most cropped
    to what the step feeds on top of), so a step that is not run, or whose forward failed, may be taken alone."""

    rows: list[Row]
    finish: Callable[[list[RowOutput]], None]

    @property
    def model(self):
        """What every row runs on (its handles' ``batch_key``: the model or engine): steps batch together only over
        the same one."""
        return self.rows[0].lm.batch_key

    @property
    def tokens(self) -> int:
        """New tokens over all rows (the step's size: pre-draft rows, or the chain tokens it feeds)."""
        return sum(len(row.tokens) for row in self.rows)

    @property
    def width(self) -> int:
        """The longest row: a batched forward pads every row to its longest."""
        return max(len(row.tokens) for row in self.rows)


class DraftSession(ABC):
    """One request's drafting state."""

    def __init__(self, token_ids: list[int], prompt_len: int, params: GenerationParams):
        self.committed: list[int] = list(token_ids)
        self.prompt_len = prompt_len
        self.params = params
        self.chain: list[DraftToken] = []
        #: Send q with greedy drafts too (set by the node when the verifier's welcome says ``want_q``).
        self.want_q = False

    #: True when ``propose`` costs next to nothing (no model forward): the node then asks for whole blocks at once.
    cheap_steps = False
    #: ``begin_speculation`` can pre-draft several outcome rows (not just the all-accepted chain).
    predrafts_rows = False

    @property
    def forward_size(self) -> int:
        """Tokens (or pre-draft rows) the last step's forward ran over: what its time is a cost-curve sample of."""
        return 1

    @property
    def chain_tokens(self) -> list[int]:
        return [d.token for d in self.chain]

    @property
    def ended(self) -> bool:
        """The chain reached an end token: drafting past it is wasted work."""
        return bool(self.chain) and self.chain[-1].token in self.params.end_token_ids

    @abstractmethod
    def propose(self, n: int) -> int:
        """Extend the chain by up to ``n`` tokens; return how many were added (0: nothing to propose now)."""

    def catch_up(self, limit: int) -> int:
        """Feed the next at most ``limit`` committed tokens the drafter's own cache lacks, as one forward, where it
        lacks more than ``limit`` (a new session's prompt: the node then prefills it in chunks of its own, reading
        the verifier's messages and freeing its cores between them); return how many were fed (0: the next step
        feeds the rest with its chain token). Types without a cache of their own keep the default."""
        return 0

    def batch_step(self) -> BatchStep | None:
        """The next step the node would take (``speculate_step`` while speculating, else ``propose(1)``) as rows of a
        batched forward, or None: this session cannot join a batch now and steps alone."""
        return None

    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        """Apply a commit. Returns how many chain tokens it confirmed (all of ``tokens`` matched = a hit)."""
        chain = self.chain_tokens
        matched = 0
        while matched < min(len(chain), len(tokens)) and chain[matched] == tokens[matched]:
            matched += 1
        if matched < len(tokens):
            self.rollback(matched)
            self.chain = []
        else:
            self.chain = self.chain[len(tokens):]
        self.committed.extend(tokens)
        return matched

    def observe_state(self, extras: dict[str, torch.Tensor], end: int) -> None:  # noqa: B027
        """More target state for the committed prefix (rows of positions before ``end``): a long prompt's state
        arrives in pieces after ``session_start``. Types that need no state ignore it."""

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` chain tokens; undo state built on the rest."""
        self.chain = self.chain[:keep]
        self._truncate(len(self.committed) + keep)

    def _truncate(self, length: int) -> None:  # noqa: B027 - stateless types have nothing to undo
        """Forget any state beyond the first ``length`` tokens of committed + chain."""

    def close(self) -> None:  # noqa: B027
        """Release per-session resources."""

    def background(self) -> bool:
        """Do one bounded piece of deferred set-up work (the ``suffix`` type builds a long prompt's trie a budget at
        a time); False: there was none left. The node calls it on turns with nothing else to do, so no session's
        set-up stalls the loop (heartbeats, other sessions' drafts). Types with no such work keep the default."""
        return False

    # Optional multi-outcome pre-drafting (see drafter_node/branches.py). Types without it keep the default:
    # the node then extends the chain on the single assumption that the whole block is accepted.
    def begin_speculation(self, block_len: int, max_rows: int | None = None) -> bool:
        """A block of ``block_len`` chain tokens was sent: start pre-drafting its outcomes (at most ``max_rows`` of
        them, the most likely first; None: all); False if unsupported."""
        return False

    @property
    def speculation_depth(self) -> int | None:
        """Tokens pre-drafted past each outcome, or None when not speculating."""
        return None

    def speculate_step(self) -> None:
        raise NotImplementedError


class Drafter(ABC):
    """A drafter type: loads what it needs once, then opens one session per request.

    Types are built as ``cls(settings, own, profile)`` (:func:`drafter_node.node.load_drafter`):

    * ``settings``: the typed ``drafter`` section, a :class:`drafter_node.settings.DrafterConfig` (the keys every
      type has: ``model``, ``device``, ``dtype``, ``q_top_k``, ``max_draft_tokens``, ``backend``, ...);
    * ``own``: the type's own keys, ``Config.drafter_type`` (:meth:`drafter_node.spec.DrafterSpec.own_settings`):
      an instance of the settings class its spec declares (``drafter_node/type_specs/<name>.py``), or None for a
      type without keys of its own;
    * ``profile``: the start-up cost profile's spec that :func:`shared.models.load_causal_lm` takes (types that load
      no causal LM ignore it).

    Both settings objects are frozen, validated and complete: a type reads their attributes and restates no default
    (each key's default is declared once, in its settings class)."""

    type_name: ClassVar[str]
    capabilities: Capabilities
    tokenizer_id: str
    target_vocab_size: int  # set by the node from the verifier's welcome
    #: A fixed block length (constant schedule) for types whose blocks are not worth tuning; None: the config's.
    block_len: int | None = None
    #: Added to the message when the verifier refuses this drafter's tokenizer (what the user should change).
    tokenizer_hint: str = ""
    #: Drafting costs next to nothing (no model): the cost model then weighs only what verifying a block costs.
    free_drafting: bool = False
    #: Where the sessions' KV caches live and who runs their batched forwards (:mod:`shared.backend`; None: types
    #: without a cache of their own model, whose batched steps, if any, run :func:`shared.batch.feed_rows`).
    backend: TargetBackend | None = None

    @property
    def profile_model(self):
        """The causal LM whose plain forward is this type's drafting step, for the start-up cost profile (None: the
        drafter's costs are learned from the rounds it runs)."""
        return None

    def measure_profile(self, spec: ProfileSpec, progress: Callable[[str], None]) -> NodeProfile | None:
        """The start-up cost profile of a type whose model is not a torch causal LM (``gguf``: llama.cpp), measured
        within ``spec`` (or read from the disk cache); None: :attr:`profile_model`'s, measured by the node."""
        return None

    @abstractmethod
    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        """Start drafting for a request whose committed prefix is ``token_ids``."""

    def open_tenant_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor],
        tenant: str | None,
    ) -> DraftSession:
        """:meth:`open_session` for a request of ``tenant`` (the verifier's opaque id, None: no tenant); a type that
        keeps state across requests (``suffix``) overrides it to keep each tenant's apart."""
        return self.open_session(token_ids, prompt_len, params, extras)
