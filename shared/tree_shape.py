"""Shape rules for a drafted token tree, in pure python.

The wire protocol (``shared.protocol.Draft``) must reject a malformed tree without importing the verifier, and
``verifier_node.tree.DraftTree`` checks the same rules before verifying; both call :func:`validate_tree_shape` so
the rules are written once, in the bottom layer.
"""

from __future__ import annotations

from collections.abc import Sequence


def validate_tree_shape(tokens: Sequence[object], parents: Sequence[object], max_nodes: int) -> None:
    """Raise ValueError unless ``tokens``/``parents`` form a well-formed tree of at most ``max_nodes`` nodes.

    ``parents[i]`` is node i's parent index (-1: a child of the pending token); nodes come in topological order and
    no two children of one node carry the same token.
    """
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"tree has {n} tokens but {len(parents)} parents")
    if n > max_nodes:
        raise ValueError(f"tree has {n} nodes, more than the {max_nodes} allowed")
    seen: set[tuple[int, int]] = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"node {i}: token {token!r} is not a non-negative integer")
        if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < n:
            raise ValueError(f"node {i}: bad parent index {parent!r} (must be -1 or a node index below {n})")
        if parent >= i:
            raise ValueError(f"node {i}: parent {parent} does not come before it (nodes must be topological)")
        if (parent, token) in seen:
            raise ValueError(f"node {i}: token {token} appears twice among the children of {parent}")
        seen.add((parent, token))
