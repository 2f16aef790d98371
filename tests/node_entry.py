"""A node process with test behaviour injected as objects, for tests that need a verifier or drafter to behave in a
way production never does (an acceptance rule that accepts everything, a slow forward, fixed cost curves).

``Cluster(config, entry={"verifier": node_entry("accept_all")})`` starts the verifier as
``python tests/node_entry.py accept_all --config ... --role verifier``; the hook's keyword arguments go to the node's
``run`` (``verifier_node.server.run`` / ``drafter_node.node.run``). Production code reads no test switch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Hook name -> a function building the node's ``run`` keyword arguments from the hook's argument (a string or None).
HOOKS: dict[str, Callable[[str | None], dict[str, Any]]] = {
    "none": lambda arg: {},
}


def node_entry(hook: str, arg: str | None = None) -> list[str]:
    """The ``Cluster(entry=...)`` command for a role that runs with ``hook`` (and its argument)."""
    if hook not in HOOKS:
        raise KeyError(f"unknown node hook {hook!r} (known: {', '.join(sorted(HOOKS))})")
    return [str(Path(__file__).resolve()), hook if arg is None else f"{hook}={arg}"]


def main() -> int:
    from runtime.launch import main as launch_main

    hook, _, arg = sys.argv[1].partition("=")
    return launch_main(sys.argv[2:], hooks=HOOKS[hook](arg or None))


if __name__ == "__main__":
    sys.exit(main())
