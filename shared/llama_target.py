"""``verifier.backend: llama_cpp``: the target is a GGUF model run by llama.cpp (through llama-cpp-python).

The whole backend is this module (plus its line in :data:`shared.target.BACKEND_MODULES`):

* :class:`LlamaHandle` — one session's sequence in the engine's KV memory (a llama.cpp sequence id); a crop is
  ``llama_memory_seq_rm``; it is ``batchable`` and takes ``trees``.
* :class:`LlamaTargetBackend` — sessions' rows verified in one ``llama_decode`` (one sequence id per session),
  admission's budget from the KV pool (``capacity_tokens``), token trees and keeping a tree path.
* :func:`load_llama_target` — ``verifier.model`` (a named model's GGUF or a ``.gguf`` path) loaded into a
  :class:`~shared.llama_engine.LlamaEngine`, its tokenizer (:func:`gguf_tokenizer`), end tokens and cost profile.
* its config-time checks live in :mod:`shared.llama_target_check` (light: the config loader imports it).

Token trees, the way llama.cpp's speculative example verifies one: llama.cpp has no attention mask of its own; a
token attends to the cached cells of its (first) sequence id at positions up to its own. So a tree round gives every
leaf a sequence: the session's own id for the first leaf, a borrowed id for each other one (tagged onto the held
prefix with ``llama_memory_seq_cp``, which copies nothing in the unified KV memory); each token carries the ids of
the leaves below it and sits at position ``length + depth``. A token then sees exactly the held prefix and its own
ancestors, as the torch backends' 4D mask says. Keeping the accepted path is sequence bookkeeping: the session's id
takes the cells of a leaf below the last accepted node (``seq_rm`` + ``seq_cp``), the borrowed ids are dropped
(``seq_rm``) and given back. Nothing moves: positions are part of the cached keys (RoPE), and a path's positions are
already ``length, length + 1, …``.

Exactness: greedy output equals llama.cpp's own one-token-at-a-time greedy decoding of the same GGUF except where
the two part on a near-tie (batched and one-token forwards sum in different orders; :mod:`testkit.llama_reference`
tells such a step by its logit margin), docs/backends.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.gguf_vet import vet_gguf
from shared.kv import SequenceCache
from shared.llama_engine import (
    LlamaDecodeError,
    LlamaEngine,
    Token,
    gguf_path,
    gpu_offload_problem,
    import_llama_cpp,
    llama_profile,
)
from shared.llama_target_check import NAME
from shared.models import ModelLoadError, vocab_fingerprint, vocab_prefix_matches, vocab_tokens
from shared.named_models import is_named_model
from shared.target import (
    KVRowsError,
    Row,
    RowOutput,
    SequenceHandle,
    Target,
    TargetBackend,
    TargetOptions,
    register_target_backend,
)

log = logging.getLogger("pipespec.llama")



@dataclass
class _Tree:
    """A tree forward's tokens held on top of ``base`` positions: each token's parent (-1: a root), the sequence
    ids it carries (its first: a leaf below it), and the borrowed ids to give back."""

    base: int
    parents: list[int]
    seqs: list[list[int]]
    borrowed: list[int] = field(default_factory=list)


class LlamaHandle(SequenceCache):
    """One sequence of the target in llama.cpp's KV memory (a :class:`~shared.target.SequenceHandle`). The length,
    the counters, ``uncached`` / ``next_logits`` and ``grew`` are :class:`~shared.kv.SequenceCache`'s; no
    ``capacity``: the pool is shared, so a full one fails the forward instead. Handles of one engine share forwards
    (``batch_key``: the engine)."""

    recurrent = False
    batchable = True
    trees = True

    def __init__(self, backend: LlamaTargetBackend, seq: int):
        super().__init__(backend.engine)
        self.backend = backend
        self.engine = backend.engine
        self.seq: int | None = seq
        self.tree: _Tree | None = None

    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids``; float32 logits ``[T, vocab]`` (``last_logits_only``: ``[1, vocab]``)."""
        if want_hidden:
            raise ValueError("the llama_cpp backend gives no hidden states")
        out = self.backend.forward([Row(self, list(token_ids))], "last" if last_logits_only else "all")[0].logits
        return out, None

    def crop(self, keep: int) -> None:
        """Hold only the first ``keep`` positions (after a tree forward: they must be a path from its root)."""
        if self.tree is not None:
            self._keep_tree(list(range(max(0, keep - self.tree.base))), min(keep, self.tree.base))
        elif keep < self.length:
            self.engine.crop(self._seq(), keep)
            self.length = keep

    def restore(self, keep: int) -> None:
        self._give_back_branches()
        self.engine.crop(self._seq(), keep)
        self.length = keep

    def keep_positions(self, prefix: int, positions: list[int]) -> None:
        """Keep the first ``prefix`` positions and then the held ``positions``; they must be a path of the last tree
        forward (or follow ``prefix`` directly): llama.cpp's cached keys carry their positions, so nothing moves."""
        if positions != sorted(positions) or any(p < prefix or p >= self.length for p in positions):
            raise ValueError(f"cannot keep positions {positions} after {prefix} of {self.length} held")
        tree = self.tree
        if tree is None or prefix < tree.base:
            if positions != list(range(prefix, prefix + len(positions))):
                raise ValueError("llama.cpp keeps only a path of the last tree forward (its keys hold positions)")
            self.crop(prefix + len(positions))
            return
        kept = list(range(prefix - tree.base)) + [p - tree.base for p in positions]
        self._keep_tree(kept, tree.base)

    def _keep_tree(self, kept: list[int], base_keep: int) -> None:
        """Keep tree tokens ``kept`` (a path from a root, in order) after the held prefix (cropped to
        ``base_keep`` when nothing of the tree is kept)."""
        tree, seq = self.tree, self._seq()
        assert tree is not None
        for i, t in enumerate(kept):
            if t >= len(tree.parents) or tree.parents[t] != (kept[i - 1] if i else -1):
                raise ValueError(f"tree tokens {kept} are not a path from the root of the last tree forward")
        if kept:
            leaf_seq = tree.seqs[kept[-1]][0]  # a leaf below the last kept token: its sequence holds the path
            end = tree.base + len(kept)
            if leaf_seq != seq:
                self.engine.crop(seq, tree.base)
                self.engine.copy(leaf_seq, seq, tree.base, end)
            self.engine.crop(seq, end)
        else:
            end = base_keep
            self.engine.crop(seq, end)
        self._give_back_branches()
        self.length = end

    def _give_back_branches(self) -> None:
        if self.tree is not None:
            for borrowed in self.tree.borrowed:
                self.engine.release(borrowed)
            self.tree = None

    def _seq(self) -> int:
        if self.seq is None:
            raise ValueError("the sequence was closed")
        return self.seq

    def close(self) -> None:
        if self.seq is not None:
            self._give_back_branches()
            self.backend.release(self.seq)
            self.seq = None

    def check_kv_layers(self, layers: list[int]) -> None:
        self.backend.check_kv_layers(layers)

    def new_rows(self, layers: list[int], fed: int, kept: int) -> dict[str, torch.Tensor]:
        raise KVRowsError("the llama_cpp backend gives no K/V rows")

    def held_rows(self, layers: list[int]) -> dict[str, torch.Tensor]:
        raise KVRowsError("the llama_cpp backend gives no K/V rows")


