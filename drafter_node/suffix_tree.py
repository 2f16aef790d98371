"""The suffix structure behind the ``suffix`` drafter (suffix decoding, arXiv 2411.04975): pure Python, no torch.

:class:`SuffixTrie` is a depth-limited suffix trie over one or more token sequences: every suffix of every
sequence, cut at ``max_depth`` tokens, is a path from the root, and each node counts how many times its path occurs
(so ``child.count / node.count`` is the empirical probability of the child's token after that path). Sequences grow
one token at a time (:meth:`SuffixTrie.append` touches only the ≤ depth suffixes still open, never a rebuild) and can
be removed again (:meth:`SuffixTrie.remove`: the counts go back down and nodes whose count reaches zero are freed).

:func:`speculate` matches the end of a context against the trie and extends the match greedily along the most
frequent children (a chain, as vLLM's v1 proposer uses; the trie could give token trees later).

:class:`SuffixCache` is what one drafter process holds: a trie per active request (its prompt and the tokens
generated so far, built a budget at a time: :meth:`SuffixCache.build`) and one global trie per tenant over the
responses of that tenant's earlier requests — and of its active ones, as they grow — bounded overall by a number of
requests and of tokens (the oldest evicted first) and by a number of tenants (the least recently used one dropped
whole).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Tokens a request's own trie takes in per :meth:`SuffixCache.build` call (each costs up to ``max_depth`` node
#: updates: 512 tokens are 5 to 20 ms of pure Python at depth 24). A long prompt is built over several drafter loop
#: turns, so the loop keeps answering heartbeats and serving other sessions meanwhile (a 32k-token prompt at once
#: took up to 1.4 s).
BUILD_BUDGET = 512


class _Node:
    """One trie node. Most nodes of a trie over text have one child, so the first child lives inline (``tok``,
    ``child``) and only further ones in a dict: about 64 bytes per chain node instead of a node plus a dict."""

    __slots__ = ("child", "count", "more", "tok")

    def __init__(self) -> None:
        self.count = 0
        self.tok = -1
        self.child: _Node | None = None
        self.more: dict[int, _Node] | None = None

    def get(self, token: int) -> _Node | None:
        if self.tok == token:
            return self.child
        return self.more.get(token) if self.more is not None else None

    def add(self, token: int) -> _Node:
        node = _Node()
        if self.child is None:
            self.tok, self.child = token, node
        else:
            if self.more is None:
                self.more = {}
            self.more[token] = node
        return node

    def drop(self, token: int) -> None:
        if self.tok == token:
            if self.more:  # promote another child inline
                self.tok, self.child = self.more.popitem()
                if not self.more:
                    self.more = None
            else:
                self.tok, self.child = -1, None
        elif self.more is not None:
            del self.more[token]
            if not self.more:
                self.more = None

    def children(self) -> Iterable[tuple[int, _Node]]:
        if self.child is not None:
            yield self.tok, self.child
        if self.more is not None:
            yield from self.more.items()

    def best(self) -> tuple[int, _Node] | None:
        """The most frequent child (the smallest token id among equals, so results do not depend on order)."""
        best: tuple[int, _Node] | None = None
        for tok, node in self.children():
            if best is None or node.count > best[1].count or (node.count == best[1].count and tok < best[0]):
                best = (tok, node)
        return best


class SuffixTrie:
    """Every suffix of the sequences added, cut at ``max_depth`` tokens, with occurrence counts per node.

    A sequence is addressed by the id :meth:`new_sequence` gives; the trie keeps its tokens (to remove it later)."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be ≥ 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 1  # live nodes, the root included (what memory grows with)
        self._seqs: dict[int, array] = {}
        self._open: dict[int, list[_Node]] = {}  # per sequence: the nodes its open suffixes end at (oldest first)
        self._next_id = 0

    # -------------------------------------------------------------------------------------------- building
    def new_sequence(self, tokens: Iterable[int] = ()) -> int:
        """Start a sequence (with ``tokens`` appended); returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = array("q")
        self._open[sid] = []
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(sid, t)

    def append(self, sid: int, token: int) -> None:
        """Append one token to sequence ``sid``: each suffix still shorter than the depth grows by one node, and a
        new one-token suffix starts at the root (≤ max_depth node updates)."""
        self._seqs[sid].append(token)
        open_ = self._open[sid]
        if len(open_) == self.max_depth:  # the oldest open suffix is as deep as the trie goes: it is complete
            open_.pop(0)
        self.root.count += 1
        open_.append(self.root)
        for i, node in enumerate(open_):
            child = node.get(token)
            if child is None:
                child = node.add(token)
                self.nodes += 1
            child.count += 1
            open_[i] = child

    def remove(self, sid: int) -> None:
        """Take sequence ``sid`` out: every count it added goes back down, nodes left at zero are freed."""
        seq = self._seqs.pop(sid)
        del self._open[sid]
        depth = self.max_depth
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for t in seq[start : start + depth]:
                child = node.get(t)
                assert child is not None, "suffix trie out of step with its sequences"
                child.count -= 1
                if child.count == 0:  # its whole subtree counted only this occurrence
                    node.drop(t)
                    self.nodes -= _size(child)
                    break
                node = child

    def sequence(self, sid: int) -> Sequence[int]:
        return self._seqs[sid]

    def __contains__(self, sid: int) -> bool:
        return sid in self._seqs

    @property
    def sequences(self) -> int:
        """Sequences held."""
        return len(self._seqs)

    @property
    def tokens(self) -> int:
        """Tokens held, over all sequences."""
        return sum(len(s) for s in self._seqs.values())

    # ------------------------------------------------------------------------------------------- matching
    def walk(self, path: Iterable[int]) -> _Node | None:
        """The node of ``path`` (None when the trie does not hold it)."""
        node: _Node | None = self.root
        for t in path:
            node = node.get(t)
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    """Nodes in the subtree of ``node`` (itself included)."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(c for _, c in n.children())
    return total


