"""llama.cpp through llama-cpp-python: one GGUF model, one context whose KV memory holds many sequences.

Shared by the ``gguf`` drafter (``drafter_node/gguf.py``) and the llama.cpp target backend
(``shared/llama_target.py``), so ``shared`` never imports ``drafter_node``:

* :func:`import_llama_cpp` — the module, or a :class:`~shared.models.ModelLoadError` that says what to install;
* :func:`gguf_path` — a config's ``model`` (a named model's verified GGUF, or a ``.gguf`` path) as a file;
* :class:`LlamaEngine` — the model and its context: sequence ids handed out and given back, crops
  (``llama_memory_seq_rm``), copies (``llama_memory_seq_cp``), and batched forwards in which a token may belong to
  several sequences (a token tree's shared nodes, the way llama.cpp's speculative example verifies a tree).

Threads follow the node's thread policy: before each forward the engine takes torch's current count (what the
node's ``ThreadShare`` sets) as llama.cpp's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from shared.gguf_header import MAX_VOCAB, GGUFHeaderError, check_gguf_header
from shared.models import ModelLoadError
from shared.named_models import is_named_model

log = logging.getLogger("pipespec.llama")

#: What to install when llama-cpp-python is missing (the gguf type's spec says the same at config time).
INSTALL_HINT = "make setup-gguf (builds llama-cpp-python for this CPU; or pip install 'pipespec[gguf]')"


class LlamaDecodeError(RuntimeError):
    """llama.cpp could not run a forward (its KV memory is full, or it failed); the caches are as before it."""


def import_llama_cpp(what: str = "drafter.type gguf"):
    """The llama_cpp module, or a ModelLoadError that says ``what`` needs it and what to install."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(f"{what} needs llama-cpp-python ({exc}); install it with {INSTALL_HINT}") from None
    return llama_cpp


def gguf_file_problem(path: str) -> str | None:
    """Why ``path`` is not a GGUF file (unreadable, or not starting with the GGUF magic), or None: the one check
    of the config loader and of the node, which may run on another host than the one that loaded it."""
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return f"it is not a readable file: {exc.strerror}"
    return None if magic == b"GGUF" else "it is not a GGUF file (it does not start with 'GGUF')"


def gguf_path(model: str, key: str = "drafter.model") -> Path:
    """``model`` (the config's ``key``) as a GGUF file: a named model's verified GGUF (installed by the launcher,
    no conversion) or a path to a ``.gguf`` file."""
    if is_named_model(model):
        from shared.named_models import gguf_file_path, installed_gguf

        found = installed_gguf(model)
        if found is None:
            raise ModelLoadError(f"the GGUF of named model {model!r} is not installed at {gguf_file_path(model)}: "
                                 f"run `python -m weights --gguf {model}` (the launcher does it)")
        return found
    problem = gguf_file_problem(model)
    if problem is not None:
        raise ModelLoadError(f"{key}: {model!r}: {problem} (llama.cpp loads a .gguf file or a named model's GGUF)")
    return Path(model).expanduser()


class Token(NamedTuple):
    """One token of a forward: its id, position, the sequences it belongs to, and whether its logits are wanted."""

    token: int
    pos: int
    seqs: Sequence[int]
    logits: bool


