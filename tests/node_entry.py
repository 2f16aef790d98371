"""A node process with test behaviour injected as objects, for tests that need a verifier or drafter to behave in a
way production never does (an acceptance rule that accepts everything, a slow forward, fixed cost curves).

``Cluster(config, entry={"verifier": node_entry("accept_all")})`` starts the verifier as
``python tests/node_entry.py accept_all --config ... --role verifier``; the hook's keyword arguments go to the node's
``run`` (``verifier_node.server.run`` / ``drafter_node.node.run``). Production code reads no test switch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# torch and the node packages are imported where they are used: the script's first job may be to hand the node to
# the session's warm zygote (tests/node_zygote.py), which a light start keeps fast.
# Run as a script, the repository's packages must be importable without an install (as ``-m`` from its root is).
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    import torch

    from shared.costs.curve import CostCurve


def accept_everything(scores: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                      generator: torch.Generator) -> list[int]:
    """NEGATIVE CONTROL: keeps every draft (biased towards q); a lossless check must catch a verifier using it."""
    from shared.sampling import sample

    return [*draft, sample(scores[len(draft)].softmax(-1), generator)]


def without_xgrammar() -> dict[str, Any]:
    """A node on a machine without xgrammar: importing it fails from here on (structured output's error path)."""
    sys.modules["xgrammar"] = None  # type: ignore[assignment]
    return {}


def fixed_costs(spec_json: str) -> tuple[CostCurve, CostCurve]:
    """(verify, draft) curves from JSON ``{"verify": {n: s}, "draft": {n: s}}``."""
    from shared.costs.curve import CostCurve

    spec = json.loads(spec_json)

    def curve(points: dict[str, float]) -> CostCurve:
        sizes = sorted(int(n) for n in points)
        return CostCurve(sizes=sizes, seconds=[float(points[str(n)]) for n in sizes], prefix_len=0)

    return curve(spec["verify"]), curve(spec["draft"])


def _record(path: str, event: dict[str, Any]) -> None:
    """Append ``event`` (one JSON line) to ``path``; times are ``time.monotonic()``, one clock for every process."""
    with open(path, "a") as out:
        out.write(json.dumps(event) + "\n")


def trace_verifier(path: str) -> dict[str, Any]:
    """Verifier: each prefill turn and each round's target forward, ``{"what", "start", "end"}`` appended to ``path``;
    every target forward slowed by 0.05 s (a prefill long enough to overlap whatever a drafter computes meanwhile)."""
    import time

    from verifier_node.rounds import RoundRunner

    def traced(what: str, method: Callable) -> Callable:
        def run(self, sessions, *args, **kwargs):
            start = time.monotonic()
            try:
                return method(self, sessions, *args, **kwargs)
            finally:
                _record(path, {"what": what, "start": start, "end": time.monotonic()})
        return run

    RoundRunner.prefill_batch = traced("prefill", RoundRunner.prefill_batch)
    RoundRunner._forward = traced("round", RoundRunner._forward)
    return {"forward_delay_s": 0.05}


def trace_drafter(arg: str) -> dict[str, Any]:
    """Drafter (``path,tokens``): each forward of its model (a tiny Llama or Qwen2 in torch, or llama.cpp's decode),
    ``{"what": "forward", "start", "end", "tokens"}`` appended to ``path``; the prompt caught up ``tokens`` at a time
    (``CATCH_UP_TOKENS``)."""
    import time

    from transformers.models.llama.modeling_llama import LlamaForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

    from drafter_node import node_session
    from drafter_node.gguf import LlamaEngine

    path, _, tokens = arg.partition(",")
    node_session.CATCH_UP_TOKENS = int(tokens)

    def traced(method: Callable, count: Callable[..., int]) -> Callable:
        def run(self, *args, **kwargs):
            start = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                _record(path, {"what": "forward", "start": start, "end": time.monotonic(),
                               "tokens": count(*args, **kwargs)})
        return run

    def torch_tokens(input_ids=None, *args, **kwargs) -> int:
        return int(input_ids.shape[-1]) if input_ids is not None else 0

    for cls in (LlamaForCausalLM, Qwen2ForCausalLM):
        cls.forward = traced(cls.forward, torch_tokens)
    # llama.cpp: one decode over rows of (sequence, start, tokens); a row's tokens are what its forward feeds
    LlamaEngine.decode = traced(LlamaEngine.decode, lambda rows, *a, **k: max(len(r[2]) for r in rows))
    return {}


def slow_masks(arg: str) -> dict[str, Any]:
    """Verifier: every JSON-schema session's masks take ``delay`` seconds each (a slow-mask schema injected: sleeping
    frees Python's lock as xgrammar's fill does; other kinds stay fast), its target forwards ``forward`` seconds
    more; ``"delay,forward"``."""
    import time

    from verifier_node.grammar import GrammarCompiler

    delay, forward = (float(x) for x in arg.split(","))

    class SlowMatcher:
        def __init__(self, inner: Any):
            self.inner = inner

        def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any:
            time.sleep(delay)
            return self.inner.fill_next_token_bitmask(bitmask, index)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    session = GrammarCompiler.session

    def slowed(self, spec: Any, *args: Any, **kwargs: Any) -> Any:
        grammar = session(self, spec, *args, **kwargs)
        if spec.kind == "json_schema":
            grammar.matcher = SlowMatcher(grammar.matcher)  # after the start's own fill: the rounds' masks are slow
        return grammar

    GrammarCompiler.session = slowed
    return {"forward_delay_s": forward}


#: Hook name -> a function building the node's ``run`` keyword arguments from the hook's argument (a string or None).
HOOKS: dict[str, Callable[[str | None], dict[str, Any]]] = {
    "none": lambda arg: {},
    # the entry of every node a test starts without one (tests/conftest.py): nothing injected, but a node that goes
    # through this script, so it is forked from the session's zygote too
    "plain": lambda arg: {},
    # verifier: the negative control of the distribution tests (tests/sampling_check.py)
    "accept_all": lambda arg: {"accept": accept_everything},
    # verifier: seconds slept before each target forward (a slow target on tiny models)
    "forward_delay": lambda arg: {"forward_delay_s": float(arg or 0.05)},
    # verifier: xgrammar not installed (tests/test_grammar_e2e.py)
    "no_xgrammar": lambda arg: without_xgrammar(),
    # drafter: fixed cost curves instead of measured ones (tiny models' forwards all cost about the same)
    "costs": lambda arg: {"fixed_costs": fixed_costs(arg or "")},
    # verifier: its prefill turns and rounds timed into a file, its forwards slowed (tests/test_chunked_prefill.py)
    "trace_verifier": lambda arg: trace_verifier(arg or ""),
    # drafter: its model's forwards timed into a file, its prompt caught up in chunks of the given size
    "trace_drafter": lambda arg: trace_drafter(arg or ""),
    # verifier: every grammar session's masks slowed (tests/test_grammar_e2e.py, masks within a budget)
    "slow_masks": lambda arg: slow_masks(arg or "0.25,0.02"),
}


def node_entry(hook: str, arg: str | None = None) -> list[str]:
    """The ``Cluster(entry=...)`` command for a role that runs with ``hook`` (and its argument)."""
    if hook not in HOOKS:
        raise KeyError(f"unknown node hook {hook!r} (known: {', '.join(sorted(HOOKS))})")
    return [str(Path(__file__).resolve()), hook if arg is None else f"{hook}={arg}"]


def costs_entry(spec_json: str) -> dict[str, list[str]]:
    """``Cluster(entry=...)`` for a drafter whose cost curves are ``spec_json`` (see :func:`fixed_costs`)."""
    return {"drafter": node_entry("costs", spec_json)}


#: ``node_entry.py python ARGS``: not a node but any Python command line (``-m MODULE ...`` or ``SCRIPT ...``), run in
#: the session's zygote like a node (:func:`python_command`).
PYTHON = "python"


def node_command(*args: str, hook: str = "plain") -> list[str]:
    """The command line of a node process a test starts by hand (``--config X --role R``, or a one-shot launcher's
    ``--config X --prompt P``): what ``python -m runtime.launch ARGS`` does, forked from the session's zygote."""
    return [sys.executable, *node_entry(hook), *args]


def python_command(*args: str) -> list[str]:
    """``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``) forked from the session's zygote, with every cluster it
    starts forked too: a test that runs a script or a CLI that starts nodes pays for no fresh interpreter."""
    return [sys.executable, str(Path(__file__).resolve()), PYTHON, *args]


def route_nodes_here(entry: list[str] | None = None) -> dict[Any, list[str]]:
    """Every node a cluster of this process starts runs ``entry`` (default: this script, so that it is forked from
    the zygote too); returns what it replaced, to give back to this function's ``restore``."""
    import runtime.launch  # noqa: F401 - imports the module a launcher reads it from, whichever that is

    replaced = {}
    for name in ("runtime.launch", "runtime.launchers.process"):  # where a launcher reads it (either layout)
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "NODE_ENTRY"):
            replaced[module] = module.NODE_ENTRY
            module.NODE_ENTRY = entry or node_entry("plain")
    return replaced


def restore(replaced: dict[Any, list[str]]) -> None:
    """Undo :func:`route_nodes_here`."""
    for module, entry in replaced.items():
        module.NODE_ENTRY = entry


def _run_python(args: list[str]) -> int:
    """``python ARGS`` in this process: ``-m MODULE`` through runpy, else a script (its folder first on the path)."""
    import runpy

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")
    return 0


def run_here(argv: list[str]) -> int:
    """Run the node ``argv`` (this script's command line) in this process."""
    route_nodes_here()
    if argv[1] == PYTHON:
        return _run_python(argv[2:])
    from runtime.launch import main as launch_main

    hook, _, arg = argv[1].partition("=")
    return launch_main(argv[2:], hooks=HOOKS[hook](arg or None))


def main() -> int:
    """Forked from the session's zygote when the tests started one (tests/node_zygote.py), else run here."""
    from node_zygote import delegate

    status = delegate(sys.argv)
    return run_here(sys.argv) if status is None else status


if __name__ == "__main__":
    sys.exit(main())