@dataclass
class Proposal:
    """A proposed chain: its tokens, each one's cumulative empirical probability, the context length it matched,
    and its score (the sum of the cumulative probabilities: the expected number of accepted tokens)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


def speculate(trie: SuffixTrie, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
              min_token_prob: float = 0.1) -> Proposal:
    """The best chain the trie proposes after ``context``.

    Every suffix of the context up to the trie's depth that the trie holds is a candidate match; from its node the
    chain follows the most frequent child while the product of the empirical probabilities stays ≥
    ``min_token_prob``, for at most ``min(max_tokens, ceil(max_spec_factor × match length))`` tokens. The candidate
    with the highest score wins (the longer match among equal scores)."""
    best = Proposal()
    if max_tokens < 1 or not context:
        return best
    # Every suffix of a held path is held too (all suffixes are inserted), so the matches are lengths 1..M.
    for m in range(1, min(trie.max_depth, len(context)) + 1):
        node = trie.walk(context[len(context) - m :])
        if node is None:
            break
        limit = min(max_tokens, math.ceil(max_spec_factor * m))
        prop = Proposal(match_len=m)
        prob = 1.0
        while len(prop.tokens) < limit and node.count > 0:
            nxt = node.best()
            if nxt is None:
                break
            tok, child = nxt
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            prop.tokens.append(tok)
            prop.probs.append(prob)
            node = child
        if prop.score >= best.score and prop.tokens:
            best = prop
    return best


class SuffixCache:
    """One drafter's suffix structures: a trie per active request over its prompt and generated tokens, and one
    global trie per tenant over the responses of the requests it served for that tenant (active ones included,
    token by token), so one tenant is never offered another's responses. The bounds are overall: ``max_requests``
    and ``max_tokens`` over every tenant's responses (the oldest response evicted first, its counts removed from its
    trie), and ``max_tenants`` tries (the least recently used tenant's dropped whole). ``share_across_tenants``:
    one global trie for everyone (every request in tenant None's scope), as a single-user setup has."""

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int, max_tenants: int = 1024,
                 share_across_tenants: bool = False):
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_tenants = max(1, max_tenants)
        self.share_across_tenants = share_across_tenants
        self._tries: OrderedDict[str | None, SuffixTrie] = OrderedDict()  # tenant → its global trie, LRU first
        self._local: dict[int, tuple[SuffixTrie, int]] = {}  # request → its own trie and its sequence there
        self._scope: dict[int, str | None] = {}  # request → the tenant whose global trie it reads and feeds
        # request → its tenant and its sequence in that tenant's global trie, oldest first (over every tenant)
        self._order: OrderedDict[int, tuple[str | None, int]] = OrderedDict()
        # request → the tokens not in its own trie yet (in order) and how many of them are in: a long prompt goes in
        # a budget at a time (build), and tokens committed meanwhile queue behind it
        self._backlog: dict[int, tuple[list[int], int]] = {}
        self._pending: set[int] = set()  # active requests with no response token yet: not cached so far
        self._global_tokens = 0
        self._next_req = 0

    @property
    def cached_requests(self) -> int:
        """Responses in the global tries (active ones included)."""
        return len(self._order)

    @property
    def cached_tokens(self) -> int:
        return self._global_tokens

    @property
    def tenants(self) -> int:
        """Tenants with a global trie."""
        return len(self._tries)

    @property
    def global_trie(self) -> SuffixTrie:
        """Tenant None's global trie (the only one when tenants are not used or shared)."""
        return self.trie_of(None)

    def trie_of(self, tenant: str | None) -> SuffixTrie:
        """``tenant``'s global trie (an empty one when it has none)."""
        trie = self._tries.get(tenant)
        return trie if trie is not None else SuffixTrie(self.max_depth)

    def start(self, prompt: Sequence[int], response: Sequence[int] = (), tenant: str | None = None) -> int:
        """A new request of ``tenant``: its local trie over ``prompt`` + ``response`` and its response in the
        tenant's global trie. The local trie takes the first :data:`BUILD_BUDGET` tokens now (all of a short prompt)
        and the rest in later :meth:`build` calls."""
        req = self._next_req
        self._next_req += 1
        local = SuffixTrie(self.max_depth)
        self._local[req] = (local, local.new_sequence())
        self._backlog[req] = ([*prompt, *response], 0)
        self.build(req)
        self._scope[req] = None if self.share_across_tenants else tenant
        if self.max_requests > 0 and self.max_tokens > 0:
            self._pending.add(req)
        self._add_response(req, response)
        return req

    def append(self, req: int, tokens: Sequence[int]) -> None:
        """``tokens`` were generated (committed) for request ``req``."""
        if req in self._backlog:  # its trie is still being built: they go in after what comes before them
            self._backlog[req][0].extend(tokens)
        else:
            local, seq = self._local[req]
            local.extend(seq, tokens)
        self._add_response(req, tokens)

    def build(self, req: int, budget: int = BUILD_BUDGET) -> int:
        """Put up to ``budget`` more tokens of request ``req``'s backlog into its own trie; returns how many still
        wait (0: the trie holds all of the request's tokens)."""
        if req not in self._backlog:
            return 0
        tokens, done = self._backlog[req]
        end = min(len(tokens), done + max(budget, 1))
        local, seq = self._local[req]
        local.extend(seq, tokens[done:end])
        if end == len(tokens):
            del self._backlog[req]
            return 0
        self._backlog[req] = (tokens, end)
        return len(tokens) - end

    def unbuilt(self, req: int) -> int:
        """Tokens of request ``req`` not in its own trie yet."""
        tokens, done = self._backlog.get(req, ((), 0))
        return len(tokens) - done

    def stop(self, req: int) -> None:
        """Request ``req`` is over: its local trie goes, its response stays cached (until evicted)."""
        self._local.pop(req, None)
        self._scope.pop(req, None)
        self._backlog.pop(req, None)
        self._pending.discard(req)

    def _add_response(self, req: int, tokens: Sequence[int]) -> None:
        # a request enters the global cache with its first response token (one that generated nothing takes no
        # place among the cached requests); an evicted one does not come back
        if tokens and req in self._pending:
            self._pending.discard(req)
            tenant = self._scope[req]
            trie = self._tries.get(tenant)
            if trie is None:
                trie = self._tries[tenant] = SuffixTrie(self.max_depth)
            self._tries.move_to_end(tenant)
            self._order[req] = (tenant, trie.new_sequence())
            self._evict_tenants(keep=tenant)
        if tokens and req in self._order:
            self._add_global(req, tokens)
            self._evict(keep=req)

    def _add_global(self, req: int, tokens: Sequence[int]) -> None:
        tenant, seq = self._order[req]
        trie = self._tries[tenant]
        # a response longer than the token cap keeps only what fits: a single request never exceeds the bound
        room = self.max_tokens - len(trie.sequence(seq))
        take = tokens[:max(room, 0)]
        trie.extend(seq, take)
        self._global_tokens += len(take)

    def _evict(self, keep: int) -> None:
        """Drop the oldest responses while over a bound, but never ``keep``, the one being added to (it fits the
        token cap alone: :meth:`_add_global` cuts it there)."""
        while len(self._order) > self.max_requests or self._global_tokens > self.max_tokens:
            victim = next((req for req in self._order if req != keep), None)
            if victim is None:
                break
            self.evict(victim)

    def _evict_tenants(self, keep: str | None) -> None:
        """Drop the least recently used tenants' tries (every response in them) while there are too many."""
        while len(self._tries) > self.max_tenants:
            tenant = next(t for t in self._tries if t != keep)
            for req in [r for r, (t, _) in self._order.items() if t == tenant]:
                self.evict(req)
            self._tries.pop(tenant, None)

    def evict(self, req: int) -> None:
        tenant, seq = self._order.pop(req)
        trie = self._tries[tenant]
        self._global_tokens -= len(trie.sequence(seq))
        trie.remove(seq)
        if not trie.sequences:  # its last response: the tenant takes no place
            del self._tries[tenant]

    def speculate(self, req: int, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Proposal:
        """The better (by score) of the request's own trie's and its tenant's global trie's proposals after
        ``context``."""
        tail = context[max(0, len(context) - self.max_depth):]
        local = speculate(self._local[req][0], tail, max_tokens, max_spec_factor, min_token_prob)
        tenant = self._scope.get(req)
        trie = self._tries.get(tenant)
        if trie is None:
            return local
        self._tries.move_to_end(tenant)
        glob = speculate(trie, tail, max_tokens, max_spec_factor, min_token_prob)
        return glob if glob.score > local.score else local
