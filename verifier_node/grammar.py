"""Structured output on the verifier: grammars compiled with xgrammar, one matcher per session, the mask of every
draft position, forced tokens drafted for free, and the matcher rolled back with the cache.

The output distribution of a grammar session is the grammar-masked target's, token by token: at every position
p_masked(x) ∝ p(x)·1[x allowed after the committed text], applied after the processors and before the warpers, as
transformers' ``generate`` does with xgrammar's logits processor. Speculation keeps it exact because the verifier
masks the scores of every draft position (and the bonus row) with the matcher state after the drafts before it,
before the acceptance rule runs (see docs/correctness.md and docs/architecture.md#structured-output).

xgrammar is optional (``pip install 'pipespec[structured]'``): it is imported the first time a request carries a
grammar, and a request with a grammar on a verifier without it is refused with a clear message.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.config_sections import VerifierConfig
from shared.sampling import GrammarSpec, ParamError
from verifier_node.schema_check import check_schema

#: pipespec's own cache of compiled grammars: at most this many entries (and ``cache_bytes`` in all, measured with
#: ``CompiledGrammar.memory_size_bytes``; a compile can take a while on a large vocabulary: a repeated spec is free).
COMPILED_CACHE = 64
#: ``verifier.grammar_cache_bytes``' default (declared there): the byte bound of both caches (xgrammar's and ours).
DEFAULT_CACHE_BYTES: int = VerifierConfig.grammar_cache_bytes
#: Tokens the grammar may force past the drafter's block in one round: a grammar that forces a long run (a regex of
#: one long literal, a long ``const``) fills it over several rounds, each taking its turn with the other sessions,
#: rather than one round verifying thousands of tokens.
MAX_FORCED_PER_ROUND = 32
#: ``[12:07:59] /project/cpp/x.cc:94: `` and ``Check failed: (...) is false: `` prefixes of xgrammar's messages.
_ENGINE_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class GrammarUnavailable(ParamError):
    """A request carries a grammar but xgrammar is not installed on the verifier."""


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarUnavailable(
            "structured output (response_format, regex, grammar) needs the xgrammar package on the verifier, which "
            f"is not installed ({exc}); install it with `pip install 'pipespec[structured]'` (see README, Install)"
        ) from None
    return xgrammar


def engine_message(exc: BaseException) -> str:
    """xgrammar's own message without its source-location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return _ENGINE_PREFIX.sub("", text)[:500]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask rows ``[n, ceil(V / 32)]`` as bool rows ``[n, V]`` (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


#: A cache key: (scope, kind, value). ``scope`` is an opaque string the caller passes (a tenant, say; None: shared).
CacheKey = tuple[str | None, str, str, bool]