def tree_of(row: Row) -> tuple[list[int], list[int]]:
    """A row's tokens as a forest over the held prefix: (each token's parent, -1 for a root; its position). Raises
    ValueError for a visibility llama.cpp's sequences cannot express (a token not seeing the whole prefix, or
    seeing other than its ancestors, or a position other than its depth's)."""
    length, count = row.lm.length, len(row.tokens)
    if row.visible is None:
        positions = row.positions or list(range(length, length + count))
        return list(range(-1, count - 1)), positions
    visible = row.visible
    if tuple(visible.shape) != (count, length + count) or not bool(visible[:, :length].all()):
        raise ValueError("llama.cpp tree rows must see the whole held prefix (visible: [T, length + T])")
    new = visible[:, length:].tolist()
    positions = row.positions or list(range(length, length + count))
    parents: list[int] = []
    for t, seen in enumerate(new):
        ancestors = [j for j in range(t) if seen[j]]
        parent = ancestors[-1] if ancestors else -1
        expected = new[parent][:t] if parent >= 0 else [False] * t
        if not seen[t] or any(seen[t + 1 :]) or seen[:t] != expected:
            raise ValueError(f"token {t} of a tree row must see itself and exactly its ancestors")
        if positions[t] != (positions[parent] + 1 if parent >= 0 else length):
            raise ValueError(f"token {t} of a tree row must sit at the held length plus its depth")
        parents.append(parent)
    return parents, positions


def _leaves_below(parents: list[int]) -> list[list[int]]:
    """Per token, the leaves of the forest below it (itself if it is one), first leaf first."""
    below: list[list[int]] = [[] for _ in parents]
    has_child = [False] * len(parents)
    for parent in parents:
        if parent >= 0:
            has_child[parent] = True
    for t in range(len(parents) - 1, -1, -1):
        if not has_child[t]:
            below[t] = [t]
        below[t].sort()
        if parents[t] >= 0:
            below[parents[t]].extend(below[t])
    return below


