"""Token-tree verification: one target forward verifies several candidate continuations, losslessly.

Where it is used: a ``draft`` with ``parents`` (a parent index per drafted token, -1 under the pending token) is a
tree; ``Session.plan_round`` cuts it to the budget (``DraftTree.truncate``), the verifier runs :func:`tree_forward`
(the backend's ``feed_tree``; or :func:`tree_row` in a batched ``feed_rows``), and ``Session.finish_round`` takes
:func:`process_tree`, :func:`accept_tree_greedy` and :func:`keep_path` before the usual crop. The nodes take trees
for greedy requests only; :func:`accept_tree_sampling` is tested here but not used by them yet.

Layout. The cache holds the committed prefix but the pending token (``L`` positions). A round feeds ``[pending,
*tree.tokens]`` in one batch-1 forward: the pending token at position ``L``, node i at ``L + depth(i)``, with a 4D
additive mask in which every fed token sees the cached prefix, the pending token and its own ancestors (and itself)
only. So each node's logits are exactly those of a chain forward of its path. After acceptance, :func:`keep_path`
has the backend keep the accepted nodes' positions directly after the pending token (the torch backends move their
K/V slots in place, a read of a few slots per layer and a write, and crop behind them): the cache then equals what a
chain forward of the accepted tokens would have cached, whatever the context length, without copying the prefix.

Acceptance, on processed scores with one row for the pending token and one per node (row ``1 + i`` predicts the
token after node i):

* greedy: from the root, take the target's argmax at the current node; move to the child with that token if there
  is one, else emit the argmax and stop (at a leaf: the bonus). A chain gives exactly ``accept_greedy``'s tokens.
* sampling, for children the drafter chose without randomness (its top-k): at each node draw x from the target's
  distribution p there; move to the child whose token is x, else emit x and stop. Every committed token is a plain
  draw from p given the tokens before it, so the output distribution is the target's (each child is accepted with
  exactly its probability p). Children sampled from a draft distribution q would need recursive rejection sampling
  (SpecInfer); that is not implemented, nor is ensemble verification for trees.

Only handles whose ``trees`` flag is set (torch: attention that takes a custom 4D mask, eager or sdpa, and no
sliding-window layers; transformers 5 passes a 4D ``attention_mask`` through unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.sampling import GenerationParams, process_logits, sample
from shared.target import Row, SequenceHandle, TargetBackend
from shared.tree_shape import validate_tree_shape


@dataclass
class DraftTree:
    """Drafted tokens as a tree under the pending token. ``parents[i]`` is node i's parent index (-1: a child of the
    pending token); nodes come in topological order (a parent before its children)."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def from_chain(cls, tokens: list[int]) -> DraftTree:
        """A chain is the tree whose node i hangs under node i - 1."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, max_nodes: int) -> None:
        """Raise ValueError unless this is a well-formed tree of at most ``max_nodes`` nodes."""
        validate_tree_shape(self.tokens, self.parents, max_nodes)

    def depths(self) -> list[int]:
        """Depth of every node (children of the pending token: 1)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def depth(self, i: int) -> int:
        return self.depths()[i]

    def children(self, i: int) -> list[int]:
        """Indices of node ``i``'s children in order (``i = -1``: the pending token's)."""
        return [j for j, parent in enumerate(self.parents) if parent == i]

    def path(self, i: int) -> list[int]:
        """Node indices from the pending token's child down to node ``i`` (empty for ``i = -1``)."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def truncate(self, max_depth: int) -> DraftTree:
        """The nodes of depth at most ``max_depth`` (a round's budget), in the same order, parents renumbered."""
        depths = self.depths()
        index: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if depths[i] <= max_depth:
                index[i] = len(tokens)
                tokens.append(token)
                parents.append(index[parent])
        return DraftTree(tokens, parents)


def tree_visibility(tree: DraftTree) -> torch.Tensor:
    """bool ``[n + 1, n + 1]`` over ``[pending, *nodes]``: each one sees itself and its ancestors."""
    n = len(tree)
    visible = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    visible[:, 0] = True  # the pending token is everyone's ancestor
    for i, parent in enumerate(tree.parents):
        visible[1 + i] = visible[1 + parent] if parent >= 0 else visible[0]  # topological: the parent's row is done
        visible[1 + i, 1 + i] = True
    return visible


def tree_row(lm: SequenceHandle, pending: int, tree: DraftTree) -> Row:
    """The round as a :class:`shared.target.Row` (for a batched forward with other sessions, ``feed_rows``): the
    pending token and the nodes, at positions ``lm.length + depth``, seeing the cache and their ancestors."""
    cached = torch.ones(len(tree) + 1, lm.length, dtype=torch.bool)
    visible = torch.cat([cached, tree_visibility(tree)], dim=1)
    positions = [lm.length, *(lm.length + d for d in tree.depths())]
    return Row(lm, [pending, *tree.tokens], positions=positions, visible=visible)


def tree_forward(backend: TargetBackend, lm: SequenceHandle, pending: int, tree: DraftTree,
                 want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed the round ``[pending, *tree.tokens]`` onto ``lm``'s memory in one forward of ``backend``'s
    (:meth:`~shared.target.TargetBackend.feed_tree`: in place, no copy of the context); return float32 logits
    ``[n + 1, vocab]`` (row 0: after the pending token, row 1 + i: after node i) and, when asked, the last hidden
    states. ``lm`` grows by n + 1 positions; :func:`keep_path` keeps the accepted ones."""
    if not lm.trees:
        raise ValueError("tree verification needs eager or sdpa attention and no sliding-window layers")
    row = tree_row(lm, pending, tree)
    return backend.feed_tree(lm, row.tokens, row.positions, row.visible, want_hidden)


def process_tree(logits: torch.Tensor, prefix: torch.Tensor, tree: DraftTree, params: GenerationParams,
                 num_generated: int) -> torch.Tensor:
    """:func:`shared.sampling.process_block` for a tree: row 0 after ``prefix``, row 1 + i after ``prefix`` and
    node i's path (the context a repetition penalty reads, and i's depth for min_new_tokens)."""
    rows = [process_logits(logits[0], prefix, params, num_generated)]
    for i in range(len(tree)):
        path = torch.tensor([tree.tokens[j] for j in tree.path(i)], dtype=torch.long)
        rows.append(process_logits(logits[1 + i], torch.cat([prefix, path]), params, num_generated + len(path)))
    return torch.stack(rows)


class TreeOutcome(NamedTuple):
    tokens: list[int]  # committed: the accepted nodes' tokens, then the target's own token
    nodes: list[int]  # the accepted nodes, root to leaf (``len(nodes)`` drafts accepted)


def _walk(tree: DraftTree, choose) -> TreeOutcome:
    """From the root, ``choose(row)`` gives the target's token at a node; follow the child that has it."""
    node, tokens, nodes = -1, [], []
    while True:
        token = choose(node + 1)
        tokens.append(token)
        child = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if child is None:
            return TreeOutcome(tokens, nodes)
        nodes.append(child)
        node = child


def accept_tree_greedy(scores: torch.Tensor, tree: DraftTree) -> TreeOutcome:
    """Greedy rule: the longest path whose tokens are the target's argmax, then the argmax after it."""
    target = scores.argmax(-1).tolist()
    return _walk(tree, lambda row: target[row])


def accept_tree_sampling(scores: torch.Tensor, tree: DraftTree, generator: torch.Generator) -> TreeOutcome:
    """Sampling rule for deterministically chosen children: draw from p at each node, follow the child drawn."""
    p = scores.softmax(-1)
    return _walk(tree, lambda row: sample(p[row], generator))


def kept_rows(nodes: list[int]) -> list[int]:
    """Which of the fed rows ``[pending, *nodes]`` a round keeps: the pending token and the accepted nodes."""
    return [0, *(1 + i for i in nodes)]


def keep_path(backend: TargetBackend, lm: SequenceHandle, tree_size: int, nodes: list[int]) -> None:
    """After :func:`tree_forward` of a tree of ``tree_size`` nodes: keep the cached prefix, the pending token and
    the accepted ``nodes`` (moved to be contiguous: :meth:`~shared.target.TargetBackend.keep_positions`), drop the
    rest. ``lm`` then holds exactly what a chain forward of ``[pending, *accepted tokens]`` would have."""
    start = lm.length - tree_size - 1  # the pending token's position
    if start < 0:
        raise ValueError(f"the cache holds {lm.length} positions, fewer than a round of {tree_size + 1}")
    backend.keep_positions(lm, start + 1, [start + 1 + i for i in nodes])
