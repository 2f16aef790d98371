"""``gguf`` drafter: a GGUF model run by llama.cpp (through llama-cpp-python) drafts for a target on torch.

On a CPU the drafter's forward is most of a round, and llama.cpp runs small models two to three times faster per
token than torch there; drafts are only proposals, so the target (and the exactness reference) stays on
transformers. Everything above the forward is the assistant's: :class:`~drafter_node.lm_drafter.LMDraftSession`
drafts the chain with the shared logits processing (greedy argmax with the second choice trees and pre-drafting
rank by, or a sample with its top-k q for lossless sampling), keeps the KV cache in step with the commits and
batches sessions. What this module adds is a llama.cpp stand-in for the torch model and its caches:

* :class:`LlamaEngine` — one model and one llama.cpp context whose KV memory (one pool of ``kv_slots ×
  kv_slot_tokens`` positions) holds up to 256 sequences; a batched forward of many sessions is one ``llama_decode``
  over their sequences;
* :class:`LlamaSequence` — one session's sequence, with the part of :class:`shared.kv.CachedLM`'s interface the
  session uses (``feed``, ``uncached``, ``crop``, ``length``, ...); cropping is ``llama_memory_seq_rm``;
* :class:`LlamaBackend` — the node's KV backend over the engine (``open`` a sequence, ``feed_rows`` batched).

Vocabulary: the drafter sends a fingerprint of its GGUF token list (:func:`shared.models.vocab_fingerprint`); the
verifier compares it with its tokenizer's, so a GGUF whose ids do not map onto the target's is refused at connect
with the reason (``universal`` covers different tokenizers).

Threads follow the node's thread policy: before each forward the engine takes torch's current count (what the
node's ``ThreadShare`` sets) as llama.cpp's.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from drafter_node.base import Capabilities, Drafter, DraftSession
from drafter_node.gguf_check import run_probe
from drafter_node.lm_drafter import LMDraftSession
from drafter_node.settings import DrafterConfig
from drafter_node.type_specs.gguf import gguf_file_problem
from shared.backend import TargetBackend
from shared.batch import Row, RowOutput
from shared.costs.cache import profile_key, read_cached, write_cached
from shared.costs.curve import CostCurve, NodeProfile
from shared.costs.measure import measure_quietly, nondecreasing
from shared.kv import SequenceCache
from shared.models import ModelLoadError, ProfileSpec, vocab_fingerprint
from shared.named_models import is_named_model
from shared.node_keys import kv_slots
from shared.sampling import GenerationParams

log = logging.getLogger("pipespec.drafter")

#: What to install when llama-cpp-python is missing (the type's spec says the same at config time).
INSTALL_HINT = "make setup-gguf (builds llama-cpp-python for this CPU; or pip install 'pipespec[gguf]')"


class LlamaDecodeError(RuntimeError):
    """llama.cpp could not run a forward (its KV memory is full, or it failed); the caches are as before it."""


def import_llama_cpp():
    """The llama_cpp module, or a ModelLoadError that says what to install."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(f"drafter.type gguf needs llama-cpp-python ({exc}); install it with {INSTALL_HINT}") \
            from None
    return llama_cpp


def gguf_path(model: str) -> Path:
    """``drafter.model`` as a GGUF file: a named model's verified GGUF (installed by the launcher, no conversion)
    or a path to a ``.gguf`` file."""
    if is_named_model(model):
        from shared.named_models import gguf_file_path, installed_gguf

        found = installed_gguf(model)
        if found is None:
            raise ModelLoadError(f"the GGUF of named model {model!r} is not installed at {gguf_file_path(model)}: "
                                 f"run `python -m weights --gguf {model}` (the launcher does it)")
        return found
    problem = gguf_file_problem(model)
    if problem is not None:
        raise ModelLoadError(f"drafter.model: {model!r}: {problem} (the gguf type loads a .gguf file or a named "
                             "model's GGUF)")
    return Path(model).expanduser()


