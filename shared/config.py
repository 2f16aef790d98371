"""The typed config the nodes take: :class:`Config` (every section as a frozen dataclass) and the ``drafter``
section's keys every drafter type has (:class:`DrafterConfig`; each type's own keys are declared in its spec,
``drafter_node/type_specs/<name>.py``).

Here, at the bottom layer, so both nodes name these types without importing each other or ``runtime/``
(tests/test_layers.py): the verifier node imports ``shared`` only. ``runtime.config.typed`` builds a Config once from
a validated config dict; the launchers hand that object to every node (a Ray actor gets it pickled).
runtime/config_schema.py lists every section in the reference's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.config_sections import (
    ClientConfig,
    HttpConfig,
    LaunchConfig,
    SecurityConfig,
    VerificationConfig,
    VerifierConfig,
)
from shared.node_keys import (
    node_backend,
    node_device,
    node_dtype,
    node_kv_slot_tokens,
    node_kv_slots,
    node_max_memory,
    node_placement,
    node_profile_s,
    node_threads,
)
from shared.protocol import MAX_DRAFT_TOKENS
from shared.settings import setting

#: ``drafter.draft_schedule``'s values (drafter_node/schedule.py implements them).
DRAFT_SCHEDULES = ("cost", "pipeline", "adaptive", "heuristic", "constant")
#: Every registered ``drafter.type``, by name (drafter_node/types.py maps each to its spec and checks the two agree):
#: the verifier checks a request's ``drafter_type`` against these without importing the drafter package.
DRAFTER_TYPE_NAMES = ("assistant", "prompt_lookup", "early_exit", "mtp", "mtp_drafter", "universal", "suffix", "gguf")
#: ``drafter.type`` when a config names none.
DEFAULT_DRAFTER_TYPE = "assistant"


@dataclass(frozen=True)
class DrafterConfig:
    """``drafter``: the keys every drafter type has (each type's own keys are declared in its spec)."""

    type: str = setting(
        DEFAULT_DRAFTER_TYPE,
        "auto (gguf where llama.cpp runs, else assistant), assistant, prompt_lookup, early_exit, mtp, mtp_drafter, "
        "universal, suffix or gguf (see the per-type tables).",
        kind="str",
    )
    type_reason: str = setting(
        "", "Set by the loader when type is auto: which type it chose and why (shown at start-up).", kind="str"
    )
    model: Any = setting(
        None, "Draft model; required by types that need one (some default it to verifier.model).", kind="str"
    )
    device: str = node_device()
    dtype: str = node_dtype()
    threads: Any = node_threads()
    profile_s: float = node_profile_s()
    num_draft_tokens: int = setting(
        5, "Block length k (the starting value of an adaptive schedule).", kind="int", bounds=(1, MAX_DRAFT_TOKENS)
    )
    draft_schedule: str = setting(
        "cost",
        "cost: k (incl. 0), overlap or sync and rows from measured costs; or a fixed rule.",
        kind="str",
        choices=DRAFT_SCHEDULES,
    )
    max_draft_tokens: int = setting(
        16, "Cap for the adaptive schedules (cost: the largest k).", kind="int", bounds=(1, MAX_DRAFT_TOKENS)
    )
    overlap: bool = setting(True, "false: synchronous mode (draft one block, wait for its commit).", kind="bool")
    tree: bool = setting(False, "The cost schedule may send token trees (greedy, synchronous rounds).", kind="bool")
    remember_acceptance: bool = setting(
        True, "Start the cost schedule from this pair's earlier acceptance.", kind="bool"
    )
    batching: bool = setting(True, "Draft for several sessions in one batched forward.", kind="bool")
    max_batch_sessions: int = setting(64, "Most sessions in one batched draft forward.", kind="int", bounds=(1, None))
    backend: str = node_backend()
    kv_slot_tokens: int = node_kv_slot_tokens()
    kv_slots: Any = node_kv_slots("the smaller of max_batch_sessions and 8")
    q_top_k: int = setting(
        64,
        "q sent sparse: the top-m entries per position, by types that send q (0: full q).",
        kind="int",
        bounds=(0, None),
    )
    verifier_endpoint: Any = setting(None, "Verifier address to connect to (null: verifier.endpoint).", kind="str")
    max_memory: Any = node_max_memory()
    target_model: Any = setting(
        None, "Target checkpoint read by types that read it (null: verifier.model).", kind="str"
    )
    placement: Any = node_placement()


@dataclass(frozen=True)
class Config:
    """A validated config as frozen sections (:func:`runtime.config.typed` builds one; the launcher builds it once
    and hands it to the nodes). ``drafter_type`` holds the configured type's own keys
    (:meth:`drafter_node.spec.DrafterSpec.own_settings`: None for a type without any). Plain values: it pickles (a
    node on a Ray cluster gets it as a call argument)."""

    verifier: VerifierConfig
    drafter: DrafterConfig
    drafter_type: Any
    verification: VerificationConfig
    client: ClientConfig
    launch: LaunchConfig
    security: SecurityConfig
    http: HttpConfig

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The sections as plain dicts, with the configured drafter type's own keys in ``drafter``: the shape of a
        loaded config (less other types' keys), for the launcher's helpers that read one (model installs, links)."""
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name != "drafter_type"}
        own = self.drafter_type
        if dataclasses.is_dataclass(own):
            out["drafter"].update(dataclasses.asdict(own))
        elif isinstance(own, Mapping):
            out["drafter"].update(own)
        return out
