"""Log probabilities of the committed tokens, computed where acceptance happens, and the byte form of each token.

What the numbers are: at each committed position, ``log_softmax`` of the target's *processed* scores there — the
request's processors (repetition penalty, min new tokens), the grammar's mask and, when sampling, the warpers
(temperature, top-k, top-p): exactly the row the verifier's acceptance rule samples or argmaxes from
(:func:`shared.sampling.process_block` / :func:`verifier_node.tree.process_tree`), the same as ``log_softmax`` of
transformers' ``generate(..., output_scores=True).scores[i]`` with the same settings. Whether the token was a draft
the target accepted, its correction or its bonus token makes no difference: every committed token is scored under
the target's row that chose or confirmed it. (With ensemble verification, which is lossy, the numbers are still the
target's own p, not the mixture the rule used.)

Alternatives: the N most likely tokens of that row, best first; tokens the row excludes (``-inf``: top-k, top-p, a
grammar) are left out, so a list may be shorter than N. The committed token itself is always finite (the rule never
picks an excluded token).

Token text: the HTTP server has no tokenizer, so the verifier sends each token's raw bytes (:class:`TokenPieces`):
for byte-level BPE (GPT-2, Llama 3, Qwen) the token string mapped back through the byte-to-unicode table, so a token
holding part of a UTF-8 character gives exactly those bytes; SentencePiece byte-fallback tokens (``<0xE2>``) their
one byte; other SentencePiece pieces with ``▁`` as a space; special tokens their name (flagged ``special``: they add
nothing to the request's text); anything else the tokenizer's decode of the token alone.
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import torch

from shared.protocol import MAX_HEADER_BYTES, Done, TokenLogprob, encode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: The log probability sent for a committed token its row excludes (only lossy ensemble verification commits one).
FLOAT32_LOWEST = float(torch.finfo(torch.float32).min)


class RawLogprob(NamedTuple):
    """One committed token's numbers before the verifier adds the token text."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def committed_logprobs(scores: torch.Tensor, rows: list[int], tokens: list[int], top_n: int) -> list[RawLogprob]:
    """``tokens[i]`` scored under ``scores[rows[i]]`` (processed float32 scores, one row per fed position), with the
    ``top_n`` most likely alternatives of that row (``-inf`` ones dropped)."""
    if not tokens:
        return []
    device = scores.device  # the target's (a GPU's): index tensors go there, the results come back once
    picked = torch.log_softmax(scores[torch.tensor(rows[: len(tokens)], dtype=torch.long, device=device)].float(),
                               dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
    chosen = picked.gather(1, ids).squeeze(1).tolist()
    if top_n:
        top = torch.topk(picked, min(top_n, picked.shape[-1]), dim=-1)
        top_values, top_indices = top.values.tolist(), top.indices.tolist()
    else:
        top_values = top_indices = [[] for _ in tokens]
    out = []
    for token, value, values, top_ids in zip(tokens, chosen, top_values, top_indices):
        keep = [(i, v) for i, v in zip(top_ids, values) if v != -math.inf]
        # min(…, 0): a log probability is never above 0 (the wire checks it), whatever the float rounding. The
        # lossless rules never commit an excluded token; greedy ensemble verification (argmax of w·p + (1 − w)·q)
        # can, and its -inf, which the wire and JSON cannot carry, becomes float32's lowest value.
        value = min(value, 0.0) if math.isfinite(value) else FLOAT32_LOWEST
        out.append(RawLogprob(token, value, [i for i, _ in keep], [min(v, 0.0) for _, v in keep]))
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted (the alphabet byte-level BPE writes its tokens in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()


class TokenPieces:
    """Each token id's raw bytes and whether it is special, for one tokenizer (cached: a vocabulary's worth at most)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel" or hasattr(tokenizer, "byte_decoder")
        self.piece = functools.lru_cache(maxsize=1 << 17)(self._piece)

    def _piece(self, token: int) -> tuple[bytes, bool]:
        tok = self.tokenizer
        name = tok.convert_ids_to_tokens(token) if hasattr(tok, "convert_ids_to_tokens") else None
        if token in self.special and isinstance(name, str):
            return name.encode("utf-8"), True
        if isinstance(name, str):
            if self.byte_level and all(c in BYTE_DECODER for c in name):
                return bytes(BYTE_DECODER[c] for c in name), False
            match = _BYTE_TOKEN.fullmatch(name)
            if match:
                return bytes([int(match.group(1), 16)]), False
            if "\u2581" in name:  # SentencePiece's word boundary
                return name.replace("\u2581", " ").encode("utf-8"), False
        return tok.decode([token]).encode("utf-8"), False


def to_wire(raw: list[RawLogprob], pieces: TokenPieces) -> list[TokenLogprob]:
    """The wire form: numbers and each token's (and alternative's) bytes."""
    out = []
    for r in raw:
        piece, special = pieces.piece(r.token)
        out.append(TokenLogprob(logprob=r.logprob, piece=piece, special=special, top_ids=r.top_ids,
                                top_logprobs=r.top_logprobs, top_pieces=[pieces.piece(i)[0] for i in r.top_ids]))
    return out


def done_frames(done: Done) -> list:
    """``done`` encoded; its ``logprobs`` left out where they would take the header past the wire's cap (a long
    output with many alternatives: about 3,000 tokens at 20). The chunks carried every token's already, and the
    client then builds the result's from them (:mod:`runtime.client`)."""
    frames = encode(done)
    if done.logprobs is not None and len(frames[0]) > MAX_HEADER_BYTES:
        done.logprobs = None
        frames = encode(done)
    return frames