class LlamaTargetBackend(TargetBackend):
    """The target's KV memory in one llama.cpp context: ``capacity`` positions for every session together."""

    name = NAME

    def __init__(self, engine: LlamaEngine, capacity: int):
        super().__init__(engine)
        self.engine = engine
        self.capacity = capacity
        self.open_handles = 0

    @property
    def batch_key(self) -> Any:
        return self.engine

    def open(self, tokens: int | None = None) -> LlamaHandle:
        seq = self.engine.acquire()
        if seq is None:
            raise LlamaDecodeError(f"every llama.cpp sequence is in use ({self.engine.n_seq})")
        self.open_handles += 1
        return LlamaHandle(self, seq)

    def release(self, seq: int) -> None:
        self.engine.release(seq)
        self.open_handles -= 1

    def can_batch(self) -> bool:
        return True

    def capacity_tokens(self) -> int | None:
        return self.capacity

    def feed_tree(self, lm: SequenceHandle, tokens: list[int], positions: list[int], visible: torch.Tensor,
                  want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.feed_rows([Row(lm, tokens, positions, visible)], want_hidden)[0]
        return out.logits, None

    def keep_positions(self, lm: SequenceHandle, prefix: int, positions: list[int]) -> None:
        lm.keep_positions(prefix, positions)  # type: ignore[attr-defined]

    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """One ``llama_decode`` over every row (a chain, or a tree by its visibility: :func:`tree_of`); each row's
        logits ``[T, vocab]`` (``logits=False``: None, no LM head rows asked for)."""
        if want_hidden:
            raise ValueError("the llama_cpp backend gives no hidden states (a hidden-state drafter cannot use it)")
        return self.forward(rows, "all" if logits else "none")

    def forward(self, rows: list[Row], outputs: str) -> list[RowOutput]:
        """:meth:`feed_rows` with the logits llama.cpp computes: of every token (``all``), of each row's last
        (``last``: a prompt's forward needs no more) or none."""
        if any(not row.tokens for row in rows):
            raise ValueError("every row must feed at least one token")
        shapes = [tree_of(row) for row in rows]
        tokens: list[Token] = []
        borrowed: list[int] = []
        trees: list[_Tree] = []
        try:
            for row, (parents, positions) in zip(rows, shapes):
                tree = self._place(row, parents, positions, outputs, tokens)
                borrowed.extend(tree.borrowed)
                trees.append(tree)
            out = self.engine.decode_tokens(tokens, [(row.lm.seq, row.lm.length) for row in rows])
        except BaseException:
            for seq in borrowed:
                self.engine.release(seq)
            raise
        results, at = [], 0
        for row, tree in zip(rows, trees):
            count = len(row.tokens)
            row.lm.tree = tree if tree.borrowed or tree.parents != list(range(-1, count - 1)) else None
            row.lm.grew(count)
            if outputs != "none":
                wanted = count if outputs == "all" else 1
                results.append(RowOutput(torch.from_numpy(np.stack(out[at : at + wanted])), None))
                at += wanted
            else:
                results.append(RowOutput(None, None))
        return results

    def _place(self, row: Row, parents: list[int], positions: list[int], outputs: str,
               tokens: list[Token]) -> _Tree:
        """Append ``row``'s tokens to a forward's ``tokens``: each with the sequence ids of the leaves below it."""
        lm: LlamaHandle = row.lm  # type: ignore[assignment]
        seq = lm._seq()
        lm._give_back_branches()  # a tree left unkept: its borrowed ids are stale
        if any(not 0 <= t < self.engine.n_vocab for t in row.tokens):
            raise ValueError(f"a token id is past the GGUF's vocabulary ({self.engine.n_vocab} tokens)")
        below = _leaves_below(parents)
        leaves = [t for t in range(len(parents)) if below[t] == [t]]
        leaf_seq = {leaves[0]: seq}
        borrowed: list[int] = []
        for leaf in leaves[1:]:
            other = self.engine.acquire()
            if other is None:
                for b in borrowed:
                    self.engine.release(b)
                raise LlamaDecodeError(f"a tree of {len(leaves)} leaves needs more llama.cpp sequence ids than "
                                       f"are free ({self.engine.n_seq} in all)")
            self.engine.copy(seq, other, 0, lm.length)
            leaf_seq[leaf] = other
            borrowed.append(other)
        seqs = [[leaf_seq[leaf] for leaf in below[t]] for t in range(len(parents))]
        for t, token in enumerate(row.tokens):
            want = outputs == "all" or (outputs == "last" and t == len(row.tokens) - 1)
            tokens.append(Token(token, positions[t], seqs[t], want))
        return _Tree(lm.length, parents, seqs, borrowed)

    def check_kv_layers(self, layers: list[int]) -> None:
        if layers:
            raise KVRowsError("the llama_cpp backend gives no K/V rows (a drafter that reads them cannot use it)")

    def describe(self) -> str:
        where = f"{self.engine.n_gpu_layers} layers on the GPU" if self.engine.n_gpu_layers else "CPU"
        return (f"llama_cpp ({self.capacity} positions for every session together, {self.engine.n_seq} sequence "
                f"ids, {where})")


# ---------------------------------------------------------------------------------------------------- loading
def gguf_tokenizer(model: str, path: Path, token_texts: list[str]) -> Any:
    """The transformers tokenizer of a GGUF target (prompts, chat template, detokenizing): a named model's
    converted folder's, else the tokenizer files beside the GGUF (a GGUF kept in its model's folder), else the
    GGUF's own (``AutoTokenizer.from_pretrained(folder, gguf_file=…)``, which reads only some GGUF vocabularies).
    Its vocabulary must map onto the GGUF's token list id for id, else a ModelLoadError."""
    from shared.models import load_tokenizer
    from shared.named_models import installed_folder, is_named_model

    folder = installed_folder(model) if is_named_model(model) else None
    if folder is None and (path.parent / "tokenizer_config.json").is_file():
        folder = path.parent
    if folder is not None:
        tokenizer = load_tokenizer(str(folder))
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:  # transformers reads only some GGUF tokenizers
            raise ModelLoadError(f"transformers cannot read the tokenizer of {path} ({exc!r:.300}); put the model's "
                                 "tokenizer files (tokenizer.json, tokenizer_config.json) beside it") from None
    if not vocab_prefix_matches(vocab_fingerprint(token_texts), vocab_tokens(tokenizer)):
        where = folder or path
        raise ModelLoadError(f"the tokenizer of {where} does not map onto {path.name}'s token list id for id")
    return tokenizer


def _end_tokens(model: str, engine: LlamaEngine, tokenizer: Any) -> list[int]:
    """What generation stops on: a named model's generation config (as the torch target), else the GGUF's end of
    sequence and end of turn tokens and the tokenizer's end token."""
    from shared.named_models import installed_folder, is_named_model

    folder = installed_folder(model) if is_named_model(model) else None
    if folder is not None and (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(str(folder)).eos_token_id
        if eos is not None:
            return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
    lib, ends = engine.lib, []
    for token in (lib.llama_vocab_eos(engine.vocab), lib.llama_vocab_eot(engine.vocab), tokenizer.eos_token_id):
        if token is not None and 0 <= int(token) < engine.n_vocab and int(token) not in ends:
            ends.append(int(token))
    return ends


@register_target_backend(NAME)
def load_llama_target(verifier: Any, options: TargetOptions) -> Target:
    """The target of ``verifier.backend: llama_cpp``: ``verifier.model``'s GGUF in llama.cpp with a KV pool of
    ``kv_slots × kv_slot_tokens`` positions (plus a batch's headroom for a round's unaccepted tokens), on the CPU or
    with every layer offloaded to ``cuda``."""
    from shared.node_keys import kv_slots

    path = gguf_path(verifier.model, "verifier.model")
    try:  # untrusted input: the header's bounds and a probe in a limited child (a named model's pinned GGUF: none)
        vet_gguf(path, probe=not is_named_model(verifier.model))
    except ValueError as exc:
        raise ModelLoadError(f"verifier.model: {exc}") from None
    problem = gpu_offload_problem(verifier.device)
    if problem is not None:
        raise ModelLoadError(f"verifier.device: {problem}")
    slots = kv_slots(verifier.kv_slots, verifier.max_sessions, verifier.max_batch_sessions)
    capacity = slots * verifier.kv_slot_tokens
    lib = import_llama_cpp(f"verifier.backend {NAME}")
    threads = max(options.thread_counts or [torch.get_num_threads()])
    gpu = verifier.device.startswith("cuda")
    engine = LlamaEngine(path, capacity + verifier.max_batch_tokens, int(lib.llama_max_parallel_sequences()), threads,
                         n_gpu_layers=999 if gpu else 0, main_gpu=int(verifier.device.partition(":")[2] or 0))
    tokenizer = options.tokenizer or gguf_tokenizer(verifier.model, path, engine.token_texts())
    profile = None
    if options.profile is not None:
        profile = llama_profile(engine, options.profile, lambda line: log.info("verifier: %s", line),
                                device="cuda" if gpu else "cpu")
    log.info("target %s in llama.cpp (%s): %d positions, %d sequence ids", path.name, engine.file_type(),
             engine.n_ctx, engine.n_seq)
    return Target(backend=LlamaTargetBackend(engine, capacity), tokenizer=tokenizer,
                  end_token_ids=_end_tokens(verifier.model, engine, tokenizer), vocab_size=engine.n_vocab,
                  dtype=engine.file_type(), device=verifier.device, name=verifier.model,
                  max_positions=engine.n_ctx_train, profile=profile, kind="llama.cpp",
                  extras={"gguf": str(path)})
