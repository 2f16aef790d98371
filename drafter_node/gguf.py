"""``gguf`` drafter: a GGUF model run by llama.cpp (through llama-cpp-python) drafts for a target on torch.

On a CPU the drafter's forward is most of a round, and llama.cpp runs small models two to three times faster per
token than torch there; drafts are only proposals, so the target (and the exactness reference) stays on
transformers. Everything above the forward is the assistant's: :class:`~drafter_node.lm_drafter.LMDraftSession`
drafts the chain with the shared logits processing (greedy argmax with the second choice trees and pre-drafting
rank by, or a sample with its top-k q for lossless sampling), keeps the KV cache in step with the commits and
batches sessions. What this module adds is a llama.cpp stand-in for the torch model and its caches:

* :class:`~shared.llama_engine.LlamaEngine` (shared with the llama.cpp target backend) — one model and one
  llama.cpp context whose KV memory (one pool of ``kv_slots × kv_slot_tokens`` positions) holds up to 256
  sequences, each of at most ``drafter.gguf_sequence_tokens`` positions (default a quarter of the pool); a batched
  forward of many sessions is one ``llama_decode`` over their sequences;
* :class:`LlamaSequence` — one session's sequence, with the part of :class:`shared.kv.CachedLM`'s interface the
  session uses (``feed``, ``uncached``, ``crop``, ``length``, ...); cropping is ``llama_memory_seq_rm``;
* :class:`LlamaBackend` — the node's KV backend over the engine (``open`` a sequence, ``feed_rows`` batched).

Vocabulary: the drafter sends a fingerprint of its GGUF token list (:func:`shared.models.vocab_fingerprint`); the
verifier compares it with its tokenizer's, so a GGUF whose ids do not map onto the target's is refused at connect
with the reason (``universal`` covers different tokenizers).

The file is untrusted input (:mod:`shared.gguf_vet`): its SHA-256 where ``drafter.gguf_sha256`` pins it, its
header's bounds and a probe in a limited child process come before this process's llama.cpp reads it.

Threads follow the node's thread policy: before each forward the engine takes torch's current count (what the
node's ``ThreadShare`` sets) as llama.cpp's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from drafter_node.base import Capabilities, Drafter, DraftSession
from drafter_node.gguf_check import run_probe
from drafter_node.lm_drafter import LMDraftSession
from drafter_node.settings import DrafterConfig
from shared.backend import TargetBackend
from shared.batch import Row, RowOutput
from shared.costs.curve import NodeProfile
from shared.gguf_vet import vet_gguf
from shared.kv import SequenceCache
from shared.llama_engine import (  # noqa: F401 (re-exported: the engine lived here before shared/llama_engine.py)
    INSTALL_HINT,
    LlamaDecodeError,
    LlamaEngine,
    build_info,
    gguf_path,
    import_llama_cpp,
    llama_profile,
)
from shared.models import ModelLoadError, ProfileSpec, vocab_fingerprint
from shared.named_models import is_named_model
from shared.node_keys import kv_slots
from shared.sampling import GenerationParams

log = logging.getLogger("pipespec.drafter")

class LlamaSequence(SequenceCache):
    """One session's sequence in the engine's KV memory: the part of :class:`shared.kv.CachedLM` that
    :class:`~drafter_node.lm_drafter.LMDraftSession` uses (the shared bookkeeping of :class:`SequenceCache`, a
    ``feed`` through llama.cpp and a ``crop`` by ``llama_memory_seq_rm``). No ``capacity``: the drafter refuses a
    session that could outgrow the engine's per-sequence cap at open (it is not drafted for), and the engine fails
    a forward past it, as it fails one that does not fit the full memory."""

    recurrent = False
    batchable = True  # rows of one llama_decode with other sequences (LlamaBackend.feed_rows)

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


def sequence_cap(n_ctx: int, slot_tokens: int, configured: int | None) -> int:
    """The most positions one session may hold in a pool of ``n_ctx``: ``configured`` (``drafter.
    gguf_sequence_tokens``), else a quarter of the pool but at least one slot; never more than the pool."""
    cap = configured if configured is not None else max(slot_tokens, n_ctx // 4)
    return max(1, min(int(cap), n_ctx))


class GGUFDrafter(Drafter):
    type_name = "gguf"
    tokenizer_hint = "the GGUF's vocabulary must be the target's, id for id (universal drafts across tokenizers)"

    def __init__(self, settings: DrafterConfig, own: Any = None, profile: ProfileSpec | None = None):
        self.path = gguf_path(settings.model)
        # The file is untrusted input: its hash (where pinned), its header's bounds and a probe in a limited child
        # process come before this process's llama.cpp reads it (shared/gguf_vet.py); a named model's GGUF, whose
        # SHA-256 is pinned in code and checked when installed, skips the probe (seconds at each start)
        try:
            vet_gguf(self.path, sha256=getattr(own, "gguf_sha256", None), probe=not is_named_model(settings.model))
        except ValueError as exc:
            raise ModelLoadError(f"drafter.model: {exc}") from None
        # The KV memory is one pool (kv_slots × kv_slot_tokens positions) shared by as many sequences as llama.cpp
        # allows (256): a session costs only the positions it holds, so sessions beyond kv_slots still draft; one
        # session holds at most seq_cap of them, so one long prompt cannot take the pool from every other.
        n_ctx = max(settings.kv_slot_tokens, 256) * kv_slots(settings.kv_slots, settings.max_batch_sessions)
        self.seq_cap = sequence_cap(n_ctx, settings.kv_slot_tokens, getattr(own, "gguf_sequence_tokens", None))
        slots = int(import_llama_cpp().llama_max_parallel_sequences())
        threads = profile.threads[0] if profile and profile.threads else max(1, torch.get_num_threads())
        started = time.perf_counter()
        self.engine = LlamaEngine(self.path, n_ctx, slots, threads, max_seq_tokens=self.seq_cap)
        log.info("loaded %s in llama.cpp in %.1f s (%d positions, %d sequences of at most %d)", self.path.name,
                 time.perf_counter() - started, self.engine.n_ctx, slots, self.seq_cap)
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
        need = len(token_ids) + params.max_new_tokens + self.max_draft_tokens + 2  # the chain runs a block ahead
        if need > self.seq_cap:
            log.info("a session of up to %d positions is over the %d one llama.cpp sequence may hold: it is not "
                     "drafted for", need, self.seq_cap)
            return IdleDraftSession(token_ids, prompt_len, params)
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
        """The start-up cost curve of llama.cpp forwards (:func:`shared.llama_engine.llama_profile`)."""
        return llama_profile(self.engine, spec, progress)


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

