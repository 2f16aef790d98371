"""The client's form of per-token log probabilities (``generate(..., logprobs=N)``): one :class:`TokenLogprob` per
committed token, built from the verifier's wire entries (:class:`shared.protocol.TokenLogprob`).

The numbers are ``log_softmax`` of the target's processed scores at each position — the distribution the verifier
samples or argmaxes from (see :mod:`verifier_node.logprobs` and docs/client.md, "Log probabilities").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import TokenLogprob as WireLogprob


def _text(piece: bytes) -> str:
    # a token holding part of a UTF-8 character has no text of its own: its bytes are kept in ``piece``
    return piece.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    id: int
    logprob: float
    piece: bytes  # the token's raw bytes

    @property
    def token(self) -> str:
        """The token's text (U+FFFD for an incomplete UTF-8 character: ``piece`` has the exact bytes)."""
        return _text(self.piece)


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token: its id, its log probability, its raw bytes and the most likely tokens there, best first
    (at most the ``logprobs=N`` asked; tokens the processed distribution excludes are left out)."""

    id: int
    logprob: float
    piece: bytes = b""
    special: bool = False  # a special token (end of sequence…): its text is its name and adds nothing to the text
    top: list[TopLogprob] = field(default_factory=list)

    @property
    def token(self) -> str:
        """The token's text (U+FFFD for an incomplete UTF-8 character: ``piece`` has the exact bytes)."""
        return _text(self.piece)


def from_wire(token_ids: list[int], entries: list[WireLogprob] | None) -> list[TokenLogprob] | None:
    """A chunk's or result's entries (None: the request did not ask)."""
    if entries is None:
        return None
    return [TokenLogprob(token, e.logprob, e.piece, e.special,
                         [TopLogprob(i, v, p) for i, v, p in zip(e.top_ids, e.top_logprobs, e.top_pieces)])
            for token, e in zip(token_ids, entries)]