class GrammarCompiler:
    """Compiles grammar specs against the target's tokenizer (one per verifier), caching the compiled grammars.

    Both caches are bounded in bytes: xgrammar's own (``cache_limit_bytes``) and pipespec's dict of compiled grammars
    (by count, :data:`COMPILED_CACHE`, and by ``cache_bytes``). ``compile_with``: who compiles a spec that is not
    cached (a function of the spec, returning a compiled grammar or raising :class:`ParamError`; None: this
    process, :meth:`compile_uncached`); the verifier passes a child process's (:mod:`verifier_node.request_prep`).
    ``info``: a ready ``xgrammar.TokenizerInfo`` instead of one built from ``tokenizer`` (the child process)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, info: Any = None,
                 compile_with: Callable[[GrammarSpec], Any] | None = None):
        self.xgr = _import_xgrammar()
        self.vocab_size = vocab_size
        # The target's logits row may be longer than the tokenizer (padded embeddings): the bitmask covers the row.
        self.info = info if info is not None else self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self.cache_bytes = int(cache_bytes)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=self.cache_bytes)
        self.compile_with = compile_with or self.compile_uncached
        self._cache: OrderedDict[CacheKey, Any] = OrderedDict()
        self._sizes: dict[CacheKey, int] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @property
    def cached(self) -> tuple[int, int]:
        """(entries, bytes) in pipespec's cache."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def compile(self, spec: GrammarSpec, scope: str | None = None) -> Any:
        """The compiled grammar of ``spec`` (cached under ``(scope, kind, value, strict)``); a spec the engine refuses
        raises :class:`ParamError` with its message."""
        key: CacheKey = (scope, spec.kind, spec.value, spec.strict)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self.compile_with(spec)
        self._remember(key, compiled)
        return compiled

    def compile_uncached(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` in this process (no pipespec cache; xgrammar's own, bounded, still applies)."""
        try:
            return self._compile(spec)
        except ParamError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
            raise ParamError(f"{spec.kind}: refused by the grammar engine (xgrammar): {engine_message(exc)}") from None

    def _remember(self, key: CacheKey, compiled: Any) -> None:
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0) + len(key[2])
        if size > self.cache_bytes:
            return  # larger than the whole bound: used once, not kept
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._sizes[key] = size
            self._cached_bytes += size
            while len(self._cache) > COMPILED_CACHE or self._cached_bytes > self.cache_bytes:
                old, _ = self._cache.popitem(last=False)
                self._cached_bytes -= self._sizes.pop(old)

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self.compiler
        if spec.kind == "json_schema":
            check_json_schema(spec.value)
            # Compact JSON (no free whitespace): a model cannot wander into endless whitespace, and more tokens are
            # forced (drafted for free). strict_mode (the default): no properties or items the schema does not name.
            return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(choice_grammar(json.loads(spec.value)))
        return c.compile_grammar(spec.value)  # "grammar": EBNF (GBNF-style, as in vLLM and llama.cpp)

    def session(self, spec: GrammarSpec, end_token_ids: set[int], scope: str | None = None) -> SessionGrammar:
        """A fresh matcher of ``spec`` for one request; it accepts an end token only where the grammar is complete.
        ``scope``: see :meth:`compile`."""
        compiled = self.compile(spec, scope)
        matcher = self.xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(end_token_ids) or None)
        grammar = SessionGrammar(self.xgr, matcher, self.vocab_size, end_token_ids)
        if not grammar.first_mask().any():
            raise ParamError(f"{spec.kind}: the grammar allows no token at all (an impossible schema or grammar)")
        grammar.take_mask_time()  # the start's fill is preparation's, not a round's
        return grammar


def check_json_schema(text: str) -> None:
    """Refuse a schema with keywords the engine would compile without effect (:mod:`verifier_node.schema_check`)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return  # not JSON: the engine's own message says so
    except RecursionError:
        raise ParamError("json_schema: the schema is nested too deeply") from None
    try:
        check_schema(schema)
    except RecursionError:
        raise ParamError("json_schema: the schema is nested too deeply") from None


def ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal: the characters themselves (UTF-8 in the grammar, so a character outside
    the BMP stays one character, not two JSON surrogate escapes), with only backslash, quote and control characters
    escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # exactly four digits (\\x takes every hex digit that follows)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_EBNF_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar of exactly one of ``choices``."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


@dataclass
class GrammarPlan:
    """What the grammar made of one round's draft: the tokens the forward verifies (the drafter's kept part, then
    forced tokens), their q rows, one mask row per position plus the bonus row, and the matcher steps taken."""

    draft: list[int]
    q: torch.Tensor | None
    masks: torch.Tensor  # bool [len(draft) + 1, vocab]
    advanced: int  # tokens the matcher accepted while planning (rolled back after acceptance)
    forced: int  # tokens the grammar forced past the drafter's own (drafted for free)
    chain: int  # the leading draft tokens that are the drafter's own block (forced ones it also proposed included)

    def drafter_counts(self, accepted: int) -> tuple[int, int]:
        """(the drafter's tokens verified, how many of them were accepted): what the commit tells the drafter and
        the acceptance metrics count; tokens the grammar added past the drafter's block are left out."""
        return self.chain, min(accepted, self.chain)


class SessionGrammar:
    """One request's matcher. Between rounds it sits at the committed text; :meth:`plan` advances it through a
    draft to build the masks, :meth:`commit` rolls it back to the committed length and accepts the round's
    outcome.

    Mask work is timed (:meth:`take_mask_time`) and may run on a worker thread (:mod:`verifier_node.masks`): the
    matcher is only touched under ``lock``; ``job`` is the plan in work there (the scheduler skips the session until
    it is done), ``peek`` the fill of the committed text's mask after a commit. ``positions``: the most tokens a
    round may verify (drafted or forced), None: no cap beyond the budget's (set by its mask budget)."""

    def __init__(self, xgr: Any, matcher: Any, vocab_size: int, end_token_ids: set[int]):
        self.xgr = xgr
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.end_token_ids = set(end_token_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.forced_tokens = 0  # over the session (metrics)
        self._forced_next: bool | None = None  # the committed text's next token is forced (cached until it moves)
        self._first: torch.Tensor | None = None  # the committed text's mask (cached until it moves)
        self.lock = threading.Lock()
        self.job: Any = None  # a Future: its plan in work on a mask worker
        self.peek: Any = None  # a Future: the committed text's mask being filled on a mask worker
        self.positions: int | None = None
        self.budget: Any = None  # its MaskBudget (verifier_node.masks), from its first round on
        self.mask_s = 0.0  # mask time since the last take_mask_time()
        self.fills = 0
        self.mask_s_total = 0.0  # over the session (metrics)

    @property
    def planning(self) -> bool:
        """Its plan is in work on a mask worker: the session's round waits for it."""
        return self.job is not None and not self.job.done()

    def take_mask_time(self) -> tuple[float, int]:
        """(seconds, fills) of mask work since the last call (a round's, :class:`verifier_node.masks.MaskBudget`)."""
        out = (self.mask_s, self.fills)
        self.mask_s, self.fills = 0.0, 0
        return out

    def next_is_forced(self) -> bool:
        """The grammar allows one token only after the committed text: the next round needs no draft to start (the
        scheduler does not wait for the drafter; the round drafts that token, and any forced after it, for free).
        While the committed text's mask is being filled on a worker: False (the answer comes with the peek)."""
        if self._forced_next is None:
            if (self.peek is not None and not self.peek.done()) or self.planning:
                return False  # never wait on the loop for a mask
            self.first_mask()
        return bool(self._forced_next)

    def first_mask(self) -> torch.Tensor:
        """The committed text's mask (filled once per committed state; what the next round's plan starts with)."""
        with self.lock:
            if self._first is None:
                self._first = self.mask()
                self._forced_next = not self.matcher.is_terminated() and int(self._first.sum()) == 1
            return self._first

    def mask(self) -> torch.Tensor:
        """Bool [vocab]: the tokens allowed after the matcher's current state (timed: mask work of the round)."""
        t0 = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        out = unpack_bitmask(self.bitmask, self.vocab_size)[0]
        seconds = time.perf_counter() - t0
        self.mask_s += seconds
        self.mask_s_total += seconds
        self.fills += 1
        return out

    def plan(self, draft: list[int], q: torch.Tensor | None, limit: int) -> GrammarPlan:
        """Masks for ``draft`` (at most ``limit`` tokens verified, and at most ``positions`` where the mask budget
        shrank the session), forced tokens appended or swapped in (at most :data:`MAX_FORCED_PER_ROUND` past the
        drafter's own). Fewer positions never change the output: the tokens left out come in later rounds.

        * A draft token the grammar allows is kept and the matcher steps over it.
        * Where the mask allows one token only, that token is the target's choice whatever the scores (greedy: the
          only finite score; sampling: p_masked is one-hot), so it is drafted for free with a one-hot q; a drafter
          token that differs there is replaced and the drafter's tokens after it are dropped (built on a prefix
          the target will not commit).
        * The first token the grammar refuses stays in the draft so the acceptance rule rejects it (p_masked = 0)
          and draws the correction from the residual, exactly as for any rejected draft; dropping it instead would
          bias the correction towards p. Its following row is never read (acceptance stops there): all True.
        """
        with self.lock:
            return self._plan(draft, q, limit if self.positions is None else min(limit, self.positions))

    def _plan(self, draft: list[int], q: torch.Tensor | None, limit: int) -> GrammarPlan:
        first = self._first if self._first is not None else self.mask()  # the committed text's (maybe peeked)
        self._first = None  # the matcher moves: the next round's comes after the commit
        kept: list[int] = []
        q_rows: list[torch.Tensor | None] = []
        masks: list[torch.Tensor] = []
        advanced = forced = 0
        on_draft = True  # the drafter's tokens still continue what was kept
        while True:
            allowed = self.mask() if masks else first
            masks.append(allowed)
            i = len(kept)
            if i >= limit or self.matcher.is_terminated():
                break
            only = allowed.nonzero()
            if only.numel() == 1:  # forced: drafted for free
                token = int(only[0, 0])
                if not (on_draft and i < len(draft) and draft[i] == token):
                    if forced >= MAX_FORCED_PER_ROUND:
                        break  # the rest next round (this row, the bonus, still commits the forced token)
                    on_draft = False
                kept.append(token)
                q_rows.append(None)
                forced += not on_draft
            elif on_draft and i < len(draft) and bool(allowed[draft[i]]):
                kept.append(draft[i])
                q_rows.append(q[i] if q is not None and i < q.shape[0] else None)
            else:
                if on_draft and i < len(draft):  # refused: verified (and rejected) like any wrong draft
                    kept.append(draft[i])
                    q_rows.append(q[i] if q is not None and i < q.shape[0] else None)
                    masks.append(torch.ones(self.vocab_size, dtype=torch.bool))
                break
            if not self.matcher.accept_token(kept[-1]):
                raise RuntimeError(f"grammar matcher refused token {kept[-1]} that its own mask allowed")
            advanced += 1
            if kept[-1] in self.end_token_ids:  # the grammar ended: nothing after it is verified
                masks.append(torch.ones(self.vocab_size, dtype=torch.bool))
                break
        chain = 0
        while chain < min(len(kept), len(draft)) and kept[chain] == draft[chain]:
            chain += 1
        plan = GrammarPlan(kept, self._q(q, q_rows, kept), torch.stack(masks), advanced, forced, chain)
        self.forced_tokens += plan.forced
        return plan

    @staticmethod
    def _q(q: torch.Tensor | None, rows: list[torch.Tensor | None], tokens: list[int]) -> torch.Tensor | None:
        """The q rows of the planned draft: the drafter's where it drew the token, one-hot where the grammar forced
        it. Without a drafter q (deterministic drafts) none is needed: a forced token is deterministic too."""
        if q is None or not tokens:
            return None
        out = torch.zeros(len(tokens), q.shape[1], dtype=q.dtype)
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if row is not None:
                out[i] = row
            else:
                out[i, token] = 1.0
        return out

    def commit(self, plan: GrammarPlan, out: list[int], accepted: int) -> None:
        """After acceptance: back to the committed prefix (the accepted drafts), then the target's own token."""
        with self.lock:
            self._forced_next = self._first = None
            self.matcher.rollback(plan.advanced - accepted)
            if out and len(out) > accepted and not self.matcher.is_terminated():
                token = out[accepted]
                if not self.matcher.accept_token(token):
                    raise RuntimeError(f"grammar matcher refused the committed token {token}")
