"""Tool calling on ``/v1/chat/completions``: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
checked and planned (the parser of the target's family, the grammar that forces a call), and the output shaped as
OpenAI's ``message.tool_calls`` or, streamed, ``delta.tool_calls``.

``auto``: the model may call; its text is parsed. ``required`` / a named function: a grammar from
:func:`shared.tool_calls.tool_call_grammar` makes the model write a call (whose arguments follow the tool's
schema), then the text is parsed alike. ``none``: the tools are in the prompt (the template shows them) but the
output is not parsed, as in vLLM. The parser is fed the text that survives the stop strings, one verifier round's
worth at a time, whatever number of tokens a round commits.
"""

from __future__ import annotations

from typing import Any

from http_server.errors import bad_request
from shared.chat_tools import ChatError, ToolPlan, check_messages
from shared.chat_tools import plan_tools as plan
from shared.sampling import GrammarSpec
from shared.tool_calls import ParsedDelta
from verifier_node.schema_check import check_schema  # the verifier's own check, before anything runs


def plan_tools(req: Any, parser_name: str | None, other_constraint: GrammarSpec | None) -> ToolPlan | None:
    """The chat request's :class:`~shared.chat_tools.ToolPlan` (None: no tools); a bad field is a 400 naming it."""
    try:
        planned = plan(req.tools, req.tool_choice, req.parallel_tool_calls, parser_name, other_constraint,
                       check_schema)
    except ChatError as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    if planned is not None and planned.grammar is not None and req.stop_strings():
        # as with any output constraint: a stop string would cut the forced call short while finish_reason
        # says the text is complete
        raise bad_request("stop cannot be combined with a forced tool call (tool_choice required or named): a stop "
                          "string would cut the call short", param="stop", code="invalid_value")
    return planned


def check_chat_messages(messages: list[dict[str, Any]]) -> None:
    """The turns as the verifier will check them (tool calls' shapes, ``tool`` turns' ids): a 400 here, first."""
    try:
        check_messages(messages)
    except ChatError as exc:
        raise bad_request(str(exc), param="messages", code="invalid_value") from None


def call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    """One entry of OpenAI's streamed ``delta.tool_calls``: id, type and name in a call's first delta only."""
    entry: dict[str, Any] = {"index": index}
    if call_id is not None:
        entry.update(id=call_id, type="function")
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function = {"name": name, **function}
    entry["function"] = function
    return entry


class ToolOutput:
    """One choice's output read for tool calls: whole (:meth:`message`) or as it streams (:meth:`deltas`,
    :meth:`finish`). ``parallel_tool_calls: false`` keeps the first call only."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        parser = plan.new_parser()
        assert parser is not None
        self.parser = parser

    def _deltas(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        out = []
        if parsed.content:
            out.append({"content": parsed.content})
        calls = [call_delta(d.index, d.id, d.name, d.arguments) for d in self.plan.kept(parsed).calls]
        if calls:
            out.append({"tool_calls": calls})
        return out

    def deltas(self, piece: str) -> list[dict[str, Any]]:
        """The ``delta`` objects for the next piece of text (content and/or tool calls; none while held back)."""
        return self._deltas(self.parser.push(piece)) if piece else []

    def finish(self) -> list[dict[str, Any]]:
        """What the parser still held at the end."""
        return self._deltas(self.parser.finish())

    def calls(self) -> list[dict[str, Any]]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.plan.kept_calls(self.parser.calls)]

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when the output held calls (and ended on its own); otherwise the run's reason."""
        return self.plan.finish_reason(reason, self.parser.calls)

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed ``message``: content the text besides the calls (null when there is none and there
        are calls), ``tool_calls`` when there are calls."""
        self.parser.push(text)
        self.parser.finish()
        calls = self.calls()
        content: str | None = self.parser.content
        if calls and not content.strip():
            content = None
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            msg["tool_calls"] = calls
        return msg
