"""What the verifier sends its drafters over the drafter socket: frames to one drafter, a session's announcement
(``session_start``, with the prompt's state split into ``state`` messages where it does not fit one) and a commit's
state tensors (dropped, with an error in the log, where they would exceed the message cap)."""

from __future__ import annotations

import logging
import time

import torch
import zmq

from shared.protocol import SessionStart, State, encode, split_state
from verifier_node.drafters import DrafterLink
from verifier_node.session import Session

log = logging.getLogger("pipespec.verifier")


def _state_tensors(
    hidden: torch.Tensor | None, kv: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], int]:
    """The target state a drafter asked for (hidden states, ``kv.{layer}`` rows) as message tensors, and their bytes."""
    tensors = {"hidden": hidden} if hidden is not None else {}
    tensors.update(kv or {})
    return tensors, sum(t.numel() * t.element_size() for t in tensors.values())


class DrafterOut:
    """The verifier's sending side of the drafter ROUTER ``sock``; ``max_bytes``: the message cap."""

    def __init__(self, sock: zmq.Socket, max_bytes: int):
        self.sock = sock
        self.max_bytes = max_bytes

    def send(self, link: DrafterLink, frames: list) -> None:
        self.sock.send_multipart([link.routing_id, *frames], copy=False)

    def announce(self, s: Session, d: DrafterLink, decoding: int, hidden: torch.Tensor | None = None,
                 kv: dict[str, torch.Tensor] | None = None) -> None:
        """Announce ``s`` to its drafter ``d`` with the state it needs; from now on ``s`` waits for its drafts."""
        tensors, size = _state_tensors(hidden, kv)
        pieces = [] if size <= self.state_budget() else split_state(tensors, len(s.tokens) - 1, self.state_budget())
        self.send(d, encode(SessionStart(session=s.sid, token_ids=s.tokens, params=s.params.for_drafter(),
                                         prompt_len=s.prompt_len, decoding=decoding,
                                         tenant=s.tenant, tensors={} if pieces else tensors)))
        for end, part in pieces:  # a long prompt's state, in pieces that each fit the message cap
            self.send(d, encode(State(session=s.sid, base_len=len(s.tokens), end=end, tensors=part)))
        s.announced = True
        s.ready_since = time.monotonic()
        s.wait.ready(len(s.tokens), s.ready_since)

    def state_budget(self) -> int:
        """Bytes of state tensors one message may carry (the rest of the cap is left to the header)."""
        return self.max_bytes * 3 // 4

    def extras(
        self, s: Session, hidden: torch.Tensor | None, kv: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """A commit's state tensors (hidden states, K/V rows of one round's positions), dropped with an error in the
        log if they would exceed the message cap (the drafter then drafts nothing more for the session; the output
        is unaffected)."""
        tensors, size = _state_tensors(hidden, kv)
        if size > self.state_budget():
            log.error("session %d: drafter state of %d bytes exceeds max_message_bytes (%d); not sent", s.sid, size,
                      self.max_bytes)
            return {}
        return tensors
