"""The config sections that need nothing above ``shared/``: ``verifier``, ``verification``, ``client``,
``launch``, ``security`` and ``http``, each a frozen dataclass of :func:`shared.settings.setting` fields (every
key's default, bounds and one-line doc, declared once).

They live down here, not in ``runtime/``, because the nodes take the whole typed config
(:class:`shared.config.Config`) and a node may not import ``runtime/`` (tests/test_layers.py). The drafter
reads the ``verifier`` section too (its endpoint, message limit, model and device), so that section is not the
verifier node's alone. ``runtime/config_schema.py`` lists every section in the reference's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.node_keys import (
    DEFAULT_COMPILED_TOKENS,
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
from shared.protocol import DEFAULT_MAX_MESSAGE_BYTES
from shared.sampling import MAX_NEW_TOKENS
from shared.settings import setting
from shared.transport import CURVE_MODES

#: ``launch.backend``: child processes of the launcher, threads of the launcher's process (tests), or actors on a Ray
#: cluster (the registry: runtime/launchers/__init__.py).
LAUNCH_BACKENDS = ("process", "inproc", "ray")
#: ``launch.placement_strategy``: Ray's placement group strategies.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: Most drafter processes one launcher starts (``launch.drafters``).
MAX_LAUNCHED_DRAFTERS = 16


@dataclass(frozen=True)
class VerifierConfig:
    """``verifier``: the target model and the node that verifies drafts."""

    model: Any = setting(None, "Target model: a named model, a local folder or a hub id (required).", kind="str")
    device: str = node_device()
    dtype: str = node_dtype()
    threads: Any = node_threads()
    profile_s: float = node_profile_s()
    endpoint: str = setting(
        "ipc://{run_dir}/verifier.ipc", "Where drafters connect; {run_dir}: the launcher's run folder.", kind="str"
    )
    max_memory: Any = node_max_memory()
    draft_timeout_ms: int = setting(
        3000,
        "Cap on the wait for a draft (the wait follows each session's measured answers).",
        kind="int",
        bounds=(1, None),
    )
    max_sessions: int = setting(64, "Concurrent requests; more get a busy error.", kind="int", bounds=(1, None))
    max_sessions_per_tenant: Any = setting(
        None, "Concurrent requests of one tenant; more wait, then get a busy error (null: a fair share of "
        "max_sessions where tenants >= 2, else max_sessions only); docs/security.md.",
        kind="int", bounds=(1, None))
    max_kv_tokens_per_tenant: Any = setting(
        None, "Most of max_kv_tokens one tenant's requests may hold (null: a fair share where tenants >= 2, else "
        "the whole budget); docs/security.md.", kind="int", bounds=(1, None))
    tenants: Any = setting(
        None, "How many tenants share this verifier, for the fair per-tenant defaults: 1/N of max_sessions and "
        "max_kv_tokens each, at least 1/8 (null: the tenants named in http.api_keys_file, else 1).",
        kind="int", bounds=(1, None))
    admission_wait_s: float = setting(
        10.0, "How long a request that does not fit now (sessions, KV budget, its tenant's share) waits for room "
        "before its busy error (0: refused at once); longer than client.heartbeat_timeout_s, so the budget of clients "
        "that vanished comes back to the waiting.", kind="number", bounds=(0, 600), unit="seconds")
    max_waiting_requests: int = setting(
        64, "Requests waiting for room at once (one tenant: at most its max_sessions_per_tenant); more get a busy "
        "error.", kind="int", bounds=(1, None))
    batching: bool = setting(True, "Verify several sessions' drafts in one batched forward.", kind="bool")
    max_batch_sessions: int = setting(64, "Most sessions in one batched forward.", kind="int", bounds=(1, None))
    max_batch_tokens: int = setting(
        1024,
        "Most tokens (pending + drafts, every row's) in one forward; one session always fits.",
        kind="int",
        bounds=(1, None),
    )
    max_prefill_tokens: int = setting(
        2048,
        "Most prompt tokens prefilled in one forward (rows × longest chunk when prompts share one); a longer prompt "
        "is prefilled in chunks of this many tokens, the running sessions' rounds between them.",
        kind="int",
        bounds=(1, None),
    )
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES, "Larger messages get an error reply.", kind="int", bounds=(1, None)
    )
    backend: str = node_backend()
    compiled_max_tokens: int = setting(
        DEFAULT_COMPILED_TOKENS,
        "Compiled backend: the most new tokens of a compiled decode step (steps are compiled for 1, 2, 4, … up to "
        "it at start-up; longer forwards run eagerly).",
        kind="int",
        bounds=(1, 256),
    )
    kv_slot_tokens: int = node_kv_slot_tokens()
    kv_slots: Any = node_kv_slots("the smallest of max_sessions, max_batch_sessions and 8")
    allow_remote: bool = setting(
        False, "With security.curve: off, must be true to listen on a non-loopback address.", kind="bool"
    )
    placement: Any = node_placement()
    # Request preparation off the loop and admission by memory (verifier_node/request_prep.py, admission.py).
    max_pending_requests: int = setting(
        64,
        "Requests being tokenised or having their grammar compiled at once (off the loop); more get a busy error.",
        kind="int",
        bounds=(1, None),
    )
    grammar_compile_timeout_s: float = setting(
        5.0,
        "A grammar compile running longer fails its request (400), and the same spec from that tenant is refused at "
        "once for 300 s; the compiler process is killed and replaced by a warm spare.",
        kind="number",
        bounds=(0, None),
        open_low=True,
        unit="seconds",
    )
    grammar_cache_bytes: int = setting(
        64 * 1024 * 1024,
        "Bytes of compiled grammars kept in pipespec's per-tenant cache (xgrammar's own cache is off).",
        kind="int",
        bounds=(0, None),
    )
    grammar_mask_budget_ms: float = setting(
        100.0,
        "A structured-output session's share of a round for filling its grammar masks (off the loop); a session "
        "over it verifies fewer positions a round, and fails if one position a round stays over; docs/security.md.",
        kind="number",
        bounds=(0, None),
        open_low=True,
        unit="milliseconds",
    )
    max_model_len: Any = setting(
        None,
        "Most prompt + max_new_tokens of one request (null: the target's max_position_embeddings, or 32768 for a "
        "target that states none); longer requests get a 400.",
        kind="int",
        bounds=(1, None),
    )
    max_kv_tokens: Any = setting(
        None,
        "Token budget: the sum of prompt + max_new_tokens over admitted requests (null: kv_slots × kv_slot_tokens "
        "where the backend has slots, else 65536); a request that does not fit now gets a busy error.",
        kind="int",
        bounds=(1, None),
    )


@dataclass(frozen=True)
class VerificationConfig:
    """``verification``: how drafts are accepted."""

    ensemble_weight: Any = setting(
        None,
        "Static ensemble weight, in the open interval (0, 1); null: standard, lossless verification.",
        kind="number",
        bounds=(0, 1),
        open_low=True,
        open_high=True,
        hint="leave it unset, null, for standard, lossless verification",
    )


@dataclass(frozen=True)
class ClientConfig:
    """``client``: the client socket and its timeouts."""

    endpoint: str = setting("ipc://{run_dir}/client.ipc", "Where clients connect.", kind="str")
    timeout_s: float = setting(
        600,
        "A client raises TimeoutError after this long without a reply.",
        kind="number",
        bounds=(0, None),
        open_low=True,
        unit="seconds",
    )
    heartbeat_timeout_s: float = setting(
        5.0,
        "Seconds without a client ping before its requests are dropped (at least 1).",
        kind="number",
        bounds=(1.0, None),
        unit="seconds",
        hint="clients ping every 0.5 s while requests are in flight",
    )


@dataclass(frozen=True)
class LaunchConfig:
    """``launch``: what the launcher starts."""

    ready_timeout_s: float = setting(
        900,
        "Start-up bound (includes first-time model conversion).",
        kind="number",
        bounds=(0, None),
        open_low=True,
        unit="seconds",
    )
    start_drafter: bool = setting(True, "Start drafter processes (false: they join with --role drafter).", kind="bool")
    drafters: int = setting(
        1,
        "Drafter processes to start.",
        kind="int",
        bounds=(1, MAX_LAUNCHED_DRAFTERS),
        hint="more can join with --role drafter",
    )
    backend: str = setting(
        "process",
        "process: the nodes are child processes of this one; inproc: threads of this process (tests, debugging); "
        "ray: actors on a Ray cluster (docs/ray.md).",
        kind="str",
        choices=LAUNCH_BACKENDS,
    )
    ray_address: Any = setting(
        None, "backend ray: the cluster to join (ray://HOST:PORT, HOST:PORT, or auto: RAY_ADDRESS's, else the one "
        "`ray start` runs on this host; null: a private local Ray of this process).", kind="str"
    )
    ray_insecure: bool = setting(
        False,
        "backend ray: join a cluster that does not ask for Ray's token authentication (anyone who reaches its ports "
        "runs code on every host; docs/ray.md, Security).",
        kind="bool",
    )
    ray_name: str = setting(
        "pipespec", "backend ray: the run's name on the cluster (`pipespec scale --name` finds it by it).", kind="str"
    )
    placement_strategy: str = setting(
        "PACK",
        "backend ray: how the nodes' bundles spread over the hosts (Ray's placement group strategy).",
        kind="str",
        choices=PLACEMENT_STRATEGIES,
    )
    max_restarts: int = setting(
        3,
        "backend ray: times Ray restarts a node actor that died (-1: without limit).",
        kind="int",
        bounds=(-1, None),
    )
    link_delay_ms: float = setting(
        0,
        "backend ray: one-way delay added on each drafter's link to the verifier (a delay proxy on its host).",
        kind="number",
        bounds=(0, 10000),
        unit="milliseconds",
    )


@dataclass(frozen=True)
class SecurityConfig:
    """``security``: CURVE encryption and the key files."""

    curve: str = setting(
        "auto", "auto: CURVE on every non-loopback tcp link; on: every link; off.", kind="str", choices=CURVE_MODES
    )
    keys_dir: Any = setting(None, "Folder made by `python -m runtime.keys init DIR`.", kind="str")
    drafter_key: str = setting("drafter", "The drafter's key pair: keys_dir/drafters/NAME.key_secret.", kind="str")
    client_key: str = setting("client", "The launcher's client key pair: keys_dir/clients/NAME.key_secret.", kind="str")
    gateway_clients: Any = setting(
        None, "Client keys (names in keys_dir/clients, comma-separated) that may name a request's tenant under CURVE, "
        "besides the run's own HTTP server, which gets a key of its own each run (null: none); docs/security.md.",
        kind="str")


#: ``http.tool_call_parser``: auto, or a family of shared.tool_calls.PARSERS.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class HttpConfig:
    """``http``: the OpenAI-compatible HTTP server, off while host is null (``--http HOST:PORT`` sets both)."""

    host: Any = setting(None, "Address to serve on (null: no HTTP server).", kind="str")
    port: int = setting(8000, "TCP port.", kind="int", bounds=(1, 65535))
    api_key: Any = setting(None, "Bearer token clients must send (null: PIPESPEC_HTTP_API_KEY or none).", kind="str")
    api_keys_file: Any = setting(
        None, "File of `TENANT:KEY` lines (or TENANT<TAB>KEY), one API key per tenant; readable by its owner only "
        "(api_key, if set too, is tenant default); docs/security.md.", kind="str")
    request_metrics: bool = setting(
        False, "Put each request's speculative-decoding metrics in its response (they tell a client how well its "
        "text was predicted); /metrics has the aggregates either way.", kind="bool")
    allow_remote: bool = setting(False, "Serve on a non-loopback address (needs api_key).", kind="bool")
    model_name: Any = setting(None, "Model name the API reports (null: the target's name).", kind="str")
    default_max_tokens: int = setting(
        256, "max_tokens when a request gives none.", kind="int", bounds=(1, MAX_NEW_TOKENS)
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, "Largest request body accepted.", kind="int", bounds=(1024, 1 << 30))
    scrape_timeout_s: float = setting(
        1.0,
        "Seconds a /metrics scrape waits for the verifier.",
        kind="number",
        bounds=(0, 60),
        open_low=True,
        unit="seconds",
    )
    # what one HTTP client may cost the others (issue 32): a stalled reader, a foreign Host header
    send_timeout_s: float = setting(
        30.0,
        "Seconds a response may wait for its client to read; then it is cancelled and the connection closed.",
        kind="number",
        bounds=(0, 3600),
        open_low=True,
        unit="seconds",
    )
    allowed_hosts: Any = setting(
        (),
        "Host names accepted besides loopback and http.host when api_key is null (DNS-rebinding guard).",
        kind="any",
    )
    # what a client may cost the others before it is authorized (issue 43)
    admin_key: Any = setting(
        None, "Bearer token for /metrics and /health's details (null: PIPESPEC_HTTP_ADMIN_KEY; else api_key when no "
        "api_keys_file is set, else no one; with no key at all: every loopback caller).", kind="str")
    body_timeout_s: float = setting(
        30.0,
        "Seconds a request's whole body may take to arrive after its head; then a 408 and the connection closed.",
        kind="number",
        bounds=(0, 3600),
        open_low=True,
        unit="seconds",
    )
    header_timeout_s: float = setting(
        10.0,
        "Seconds a new connection may take to send its first complete request head; then it is closed.",
        kind="number",
        bounds=(0, 3600),
        open_low=True,
        unit="seconds",
    )
    tool_call_parser: str = setting(
        "auto", "How tool calls are read from the output (docs/http.md, Tool calling): auto: the family of the "
        "target's chat template (none found: requests with tools are refused); or hermes, llama3_json, mistral.",
        kind="str", choices=TOOL_CALL_PARSERS)
    max_connections_per_client: Any = setting(
        None,
        "Open connections one client address may hold (null: half the server's connection limit); more get a 503 "
        "and are closed. Behind a proxy every client has its address: raise it there.",
        kind="int",
        bounds=(1, None),
    )