class LlamaEngine:
    """One GGUF model in llama.cpp and one context with KV memory for ``n_seq`` sequences of up to ``n_ctx``
    positions in all (the memory is shared: a long sequence may take what short ones leave)."""

    def __init__(self, path: Path, n_ctx: int, n_seq: int, threads: int, batch_tokens: int = 512):
        lib = import_llama_cpp()
        self.lib = lib
        self.path = path
        lib.llama_backend_init()
        _quiet_logs(lib)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {path}: {' / '.join(LAST_ERRORS) or 'no reason given'}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        eos = int(lib.llama_vocab_eos(self.vocab))
        self.fallback_token = eos if 0 <= eos < self.n_vocab else 0
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = batch_tokens
        cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # one pool for every sequence: n_ctx is not split n_seq ways
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path} (n_ctx {n_ctx}, {n_seq} sequences)")
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.memory = lib.llama_get_memory(self.ctx)
        # llama.cpp caps the batch at n_ctx, and aborts the process (GGML_ASSERT) on a decode over its batch size:
        # every decode is split at the size the context really has
        self.batch_tokens = int(lib.llama_n_batch(self.ctx))
        self.threads = threads
        self._batch = lib.llama_batch_init(self.batch_tokens, 0, 1)
        self.n_seq = n_seq
        self._free = list(range(n_seq - 1, -1, -1))  # sequence ids not in use (popped from the end: 0 first)

    # ------------------------------------------------------------------ sequences
    def acquire(self) -> int | None:
        """A free sequence id, or None when every one is in use."""
        return self._free.pop() if self._free else None

    def release(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._free.append(seq)

    def crop(self, seq: int, keep: int) -> None:
        """Drop ``seq``'s positions from ``keep`` on."""
        if not self.lib.llama_memory_seq_rm(self.memory, seq, keep, -1):
            raise LlamaDecodeError(f"llama.cpp could not crop sequence {seq} to {keep} positions")

    def token_texts(self) -> list[str]:
        """Every token's text in id order (the GGUF's vocabulary, as the verifier's fingerprint reads it)."""
        get = self.lib.llama_vocab_get_text
        return [get(self.vocab, i).decode("utf-8", errors="surrogateescape") for i in range(self.n_vocab)]

    # ------------------------------------------------------------------ forwards
    def decode(self, rows: list[tuple[int, int, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """One forward over ``rows`` — ``(seq, start position, tokens)`` each — returning per row the float32
        logits of its last token (``all_logits``: of each of its tokens, ``[T, n_vocab]``). Batches larger than
        llama.cpp's batch are split into several decodes (the logits are read after each)."""
        self._follow_torch_threads()
        wanted: list[list[np.ndarray]] = [[] for _ in rows]
        pending: list[tuple[int, int]] = []  # (row, batch index) whose logits this decode outputs
        batch = self._batch
        n = 0
        for r, (seq, start, tokens) in enumerate(rows):
            for j, token in enumerate(tokens):
                if n == self.batch_tokens:
                    self._run(n, pending, wanted, rows)
                    n, pending = 0, []
                last = j == len(tokens) - 1
                # a token past the GGUF's vocabulary (the target's own added tokens): a known one in its place
                batch.token[n] = token if 0 <= token < self.n_vocab else self.fallback_token
                batch.pos[n] = start + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 1 if (last or all_logits) else 0
                if last or all_logits:
                    pending.append((r, n))
                n += 1
        if n:
            self._run(n, pending, wanted, rows)
        return [np.stack(w) if all_logits else w[-1] for w in wanted]

    def _run(self, n: int, pending: list[tuple[int, int]], wanted: list[list[np.ndarray]],
             rows: list[tuple[int, int, list[int]]]) -> None:
        self._batch.n_tokens = n
        code = self.lib.llama_decode(self.ctx, self._batch)
        if code != 0:
            for seq, start, _ in rows:  # leave every sequence as it was before this forward
                self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)
            what = "its KV memory is full" if code == 1 else f"error {code}"
            raise LlamaDecodeError(f"llama.cpp could not run a forward of {n} tokens: {what}")
        for r, i in pending:
            ptr = self.lib.llama_get_logits_ith(self.ctx, i)
            wanted[r].append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

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


class LlamaSequence(SequenceCache):
    """One session's sequence in the engine's KV memory: the part of :class:`shared.kv.CachedLM` that
    :class:`~drafter_node.lm_drafter.LMDraftSession` uses (the shared bookkeeping of :class:`SequenceCache`, a
    ``feed`` through llama.cpp and a ``crop`` by ``llama_memory_seq_rm``). No ``capacity``: the shared memory has
    no per-sequence bound; a full one fails the forward instead."""

    recurrent = False
    batchable = True  # rows of one llama_decode with other sequences (LlamaBackend.feed_rows)
    _sliding = False

    def __init__(self, engine: LlamaEngine, seq: int, vocab_size: int):
        super().__init__(engine)  # the model a batch groups by (BatchStep.model) is the engine
        self.engine = engine
        self.seq = seq
        self.vocab_size = vocab_size

    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, None]:
        """Append ``token_ids``; float32 logits ``[T, vocab]`` (``last_logits_only``: ``[1, vocab]``)."""
        out = self.engine.decode([(self.seq, self.length, list(token_ids))], all_logits=not last_logits_only)[0]
        self.grew(len(token_ids))
        return self.widen(out if out.ndim == 2 else out[None]), None

    def widen(self, logits: np.ndarray) -> torch.Tensor:
        """Logits over the target's vocabulary: a narrower GGUF head's missing ids can never be drafted."""
        t = torch.from_numpy(logits)
        if t.shape[-1] < self.vocab_size:
            pad = torch.full((t.shape[0], self.vocab_size - t.shape[-1]), float("-inf"))
            t = torch.cat([t, pad], dim=-1)
        return t

    def crop(self, keep: int) -> None:
        if keep < self.length:
            self.engine.crop(self.seq, keep)
            self.length = keep

    def restore(self, keep: int) -> None:
        self.engine.crop(self.seq, keep)
        self.length = keep

    def anchor(self) -> None:
        """No recurrent state to mark: attention caches crop."""

    def close(self) -> None:
        if self.seq is not None:
            self.engine.release(self.seq)
            self.seq = None


class LlamaBackend(TargetBackend):
    """The drafter node's KV backend over a :class:`LlamaEngine`: sessions' sequences and their batched forwards."""

    def __init__(self, engine: LlamaEngine, vocab_size: int):
        super().__init__(engine)
        self.engine = engine
        self.vocab_size = vocab_size

    def open(self, tokens: int | None = None) -> LlamaSequence:
        seq = self.engine.acquire()
        if seq is None:
            raise LlamaDecodeError("every llama.cpp sequence is in use")
        return LlamaSequence(self.engine, seq, self.vocab_size)

    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """One ``llama_decode`` over every row (each on its own sequence); each row's last-token logits."""
        out = self.engine.decode([(row.lm.seq, row.lm.length, list(row.tokens)) for row in rows])
        results = []
        for row, last in zip(rows, out):
            row.lm.grew(len(row.tokens))
            results.append(RowOutput(row.lm.widen(last[None]), None))
        return results

    def can_batch(self) -> bool:
        return True

    def describe(self) -> str:
        return f"llama.cpp ({self.engine.n_ctx} positions for {len(self.engine._free)} free sequences)"


class GGUFDraftSession(LMDraftSession):
    """An assistant-style session on a llama.cpp sequence: the single chain, extended past a block in flight on the
    assumption it is accepted whole (no multi-outcome pre-draft rows: the torch types flatten them into one cache
    with a custom attention mask; here they would be copies of the sequence), batched across sessions."""

    @property
    def predrafts_rows(self) -> bool:  # type: ignore[override]
        return False

    def begin_speculation(self, block_len: int, max_rows: int | None = None) -> bool:
        self._block_end = len(self.committed) + block_len + 1
        self.outcomes = []
        return False

    def batch_step(self):
        return None if self.ended else self._chain_step()


class IdleDraftSession(DraftSession):
    """A session that drafts nothing (every llama.cpp sequence is in use): its request goes on with the target's
    own tokens, one per round."""

    def propose(self, n: int) -> int:
        return 0


class GGUFDrafter(Drafter):
    type_name = "gguf"
    tokenizer_hint = "the GGUF's vocabulary must be the target's, id for id (universal drafts across tokenizers)"

    def __init__(self, settings: DrafterConfig, own: Any = None, profile: ProfileSpec | None = None):
        self.path = gguf_path(settings.model)
        # The KV memory is one pool (kv_slots × kv_slot_tokens positions) shared by as many sequences as llama.cpp
        # allows (256): a session costs only the positions it holds, so sessions beyond kv_slots still draft.
        n_ctx = max(settings.kv_slot_tokens, 256) * kv_slots(settings.kv_slots, settings.max_batch_sessions)
        slots = int(import_llama_cpp().llama_max_parallel_sequences())
        threads = profile.threads[0] if profile and profile.threads else max(1, torch.get_num_threads())
        started = time.perf_counter()
        self.engine = LlamaEngine(self.path, n_ctx, slots, threads)
        log.info("loaded %s in llama.cpp in %.1f s (%d positions, %d sequences)", self.path.name,
                 time.perf_counter() - started, self.engine.n_ctx, slots)
        self.tokenizer_id = vocab_fingerprint(self.engine.token_texts())
        self.target_vocab_size = self.engine.n_vocab  # replaced by the verifier's at connect time
        self.backend = LlamaBackend(self.engine, self.engine.n_vocab)
        self.max_draft_tokens = settings.max_draft_tokens
        self.q_top_m = settings.q_top_k
        self.capabilities = Capabilities(sends_q=True, greedy_q=True)
        self._warned_full = False

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        self.backend.vocab_size = self.target_vocab_size
        try:
            return GGUFDraftSession(self.backend, token_ids, prompt_len, params, self.q_top_m,
                                    self.target_vocab_size, max_draft_tokens=self.max_draft_tokens)
        except LlamaDecodeError:
            if not self._warned_full:
                log.warning("every llama.cpp sequence is in use (%d sessions): further sessions are not drafted "
                            "for until one ends", self.engine.n_seq)
                self._warned_full = True
            return IdleDraftSession(token_ids, prompt_len, params)

    def measure_profile(self, spec: ProfileSpec, progress) -> NodeProfile | None:
        """The start-up cost curve of llama.cpp forwards over 1 .. max rows (tokens of one sequence, as the
        node's batched steps are rows of different sequences at about the same cost), at each planned thread count,
        checked for a quiet machine (a busy one is measured again at the next start); cached on disk like the torch
        types' profiles."""
        if spec.budget_s <= 0:
            return None
        st = self.path.stat()  # a file is not fingerprinted by the cache: its size and mtime, and the engine's build
        variant = f"llama.cpp {getattr(self.engine.lib, '__version__', '?')} {st.st_size} {st.st_mtime_ns}"
        threads = sorted(set(spec.threads))
        key = profile_key(str(self.path), "cpu", "gguf", threads, spec.sizes, variant=variant)
        cached = read_cached(key)
        if cached is not None and sorted(cached.curves) == threads:
            progress(f"profile of {self.path.name} in llama.cpp: cached")
            return cached
        started = time.perf_counter()
        curves, quiet = measure_quietly(None, spec.sizes, threads, spec.budget_s, "cpu", progress,
                                        measure=lambda: self._measure_curves(spec.sizes, threads, spec.budget_s))
        profile = NodeProfile(model=self.path.name, device="cpu", dtype="gguf", curves=curves,
                              measured_s=time.perf_counter() - started, quiet=quiet, key=key)
        for count, curve in curves.items():
            progress(f"profiled {self.path.name} in llama.cpp at {count} thread(s): "
                     + ", ".join(f"{k}: {s * 1000:.0f} ms" for k, s in zip(curve.sizes, curve.seconds)))
        write_cached(key, profile)
        return profile

    def _measure_curves(self, sizes: list[int], threads: list[int], budget_s: float) -> dict[int, CostCurve]:
        """Per thread count: the fastest of three forwards of n tokens on a 64-token cached prefix, for each n in
        ``sizes`` while the thread count's share of ``budget_s`` lasts (at least the smallest n)."""
        seq = self.engine.acquire()
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
                self.engine.crop(seq, 0)
                self.engine.decode([(seq, 0, rng.integers(0, self.engine.n_vocab, prefix).tolist())])
                t_start, points = time.perf_counter(), {}
                for n in sorted(sizes):
                    best = float("inf")
                    for _ in range(3):
                        ids = rng.integers(0, self.engine.n_vocab, n).tolist()
                        t0 = time.perf_counter()
                        self.engine.decode([(seq, prefix, ids)])
                        best = min(best, time.perf_counter() - t0)
                        self.engine.crop(seq, prefix)
                    points[n] = max(best, 1e-9)
                    if time.perf_counter() - t_start > budget:
                        break
                ks = sorted(points)
                curves[count] = CostCurve(ks, nondecreasing([points[k] for k in ks]), prefix)
        finally:
            torch.set_num_threads(previous)
            self.engine.release(seq)
        return curves


def build_info() -> str:
    """llama.cpp's description of its CPU build (the instruction sets it was compiled with)."""
    lib = import_llama_cpp()
    return lib.llama_print_system_info().decode(errors="replace").strip()


def _probe_forward(path: Path) -> None:
    """Load ``path`` and run one forward (what ``--check`` runs in a child process)."""
    engine = LlamaEngine(path, n_ctx=256, n_seq=1, threads=1)
    logits = engine.decode([(0, 0, [0, 1, 2, 3])])[0]
    engine.close()
    if not np.isfinite(logits).all():
        raise SystemExit("llama.cpp returned non-finite logits")
    print(f"forward ok ({path.name}, {logits.shape[0]} logits)")
    print(build_info())


def main(argv: list[str] | None = None) -> int:
    """``python -m drafter_node.gguf --check FILE.gguf``: probe llama.cpp on this machine in a child process."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m drafter_node.gguf", description=main.__doc__)
    parser.add_argument("--check", type=Path, metavar="GGUF", required=True, help="a GGUF file to run one forward of")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process:
        _probe_forward(args.check)
        return 0
    ok, message = run_probe([sys.executable, "-m", "drafter_node.gguf", "--in-process", "--check", str(args.check)])
    print(message, end="" if message.endswith("\n") else "\n", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

