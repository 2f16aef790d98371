"""Token-tree verification: one target forward verifies several candidate continuations, losslessly.

Where it is used: a ``draft`` with ``parents`` (a parent index per drafted token, -1 under the pending token) is a
tree; ``Session.plan_round`` cuts it to the budget (``DraftTree.truncate``), the verifier runs :func:`tree_forward`
(or :func:`tree_row` in a batched ``feed_rows``), and ``Session.finish_round`` takes :func:`process_tree`,
:func:`accept_tree_greedy` and :func:`keep_path` before the usual crop. The nodes take trees for greedy requests
only; :func:`accept_tree_sampling` is tested here but not used by them yet.

Layout. The cache holds the committed prefix but the pending token (``L`` positions). A round feeds ``[pending,
*tree.tokens]`` in one batch-1 forward: the pending token at position ``L``, node i at ``L + depth(i)``, with a 4D
additive mask in which every fed token sees the cached prefix, the pending token and its own ancestors (and itself)
only. So each node's logits are exactly those of a chain forward of its path. After acceptance, :func:`keep_path`
moves the accepted nodes' K/V slots in place to directly after the pending token (``index_select``, a read of a few
slots per layer, then a write) and crops behind them: the cache then equals what a chain forward of the accepted
tokens would have cached, whatever the context length, without copying the prefix.

Acceptance, on processed scores with one row for the pending token and one per node (row ``1 + i`` predicts the
token after node i):

* greedy: from the root, take the target's argmax at the current node; move to the child with that token if there
  is one, else emit the argmax and stop (at a leaf: the bonus). A chain gives exactly ``accept_greedy``'s tokens.
* sampling, for children the drafter chose without randomness (its top-k): at each node draw x from the target's
  distribution p there; move to the child whose token is x, else emit x and stop. Every committed token is a plain
  draw from p given the tokens before it, so the output distribution is the target's (each child is accepted with
  exactly its probability p). Children sampled from a draft distribution q would need recursive rejection sampling
  (SpecInfer); that is not implemented, nor is ensemble verification for trees.

Only models whose attention takes a custom 4D mask (eager, sdpa) and without sliding-window layers
(:func:`shared.batch.can_batch`); transformers 5 passes a 4D ``attention_mask`` through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.batch import Row
from shared.kv import CachedLM
from shared.sampling import GenerationParams, process_logits, sample
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


def tree_row(lm: CachedLM, pending: int, tree: DraftTree) -> Row:
    """The round as a :class:`shared.batch.Row` (for a batched forward with other sessions, ``feed_rows``): the
    pending token and the nodes, at positions ``lm.length + depth``, seeing the cache and their ancestors."""
    cached = torch.ones(len(tree) + 1, lm.length, dtype=torch.bool)
    visible = torch.cat([cached, tree_visibility(tree)], dim=1)
    positions = [lm.length, *(lm.length + d for d in tree.depths())]
    return Row(lm, [pending, *tree.tokens], positions=positions, visible=visible)


def _check_model(lm: CachedLM) -> None:
    if not lm.trees:
        raise ValueError("tree verification needs eager or sdpa attention and no sliding-window layers")


@torch.inference_mode()
def tree_forward(lm: CachedLM, pending: int, tree: DraftTree,
                 want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed the round ``[pending, *tree.tokens]`` onto ``lm``'s cache in one forward; return float32 logits
    ``[n + 1, vocab]`` (row 0: after the pending token, row 1 + i: after node i) and, when asked, the last hidden
    states. The cache grows by n + 1 slots; :func:`keep_path` keeps the accepted ones."""
    _check_model(lm)
    row = tree_row(lm, pending, tree)
    dtype = next(lm.model.parameters()).dtype
    mask = torch.zeros(row.visible.shape, dtype=dtype).masked_fill_(~row.visible, torch.finfo(dtype).min)
    device = lm._device
    # Directly on the session's cache (as drafter_node.branches does): feed_rows would stack a copy of it.
    out = lm.model(
        input_ids=torch.tensor([row.tokens], dtype=torch.long, device=device),
        attention_mask=mask[None, None].to(device),
        position_ids=torch.tensor([row.positions], dtype=torch.long, device=device),
        cache=lm.cache,
        use_cache=True,
        output_hidden_states=want_hidden,
    )
    lm.grew(len(row.tokens))
    hidden = out.hidden_states[-1][0] if want_hidden else None
    return out.logits[0].float(), hidden


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


@torch.inference_mode()
def keep_path(lm: CachedLM, tree_size: int, nodes: list[int]) -> None:
    """After :func:`tree_forward` of a tree of ``tree_size`` nodes: keep the cached prefix, the pending token and
    the accepted ``nodes`` (moved in place to be contiguous), drop the rest. ``lm`` then caches exactly what a chain
    forward of ``[pending, *accepted tokens]`` would have."""
    start = lm.length - tree_size - 1  # the pending token's slot
    if start < 0:
        raise ValueError(f"the cache holds {lm.length} positions, fewer than a round of {tree_size + 1}")
    # Nodes are topological, so node j of the path sits at or behind slot j: the moves only go left. The leading
    # nodes already in place (a chain) are not touched.
    first = next((j for j, i in enumerate(nodes) if i != j), len(nodes))
    if first < len(nodes):
        device = lm.cache.layers[0].keys.device
        src = torch.tensor([start + 1 + i for i in nodes[first:]], dtype=torch.long, device=device)
        lo, hi = start + 1 + first, start + 1 + len(nodes)
        for layer in lm.cache.layers:
            # index_select reads the slots out first, so the write may overlap them
            layer.keys[..., lo:hi, :] = layer.keys.index_select(-2, src)
            layer.values[..., lo:hi, :] = layer.values.index_select(-2, src)
    lm.crop(start + 1 + len(nodes))
