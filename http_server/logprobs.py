"""OpenAI's log probabilities over HTTP: the request fields (chat ``logprobs`` + ``top_logprobs``, completions
``logprobs: N``), which tokens a response lists (those whose text is shown), and the two response shapes.

The numbers come from the verifier (:mod:`verifier_node.logprobs`): ``log_softmax`` of the target's processed scores
at each emitted token — the distribution it samples or argmaxes from. Token strings come from the verifier too,
as each token's raw bytes (this server has no tokenizer): ``bytes`` is exactly those bytes, ``token`` their UTF-8
text (U+FFFD where a token holds part of a character). Alternatives the processed distribution excludes (``-inf``:
top-k, top-p, a grammar) are left out of ``top_logprobs``: JSON has no ``-inf``.

Where each token begins in the text (``text_offset``, and which tokens a stop string leaves shown): the characters
the tokens before it complete, their bytes decoded as the tokenizer decodes them (UTF-8, an invalid byte as U+FFFD;
special tokens add nothing); a token that starts inside a character begins where that character does. Under a stop
string a response lists the tokens that begin inside the shown text, not those the stop string cut off; usage still
counts the whole verifier round the stop ended in (docs/http.md).
"""

from __future__ import annotations

import codecs
from collections import deque
from typing import Any

from http_server.errors import bad_request
from runtime.logprobs import TokenLogprob
from shared.sampling import MAX_TOP_LOGPROBS


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def requested(chat: bool, logprobs: Any, top_logprobs: Any) -> int | None:
    """The ``logprobs`` generation parameter a request asks for (None: off), or a 400 naming the field. Chat:
    ``logprobs`` true/false and ``top_logprobs`` 0..20 (only with ``logprobs: true``); completions: ``logprobs`` an
    integer 0..20 (OpenAI's legacy bound is 5; up to 20 accepted, as vLLM does), no ``top_logprobs``."""
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad_request(f"logprobs must be true or false, got {logprobs!r}", param="logprobs",
                              code="invalid_value")
        if top_logprobs is not None:
            if not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}",
                                  param="top_logprobs", code="invalid_value")
            if logprobs is not True:
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (top_logprobs or 0) if logprobs else None
    if top_logprobs is not None:
        raise bad_request("top_logprobs is a chat field: completions take logprobs: N", param="top_logprobs",
                          code="unsupported_parameter")
    if logprobs is None:
        return None
    if not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got "
                          f"{logprobs!r}", param="logprobs", code="invalid_value")
    return logprobs


class ShownLogprobs:
    """The tokens' entries in order, released as the text they begin in is shown (:meth:`shown`), each with its
    character offset in the generated text; :meth:`take` gives those released since the last take (a streamed
    chunk's), :attr:`released` all of them (a whole response's)."""

    def __init__(self) -> None:
        self._pending: deque[tuple[int, TokenLogprob]] = deque()  # (first character, entry)
        self._text = codecs.getincrementaldecoder("utf-8")("replace")  # holds back an unfinished character
        self._chars = 0  # characters the pieces so far complete
        self.released: list[tuple[TokenLogprob, int]] = []
        self._taken = 0

    def add(self, entries: list[TokenLogprob]) -> None:
        for e in entries:
            self._pending.append((self._chars, e))
            if not e.special:  # a special token's name is not in the text
                self._chars += len(self._text.decode(e.piece))

    def shown(self, shown_chars: int | None) -> None:
        """The text shown so far is ``shown_chars`` characters long (None: the whole generation is shown)."""
        pending = self._pending
        while pending and (shown_chars is None or pending[0][0] < shown_chars):
            chars, e = pending.popleft()
            self.released.append((e, chars))

    def take(self) -> list[tuple[TokenLogprob, int]]:
        out = self.released[self._taken:]
        self._taken = len(self.released)
        return out


def _bytes(piece: bytes) -> list[int]:
    return list(piece)


def chat_body(items: list[tuple[TokenLogprob, int]]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.piece),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.piece)}
                                          for t in e.top]} for e, _ in items],
            "refusal": None}


def completion_body(items: list[tuple[TokenLogprob, int]]) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs``: parallel lists, ``text_offset`` in characters of the
    generated text."""
    return {"tokens": [e.token for e, _ in items], "token_logprobs": [e.logprob for e, _ in items],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e, _ in items],
            "text_offset": [offset for _, offset in items]}


def body(chat: bool, items: list[tuple[TokenLogprob, int]] | None) -> dict[str, Any] | None:
    """The response's ``logprobs`` value: None where the request did not ask."""
    if items is None:
        return None
    return chat_body(items) if chat else completion_body(items)
