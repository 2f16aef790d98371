"""``universal`` drafter (universal assisted decoding): any small causal LM with its own tokenizer drafts for a
target with a different one.

The drafter holds its model, its own tokenizer and the target's tokenizer (only the tokenizer files). Its context is
its own tokenisation of the text of ``committed + chain`` (target ids decoded to text, re-encoded with the drafter's
tokenizer); after a commit that changes that text, the context is re-tokenised and the drafter's KV cache is cropped
to the longest common prefix of the old and new drafter ids, so only the changed tail is fed again.

* **Greedy**: the drafter drafts its own tokens (argmax), decodes them to text, and re-encodes that text with the
  target tokenizer together with a look-behind window of the last few target tokens, so merges at the boundary come
  out as the target would make them. Only target ids that cleanly extend the sequence are kept (the window must
  re-encode to itself), and the text's last pre-tokeniser piece is held back until more text settles its split.
  Greedy drafts carry no q (one-hot): verification is by argmax, exact whatever is drafted.
* **Sampling**: a 1:1 vocabulary map pairs draft and target tokens with identical byte strings. The drafter's logits
  are moved onto the target vocabulary (tokens without a counterpart get -inf, so q = 0), processed with the shared
  logits processing in target space, and one token is drawn with the shared ``choose``; the sparse q sent is exactly
  the distribution it was drawn from, one draft token per target id, so the acceptance rule stays exact.

Nothing assumes one vocabulary is larger than the other: the map is an intersection, empty in the worst case (then
sampled requests get no drafts and the verifier steps on its own).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

from drafter_node.base import Capabilities, Drafter, DraftSession, DraftToken
from drafter_node.lm_drafter import choose, drafter_backend, predraft_room, with_room
from drafter_node.settings import DrafterConfig
from shared.models import ProfileSpec, load_causal_lm, load_tokenizer, resolve_model, tokenizer_id
from shared.sampling import GenerationParams, process_logits
from shared.target import SequenceHandle, TargetBackend

log = logging.getLogger("pipespec.drafter")

#: Target tokens of look-behind when re-encoding drafted text (so BPE merges at the boundary are the target's).
TARGET_LOOK_BEHIND = 4
#: Drafter tokens of look-behind when decoding a new drafter token (SentencePiece-style leading spaces).
DRAFT_LOOK_BEHIND = 4
#: Target tokens before a change where re-tokenising the drafter's context starts (then up to as many further back).
RESYNC_LOOK_BEHIND = 8
#: Drafter forwards one ``propose`` call may run without producing a target token (a long word in progress).
MAX_FORWARDS_PER_CALL = 16


# ------------------------------------------------------------------------------------------ vocabulary map


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in str(backend.decoder)


def token_keys(tokenizer) -> dict[int, bytes]:
    """Each token id → the exact bytes it stands for (special tokens → a marked copy of their text), so tokens of
    two different tokenizers can be compared. Keys held by more than one id are left out (not 1:1)."""
    byte_level = _is_byte_level(tokenizer)
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    keys: dict[int, bytes] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            key = b"\x00special:" + token.encode()
        elif i in added:
            key = str(added[i]).encode()
        elif byte_level:
            try:
                key = bytes(_UNICODE_TO_BYTE[c] for c in token)
            except KeyError:
                key = token.encode()
        else:
            match = _BYTE_TOKEN.fullmatch(token)
            key = bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode()
        keys[i] = key
    count: dict[bytes, int] = {}
    for key in keys.values():
        count[key] = count.get(key, 0) + 1
    return {i: k for i, k in keys.items() if count[k] == 1 and k}


class VocabMap:
    """A 1:1 map between draft and target tokens that stand for the same bytes (the intersection of the two
    vocabularies; any sizes, either may be a subset of the other)."""

    def __init__(self, pairs: list[tuple[int, int]]):
        pairs = sorted(pairs)
        self.d2t = dict(pairs)
        self.t2d = {t: d for d, t in pairs}
        self.draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        self.target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)

    @classmethod
    def build(cls, draft_tokenizer, target_tokenizer) -> VocabMap:
        target_by_key = {k: i for i, k in token_keys(target_tokenizer).items()}
        pairs = [(d, target_by_key[k]) for d, k in token_keys(draft_tokenizer).items() if k in target_by_key]
        return cls(pairs)

    def __len__(self) -> int:
        return len(self.d2t)

    def limited(self, draft_vocab: int, target_vocab: int) -> VocabMap:
        """The pairs whose ids fit the drafter's logits and the target's vocabulary."""
        return VocabMap([(d, t) for d, t in self.d2t.items() if d < draft_vocab and t < target_vocab])

    def to_target(self, draft_logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """Draft logits placed on the target vocabulary; target tokens without a counterpart get -inf (q = 0)."""
        out = torch.full((target_vocab,), -torch.inf, dtype=torch.float32, device=draft_logits.device)
        out[self.target_ids.to(out.device)] = draft_logits.float()[self.draft_ids.to(out.device)]
        return out


# ------------------------------------------------------------------------------------------------- session


def stable_end(tokenizer, text: str) -> int:
    """Where the part of drafted ``text`` whose target tokenisation more text cannot change ends.

    BPE merges never cross the pre-tokeniser's splits, and appending text can only change the last piece (a word
    may grow; Qwen's pattern lets punctuation take the newlines after it; a whitespace run gives its last space to
    the next word), so the text before the last piece is settled. Uses the tokenizer's own pre-tokeniser; without
    one, the last whitespace-delimited word is held back.
    """
    pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre is not None:
        pieces = pre.pre_tokenize_str(text)
        return pieces[-1][1][0] if pieces else 0
    i = len(text)
    if text[-1:].isspace():
        while i and text[i - 1].isspace():
            i -= 1
        return i
    while i and not text[i - 1].isspace():
        i -= 1
    return max(i - 1, 0)


def _suffix_text(decode, ids: list[int], start: int) -> str | None:
    """The text ``ids[start:]`` adds after ``ids[:start]`` (decoded with a look-behind, so leading spaces and merged
    characters come out right); None when the boundary splits a character."""
    lb = max(0, start - 4)
    before, full = decode(ids[lb:start]), decode(ids[lb:])
    if not full.startswith(before) or "\ufffd" in full[len(before) :]:
        return None
    return full[len(before) :]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def draft_bias(logit_bias: dict[str, float], t2d: dict[int, int]) -> dict[str, float]:
    """A request's logit_bias (target ids) in the drafter's vocabulary: the ids with a counterpart, moved onto it
    (two target ids on one drafter id: the first one's bias)."""
    out: dict[str, float] = {}
    for key, value in logit_bias.items():
        d = t2d.get(int(key))
        if d is not None:
            out.setdefault(str(d), value)
    return out


class UniversalSession(DraftSession):
    """Drafting for one request across two tokenizers."""

    def __init__(self, drafter: UniversalDrafter, token_ids: list[int], prompt_len: int, params: GenerationParams):
        super().__init__(token_ids, prompt_len, params)
        self.u = drafter
        # Its own tokenizer's context may be longer than the target's ids: a slot that fills up moves the session
        # onto a dynamic cache (lm_drafter.with_room).
        self.backend: TargetBackend = drafter.backend
        self.lm: SequenceHandle = self.backend.open(len(token_ids) + params.max_new_tokens + predraft_room(
            getattr(drafter, "max_draft_tokens", 16)))
        self.vocab = drafter.vocab.limited(drafter.draft_vocab_size, drafter.target_vocab_size)
        self.d_ids: list[int] = []  # drafter context: its tokens for text(committed + chain) + self.pending
        self.t_ctx: list[int] = []  # the target ids whose text the drafter context holds (committed + chain)
        self.pending = ""  # drafted text not yet turned into chain tokens (greedy)
        self.decoded_upto = 0  # d_ids before this index have their text in self.pending (or in the chain)
        self.dirty = True  # committed + chain changed under the drafter's context: re-tokenise before drafting
        self.stuck = False  # no clean continuation: wait for the next commit
        # Greedy drafting runs in the drafter's vocabulary: end tokens and logit_bias ids translated where they have
        # a counterpart (a target id is never applied to the drafter's row as it is: there it names another token).
        # Presence / frequency penalties count the drafter's own tokens, its last len(generated) of them: an
        # approximation of the generated text (drafts are guesses; the verifier applies the exact penalties).
        self.draft_params = dataclasses.replace(
            params,
            eos_token_ids=[self.vocab.t2d[t] for t in params.eos_token_ids if t in self.vocab.t2d],
            stop_token_ids=[self.vocab.t2d[t] for t in params.stop_token_ids if t in self.vocab.t2d],
            logit_bias=draft_bias(params.logit_bias, self.vocab.t2d),
        )

    # ---------------------------------------------------------------- text ↔ ids
    def _target_text(self, ids: list[int]) -> str:
        return self.u.target_tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _draft_text(self, ids: list[int]) -> str:
        return self.u.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def sync(self) -> None:
        """Re-tokenise text(committed + chain) for the drafter; keep the cache's longest common prefix.

        Only the tail after the change is re-tokenised (from a few target tokens before it, at a point where the
        drafter's old tokens end exactly on a target token boundary), so the work does not grow with the length;
        when no such point is found, the whole text is re-tokenised."""
        target_ids = self.committed + self.chain_tokens
        ids = self._retokenise_tail(target_ids) if self.d_ids else None
        if ids is None:
            ids = self.u.encode_draft(self._target_text(target_ids))
        self.lm.crop(min(self.lm.length, _common_prefix(ids, self.d_ids), max(len(ids) - 1, 0)))
        self.d_ids = ids
        self.t_ctx = target_ids
        self.pending = ""
        self.decoded_upto = len(ids)
        self.dirty = False
        self.stuck = False

    def _retokenise_tail(self, target_ids: list[int]) -> list[int] | None:
        """The drafter context for ``target_ids`` built from the current one by re-encoding only its tail."""
        old = self.t_ctx
        changed = _common_prefix(old, target_ids)
        view = self.d_ids[: self.decoded_upto]  # its text is text(old) + self.pending
        for a in range(changed - RESYNC_LOOK_BEHIND, max(changed - 2 * RESYNC_LOOK_BEHIND, 0), -1):
            old_tail = _suffix_text(self._target_text, old, a)
            new_tail = _suffix_text(self._target_text, target_ids, a)
            if old_tail is None or new_tail is None:
                continue
            old_tail += self.pending
            for j in range(len(view) - 1, max(len(view) - 4 * len(old_tail) - 8, 0), -1):
                tail = _suffix_text(self._draft_text, view, j)
                if tail is None or len(tail) < len(old_tail):
                    continue
                if tail == old_tail:
                    return view[:j] + self.u.tokenizer(new_tail, add_special_tokens=False)["input_ids"]
                break  # a drafter token straddles this target boundary: try one further back
        return None

    # ---------------------------------------------------------------- drafting
    def propose(self, n: int) -> int:
        if self.dirty:
            self.sync()
        if self.ended or self.stuck:
            return 0
        if not self.d_ids or len(self.d_ids) >= self.u.max_positions:
            self.stuck = True  # nothing to condition on, or past the drafter's context: the verifier goes alone
            return 0
        added = forwards = 0
        while added < n and forwards < MAX_FORWARDS_PER_CALL and not self.ended and not self.stuck:
            if self.lm.capacity is not None:  # a KV slot: room for what next_logits feeds?
                self.lm = with_room(self.lm, max(1, len(self.d_ids) - self.lm.length), self.backend)
            logits = self.lm.next_logits(self.d_ids)[: self.u.draft_vocab_size]
            forwards += 1
            added += self._sample_step(logits) if self.params.do_sample else self._greedy_step(logits)
        return added

    def _sample_step(self, logits: torch.Tensor) -> int:
        """One target token drawn from q = the drafter's distribution moved onto the target vocabulary."""
        ids = self.committed + self.chain_tokens
        if not len(self.vocab):
            self.stuck = True
            return 0
        scores = process_logits(self.vocab.to_target(logits, self.u.target_vocab_size), torch.tensor(ids),
                                self.params, len(ids) - self.prompt_len)
        if not torch.isfinite(scores).any():
            self.stuck = True  # every mapped token excluded (e.g. min_new_tokens on a tiny map)
            return 0
        token = choose(scores, self.params, len(ids), self.u.q_top_m)
        self.chain.append(token)
        self.t_ctx.append(token.token)
        self.d_ids.append(self.vocab.t2d[token.token])
        self.decoded_upto = len(self.d_ids)
        return 1

    def _greedy_step(self, logits: torch.Tensor) -> int:
        """One drafter token (argmax in its own vocabulary); returns the target tokens it completed."""
        ids = self.committed + self.chain_tokens
        scores = process_logits(logits, torch.tensor(self.d_ids), self.draft_params, len(ids) - self.prompt_len)
        g = choose(scores, self.draft_params, len(self.d_ids), 0).token
        self.d_ids.append(g)
        if g in self.u.draft_special_ids:
            # A special token (end of turn, ...) is no text to re-encode: flush the text before it, then send its
            # counterpart if the target has one; otherwise stop here.
            added = self._convert(final=True)
            target = self.vocab.d2t.get(g)
            if target is None or self.stuck or self.pending:
                self.stuck = True
                return added
            self.chain.append(DraftToken(target))
            self.t_ctx.append(target)
            self.decoded_upto = len(self.d_ids)
            return added + 1
        start = max(0, self.decoded_upto - DRAFT_LOOK_BEHIND)
        before = self._draft_text(self.d_ids[start : self.decoded_upto])
        full = self._draft_text(self.d_ids[start:])
        if full.endswith("\ufffd") or not full.startswith(before):
            if len(self.d_ids) - self.decoded_upto > MAX_FORWARDS_PER_CALL:
                self.stuck = True  # never completes a character: give up until the next commit
            return 0  # half a character so far
        self.pending += full[len(before) :]
        self.decoded_upto = len(self.d_ids)
        return self._convert(final=False)

    def _convert(self, final: bool) -> int:
        """Move the pending text into the chain as target ids that cleanly extend committed + chain.

        The text is re-encoded after a look-behind window of the last target tokens; the window must come out as
        itself (else the new text would change tokens already there: no clean extension). Unless ``final``, the
        text's unstable end is held back (see :func:`stable_end`): more text may still change how it splits."""
        text = self.pending if final else self.pending[: stable_end(self.u.target_tokenizer, self.pending)]
        if not text:
            return 0
        ids = self.committed + self.chain_tokens
        for w in range(min(TARGET_LOOK_BEHIND, len(ids)), 0, -1):
            window = ids[-w:]
            window_text = self._target_text(window)
            encoded = self.u.encode_target(window_text + text)
            if encoded[:w] == window:
                break
        else:
            self.stuck = True
            return 0
        new = encoded[w:]
        if (not new or self._target_text(window + new) != window_text + text
                or any(t >= self.u.target_vocab_size for t in new)):
            self.stuck = True  # the ids do not decode back to the drafted text: send nothing doubtful
            return 0
        self.pending = self.pending[len(text) :]
        self.chain.extend(DraftToken(t) for t in new)
        self.t_ctx.extend(new)
        return len(new)

    # ---------------------------------------------------------------- commits and rollback
    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        matched = super().observe_commit(tokens, extras)
        if self.stuck:
            self.dirty = True  # new committed text may allow a clean continuation now
        return matched

    def _truncate(self, length: int) -> None:
        self.dirty = True  # the text changed: re-tokenise (the cache keeps the common prefix)

    def close(self) -> None:
        """The request ended: its KV memory goes back to the drafter's backend."""
        self.lm.close()


# ------------------------------------------------------------------------------------------------- drafter


class UniversalDrafter(Drafter):
    type_name = "universal"

    def __init__(self, settings: DrafterConfig, own: None = None, profile: ProfileSpec | None = None):
        if not settings.model:
            raise ValueError("drafter.model: the universal drafter needs its own small model")
        if not settings.target_model:
            raise ValueError("drafter.target_model: the universal drafter needs the target's tokenizer")
        path = resolve_model(settings.model)
        self.tokenizer = load_tokenizer(path)
        self.target_tokenizer = load_tokenizer(resolve_model(settings.target_model))  # only the tokenizer files
        # The ids this drafter sends are the target tokenizer's: announce its fingerprint, so a verifier whose
        # target has another tokenizer (a drafter configured for a different target) refuses it.
        self.tokenizer_id = tokenizer_id(self.target_tokenizer)
        self.tokenizer_hint = (
            f" (the universal drafter translates to the tokenizer of drafter.target_model = "
            f"{settings.target_model!r}, default verifier.model: point it at the verifier's target)"
        )
        self.model = load_causal_lm(path, settings.device, settings.dtype, settings.max_memory,
                                    profile=profile)
        self.draft_vocab_size = min(len(self.tokenizer), int(self.model.get_output_embeddings().weight.shape[0]))
        self.draft_special_ids = set(self.tokenizer.all_special_ids) | {
            i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        self.vocab = VocabMap.build(self.tokenizer, self.target_tokenizer)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", None) or 1 << 62)
        # Where the sessions' KV caches live (drafter.backend); a compiled one builds steps at the node's threads.
        self.backend = drafter_backend(self.model, settings, profile.threads if profile else None)
        self.max_draft_tokens = settings.max_draft_tokens
        self.q_top_m = settings.q_top_k
        self.capabilities = Capabilities(sends_q=True)  # sampled drafts carry q; greedy drafts are one-hot
        self.target_vocab_size = len(self.target_tokenizer)  # replaced by the verifier's at connect time
        bos = self.tokenizer.bos_token_id
        self.draft_bos = bos if bos is not None and self.tokenizer("a")["input_ids"][:1] == [bos] else None
        log.info("universal drafter: %d of %d draft tokens map 1:1 onto the target's %d", len(self.vocab),
                 self.draft_vocab_size, self.target_vocab_size)

    def encode_draft(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.draft_bos is not None and ids[:1] != [self.draft_bos]:
            ids = [self.draft_bos, *ids]
        return ids

    def encode_target(self, text: str) -> list[int]:
        return self.target_tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def profile_model(self):
        return self.model

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        return UniversalSession(self, token_ids, prompt_len, params)