class LlamaEngine:
    """One GGUF model in llama.cpp and one context with KV memory for ``n_seq`` sequences of up to ``n_ctx``
    positions in all (the memory is shared: a long sequence may take what short ones leave, up to
    ``max_seq_tokens`` positions each where given). ``n_gpu_layers`` layers are offloaded to a GPU (0: CPU only; the
    caller checks :func:`gpu_offload_problem` first). The file's header is read with bounds before llama.cpp sees
    it (:func:`shared.gguf_header.check_gguf_header`, a vocabulary of at most ``max_vocab`` tokens)."""

    def __init__(self, path: Path, n_ctx: int, n_seq: int, threads: int, batch_tokens: int = 512,
                 n_gpu_layers: int = 0, main_gpu: int = 0, max_vocab: int | None = None,
                 max_seq_tokens: int | None = None):
        try:
            check_gguf_header(path, max_vocab)
        except GGUFHeaderError as exc:
            raise ModelLoadError(f"{path}: refused before llama.cpp read it: {exc}") from None
        lib = import_llama_cpp()
        self.lib = lib
        self.path = path
        self.max_seq_tokens = max_seq_tokens
        lib.llama_backend_init()
        _quiet_logs(lib)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = self.n_gpu_layers = n_gpu_layers
        mparams.main_gpu = main_gpu
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {path}: {' / '.join(LAST_ERRORS) or 'no reason given'}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        eos = int(lib.llama_vocab_eos(self.vocab))
        self.fallback_token = eos if 0 <= eos < self.n_vocab else 0
        self.ctx = lib.llama_init_from_model(self.model, self._context_params(n_ctx, n_seq, threads, batch_tokens))
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path} (n_ctx {n_ctx}, {n_seq} sequences)")
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.memory = lib.llama_get_memory(self.ctx)
        # llama.cpp caps the batch at n_ctx, and aborts the process (GGML_ASSERT) on a decode over its batch size:
        # every decode is split at the size the context really has
        self.batch_tokens = int(lib.llama_n_batch(self.ctx))
        self.threads = threads
        self.n_seq = n_seq
        self._batch = lib.llama_batch_init(self.batch_tokens, 0, n_seq)  # a token may carry every sequence id
        self._free = list(range(n_seq - 1, -1, -1))  # sequence ids not in use (popped from the end: 0 first)

    def _context_params(self, n_ctx: int, n_seq: int, threads: int, batch_tokens: int) -> Any:
        cparams = self.lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = batch_tokens
        cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # one pool for every sequence: n_ctx is not split n_seq ways
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        return cparams

    # ------------------------------------------------------------------ sequences
    def acquire(self) -> int | None:
        """A free sequence id, or None when every one is in use."""
        return self._free.pop() if self._free else None

    def free_sequences(self) -> int:
        return len(self._free)

    def release(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._free.append(seq)

    def crop(self, seq: int, keep: int) -> None:
        """Drop ``seq``'s positions from ``keep`` on."""
        if not self.lib.llama_memory_seq_rm(self.memory, seq, keep, -1):
            raise LlamaDecodeError(f"llama.cpp could not crop sequence {seq} to {keep} positions")

    def copy(self, src: int, dst: int, lo: int = -1, hi: int = -1) -> None:
        """Make ``dst`` hold ``src``'s positions ``[lo, hi)`` too (-1: open end). In the unified KV memory this
        tags the cells with ``dst``; nothing is copied."""
        self.lib.llama_memory_seq_cp(self.memory, src, dst, lo, hi)

    def token_texts(self) -> list[str]:
        """Every token's text in id order (the GGUF's vocabulary, as the verifier's fingerprint reads it): at most
        :data:`~shared.gguf_header.MAX_VOCAB` strings (the header check bounds it before the load; this is the
        second lock on one string built per token)."""
        if self.n_vocab > MAX_VOCAB:
            raise ModelLoadError(f"{self.path}: a vocabulary of {self.n_vocab:,} tokens (at most {MAX_VOCAB:,})")
        get = self.lib.llama_vocab_get_text
        return [get(self.vocab, i).decode("utf-8", errors="surrogateescape") for i in range(self.n_vocab)]

    def file_type(self) -> str:
        """The GGUF's weight type in lower case (``q4_k_m``, ``f32``, …; ``gguf`` when it states none)."""
        buf = ctypes.create_string_buffer(32)
        if self.lib.llama_model_meta_val_str(self.model, b"general.file_type", buf, len(buf)) < 0:
            return "gguf"
        try:
            import gguf

            return gguf.LlamaFileType(int(buf.value)).name.lower().removeprefix("mostly_").removeprefix("all_")
        except (ImportError, ValueError):
            return "gguf"

    # ------------------------------------------------------------------ forwards
    def decode(self, rows: list[tuple[int, int, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """One forward over ``rows`` — ``(seq, start position, tokens)`` each — returning per row the float32
        logits of its last token (``all_logits``: of each of its tokens, ``[T, n_vocab]``)."""
        tokens, owner = [], []
        for r, (seq, start, ids) in enumerate(rows):
            for j, token in enumerate(ids):
                want = all_logits or j == len(ids) - 1
                tokens.append(Token(token, start + j, (seq,), want))
                if want:
                    owner.append(r)
        wanted: list[list[np.ndarray]] = [[] for _ in rows]
        for r, logits in zip(owner, self.decode_tokens(tokens, [(seq, start) for seq, start, _ in rows])):
            wanted[r].append(logits)
        return [np.stack(w) if all_logits else w[-1] for w in wanted]

    def decode_tokens(self, tokens: list[Token], undo: list[tuple[int, int]]) -> list[np.ndarray]:
        """One forward over ``tokens`` (a token in several sequences is computed once and cached for each): the
        float32 logits of the tokens that want them, in order. Batches larger than llama.cpp's batch are split
        into several decodes. On failure every ``(seq, start)`` of ``undo`` is cropped back to ``start``. A token
        at or past ``max_seq_tokens`` fails the forward before anything runs (one sequence never takes the pool)."""
        cap = self.max_seq_tokens
        if cap is not None and tokens and max(t.pos for t in tokens) >= cap:
            raise LlamaDecodeError(f"a sequence would grow past its cap of {cap} positions in the shared KV memory")
        self._follow_torch_threads()
        out: list[np.ndarray] = []
        batch, n, pending = self._batch, 0, []
        for token in tokens:
            if n == self.batch_tokens:
                self._run(n, pending, out, undo)
                n, pending = 0, []
            # a token past the GGUF's vocabulary (a target's own added tokens): a known one in its place
            batch.token[n] = token.token if 0 <= token.token < self.n_vocab else self.fallback_token
            batch.pos[n] = token.pos
            batch.n_seq_id[n] = len(token.seqs)
            for k, seq in enumerate(token.seqs):
                batch.seq_id[n][k] = seq
            batch.logits[n] = 1 if token.logits else 0
            if token.logits:
                pending.append(n)
            n += 1
        if n:
            self._run(n, pending, out, undo)
        return out

    def _run(self, n: int, pending: list[int], out: list[np.ndarray], undo: list[tuple[int, int]]) -> None:
        self._batch.n_tokens = n
        code = self.lib.llama_decode(self.ctx, self._batch)
        if code != 0:
            for seq, start in undo:  # leave every sequence as it was before this forward
                self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)
            what = "its KV memory is full" if code == 1 else f"error {code}"
            raise LlamaDecodeError(f"llama.cpp could not run a forward of {n} tokens: {what}")
        for i in pending:
            ptr = self.lib.llama_get_logits_ith(self.ctx, i)
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def _follow_torch_threads(self) -> None:
        threads = torch.get_num_threads()
        if threads != self.threads:
            self.lib.llama_set_n_threads(self.ctx, threads, threads)
            self.threads = threads

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None


def gpu_offload_problem(device: str) -> str | None:
    """Why llama.cpp cannot run on ``device`` (None: it can): a ``cuda`` device needs a llama-cpp-python built
    with GPU offload (``llama_supports_gpu_offload``); ``cpu`` always runs."""
    if device == "cpu":
        return None
    if not device.startswith("cuda"):
        return f"llama.cpp runs on cpu or cuda, not {device!r}"
    lib = import_llama_cpp("device cuda")
    if not lib.llama_supports_gpu_offload():
        return ("this llama-cpp-python was built without GPU offload (llama_supports_gpu_offload() is false): "
                "rebuild it with CMAKE_ARGS=-DGGML_CUDA=on, or set device: cpu")
    return None


_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer
#: llama.cpp's latest error lines, for the message of a load that failed.
LAST_ERRORS: deque[str] = deque(maxlen=3)


def _quiet_logs(lib) -> None:
    """llama.cpp's loading chatter goes to our debug log, its errors and warnings to our log (not raw stderr)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    def forward(level: int, text: bytes, _user: Any) -> None:
        message = text.decode("utf-8", errors="replace").rstrip()
        if message and level == 4:
            LAST_ERRORS.append(message)
        if message:
            # ggml's levels: 3 warning, 4 error
            log.log(logging.WARNING if level in (3, 4) else logging.DEBUG, "llama.cpp: %s", message)

    _LOG_CALLBACK = lib.llama_log_callback(forward)
    lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def build_info() -> str:
    """llama.cpp's description of its build (the instruction sets it was compiled with)."""
    lib = import_llama_cpp()
    return lib.llama_print_system_info().decode(errors="replace").strip()


# ---------------------------------------------------------------------------------------------------- cost profile
def llama_profile(engine: LlamaEngine, spec: Any, progress: Callable[[str], None],
                  device: str = "cpu") -> Any:
    """The start-up cost curve (:class:`shared.costs.curve.NodeProfile`) of llama.cpp forwards over 1 .. max rows
    (tokens of one sequence, as a node's batched steps are rows of different sequences at about the same cost), at
    each thread count of ``spec`` (a :class:`shared.models.ProfileSpec`), checked for a quiet machine (a busy one is
    measured again at the next start); cached on disk like the torch models' profiles. None when ``spec`` has no
    budget."""
    from shared.costs.cache import profile_key, read_cached, write_cached
    from shared.costs.curve import NodeProfile
    from shared.costs.measure import measure_quietly

    if spec.budget_s <= 0:
        return None
    path = engine.path
    st = path.stat()  # a file is not fingerprinted by the cache: its size and mtime, and the engine's build
    variant = f"llama.cpp {getattr(engine.lib, '__version__', '?')} {st.st_size} {st.st_mtime_ns}"
    threads = sorted(set(spec.threads))
    key = profile_key(str(path), device, "gguf", threads, spec.sizes, variant=variant)
    cached = read_cached(key)
    if cached is not None and sorted(cached.curves) == threads:
        progress(f"profile of {path.name} in llama.cpp: cached")
        return cached
    started = time.perf_counter()
    curves, quiet = measure_quietly(None, spec.sizes, threads, spec.budget_s, device, progress,
                                    measure=lambda: measure_curves(engine, spec.sizes, threads, spec.budget_s))
    profile = NodeProfile(model=path.name, device=device, dtype="gguf", curves=curves,
                          measured_s=time.perf_counter() - started, quiet=quiet, key=key)
    for count, curve in curves.items():
        progress(f"profiled {path.name} in llama.cpp at {count} thread(s): "
                 + ", ".join(f"{k}: {s * 1000:.0f} ms" for k, s in zip(curve.sizes, curve.seconds)))
    write_cached(key, profile)
    return profile


def measure_curves(engine: LlamaEngine, sizes: list[int], threads: list[int], budget_s: float) -> dict[int, Any]:
    """Per thread count: the fastest of three forwards of n tokens on a 64-token cached prefix, for each n in
    ``sizes`` while the thread count's share of ``budget_s`` lasts (at least the smallest n)."""
    from shared.costs.curve import CostCurve
    from shared.costs.measure import nondecreasing

    seq = engine.acquire()
    if seq is None:
        raise LlamaDecodeError("no free llama.cpp sequence to measure with")
    prefix = 64
    rng = np.random.default_rng(1234)
    budget = budget_s / max(1, len(threads))
    previous = torch.get_num_threads()
    curves: dict[int, CostCurve] = {}
    try:
        for count in threads:
            torch.set_num_threads(count)  # the engine follows torch's count (see LlamaEngine.decode)
            engine.crop(seq, 0)
            engine.decode([(seq, 0, rng.integers(0, engine.n_vocab, prefix).tolist())])
            t_start, points = time.perf_counter(), {}
            for n in sorted(sizes):
                best = float("inf")
                for _ in range(3):
                    ids = rng.integers(0, engine.n_vocab, n).tolist()
                    t0 = time.perf_counter()
                    engine.decode([(seq, prefix, ids)])
                    best = min(best, time.perf_counter() - t0)
                    engine.crop(seq, prefix)
                points[n] = max(best, 1e-9)
                if time.perf_counter() - t_start > budget:
                    break
            ks = sorted(points)
            curves[count] = CostCurve(ks, nondecreasing([points[k] for k in ks]), prefix)
    finally:
        torch.set_num_threads(previous)
        engine.release(seq)
    return curves
