"""Chat turns and tool definitions as a ``generate`` message carries them (OpenAI's shapes): their checks, and the
form a chat template takes them in.

A turn is ``{role, content}`` plus, for tool use, an assistant turn's ``tool_calls`` (``[{id, type: "function",
function: {name, arguments}}]``, ``content`` null or text) and a ``tool`` turn's ``tool_call_id`` (and ``name``).
``arguments`` travels as JSON text, as OpenAI sends it; chat templates (Qwen2.5, Llama 3.1, Mistral) read it as a
mapping (``arguments | tojson``, ``arguments.items()``), so :func:`template_messages` parses it. The checks run in
``Generate.validate``: a malformed turn or tool is a ``bad_request`` for that request only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.sampling import GrammarSpec
from shared.tool_calls import PARSERS, ParsedDelta, ToolCall, ToolCallParser, tool_call_grammar

#: Turns in one request (as the HTTP server's own bound).
MAX_CHAT_MESSAGES = 4096
#: Tools offered in one request; calls in one assistant turn.
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
#: Characters of a role, a tool or function name, a tool call id.
MAX_NAME_CHARS = 256
#: Nesting of a tool's parameters schema (a JSON schema is a tree; deeper ones are refused before a template or a
#: grammar compiler recurses into them).
MAX_SCHEMA_DEPTH = 32

#: OpenAI's rule for a function name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

_TURN_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


class ChatError(ValueError):
    """A turn or a tool that is not what the OpenAI API allows; its message names the place, ``param`` the
    request field (for an HTTP 400) and ``code`` why."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def _name(where: str, value: Any, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise ChatError(f"{where} must be a string of 1 to {MAX_NAME_CHARS} characters")


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a JSON value, stopping once past ``limit``."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def check_tool_call(where: str, call: Any) -> None:
    """One ``tool_calls`` entry of an assistant turn: ``{id, type: "function", function: {name, arguments}}``,
    ``arguments`` the JSON text of an object."""
    if not isinstance(call, dict) or set(call) - {"id", "type", "function"}:
        raise ChatError(f"{where} must be {{id, type: \"function\", function: {{name, arguments}}}}")
    _name(f"{where}.id", call.get("id"))
    if call.get("type", "function") != "function":
        raise ChatError(f"{where}.type must be \"function\"")
    fn = call.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
        raise ChatError(f"{where}.function must be {{name, arguments}}")
    _name(f"{where}.function.name", fn.get("name"))
    arguments = fn.get("arguments")
    if not isinstance(arguments, str):
        raise ChatError(f"{where}.function.arguments must be a string (the arguments object as JSON text)")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ChatError(f"{where}.function.arguments must be the JSON text of an object, got {arguments[:80]!r}")


def check_messages(messages: list[Any]) -> None:
    """Chat turns as ``Generate.messages`` carries them; a :class:`ChatError` names the first bad one."""
    if not 0 < len(messages) <= MAX_CHAT_MESSAGES:
        raise ChatError(f"messages must hold 1 to {MAX_CHAT_MESSAGES} turns, got {len(messages)}")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be a map {{role, content}}")
        _name(f"{where}.role", m.get("role"))
        content, calls = m.get("content", _Missing), m.get("tool_calls")
        if content is _Missing:
            raise ChatError(f"{where} must be {{role, content}}: content is missing (null is allowed in an "
                            "assistant turn with tool_calls)")
        if content is None and not (m["role"] == "assistant" and calls):
            raise ChatError(f"{where}.content may be null only in an assistant turn with tool_calls")
        if content is not None and not isinstance(content, str):
            raise ChatError(f"{where}.content must be a string")
        _name(f"{where}.name", m.get("name"), required=False)
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
                raise ChatError(f"{where}.tool_calls: a list of at most {MAX_TOOL_CALLS} calls, in an assistant "
                                "turn only")
            for j, call in enumerate(calls):
                check_tool_call(f"{where}.tool_calls[{j}]", call)
        if m["role"] == "tool":
            _name(f"{where}.tool_call_id", m.get("tool_call_id"))
        elif "tool_call_id" in m:
            raise ChatError(f"{where}.tool_call_id belongs in a tool turn only")
        for key in set(m) - _TURN_KEYS:  # other keys a template may read (as before: strings only)
            if not isinstance(m[key], str):
                raise ChatError(f"{where}.{key} must be a string")


def check_tools(tools: list[Any]) -> None:
    """OpenAI's ``tools`` list: ``[{type: "function", function: {name, description?, parameters?, strict?}}]``,
    names unique."""
    if not 0 < len(tools) <= MAX_TOOLS:
        raise ChatError(f"tools must hold 1 to {MAX_TOOLS} tools, got {len(tools)}")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise ChatError(f"{where} must be {{type: \"function\", function: {{name, description, parameters}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - {"name", "description", "parameters", "strict"}:
            raise ChatError(f"{where}.function must be {{name, description, parameters, strict}}")
        if not isinstance(fn.get("name"), str) or not FUNCTION_NAME.fullmatch(fn["name"]):
            raise ChatError(f"{where}.function.name must be 1 to 64 letters, digits, _ or - (OpenAI's rule), got "
                            f"{fn.get('name')!r:.80}")
        if fn["name"] in seen:
            raise ChatError(f"{where}.function.name {fn['name']!r} is given twice")
        seen.add(fn["name"])
        if not isinstance(fn.get("description", ""), str):
            raise ChatError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatError(f"{where}.function.parameters must be a JSON schema object")
        if _depth(params, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ChatError(f"{where}.function.parameters nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ChatError(f"{where}.function.strict must be true or false")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns as chat templates take them: each tool call's ``arguments`` as a mapping (checked JSON text on
    the wire); everything else as sent."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "type": c.get("type", "function"), "function": {
                **c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


@dataclass(frozen=True)
class ToolPlan:
    """One request's tool use: the parser family (None: output not parsed, ``tool_choice: none``), the tools,
    the choice, whether several calls may come, and the grammar that forces a call (None for auto / none)."""

    parser: str | None
    tools: list[dict[str, Any]]
    choice: str | dict[str, Any]
    parallel: bool
    grammar: GrammarSpec | None

    def new_parser(self) -> ToolCallParser | None:
        return PARSERS[self.parser]() if self.parser else None

    # What the request is answered with, from what its parser read (the Python client and the HTTP server alike)
    def kept(self, delta: ParsedDelta) -> ParsedDelta:
        """``delta`` without the calls past the first where ``parallel_tool_calls`` is false."""
        return delta if self.parallel else ParsedDelta(delta.content, [d for d in delta.calls if d.index == 0])

    def kept_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The complete calls answered: all, or the first where ``parallel_tool_calls`` is false."""
        return list(calls if self.parallel else calls[:1])

    @staticmethod
    def finish_reason(reason: str, calls: list[ToolCall]) -> str:
        """``tool_calls`` when the output held calls and ended on its own (``stop``); otherwise the run's reason."""
        return "tool_calls" if calls and reason == "stop" else reason


def _choice(choice: Any, names: list[str]) -> str | dict[str, Any]:
    """``tool_choice`` checked against the tools (default: auto with tools, none without)."""
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ChatError(f'tool_choice must be none, auto, required or {{"type": "function", "function": '
                            f'{{"name": ...}}}}, got {choice!r}', "tool_choice")
        if choice == "required" and not names:
            raise ChatError("tool_choice required needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or set(choice) - {"type", "function"} or set(fn) - {"name"}:
        raise ChatError('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise ChatError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None, other_constraint: GrammarSpec | None = None,
               check_schema: Callable[[Any], None] | None = None) -> ToolPlan | None:
    """A request's :class:`ToolPlan` (None: no tools); a :class:`ChatError` naming the field otherwise.
    ``parser_name``: the family to read calls in (an operator's override, else the target template's; None: the
    template has no tool format). ``other_constraint``: the request's response_format / structured output, which a
    forced call cannot share. ``check_schema``: the verifier's check of a parameters schema, for a forced call's
    grammar (``verifier_node.schema_check.check_schema``: keywords the engine would not enforce are refused)."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise ChatError("tools must be a list", "tools")
        try:
            check_tools(tools)
        except ChatError as exc:
            raise ChatError(str(exc), "tools") from None
        names = [t["function"]["name"] for t in tools]
    choice = _choice(tool_choice, names)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ChatError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not names:
        return None
    if choice != "none" and parser_name is None:
        raise ChatError("this model's chat template has no tool-call format pipespec knows, so its tool calls "
                        "could not be read; name one with --tool-call-parser (hermes, llama3_json, mistral) if "
                        "the template takes tools", "tools", "unsupported_parameter")
    if choice != "none" and parser_name not in PARSERS:
        raise ChatError(f"tool-call parser {parser_name!r} is not available in this pipespec", "tools",
                        "unsupported_parameter")
    forced = choice not in ("auto", "none")
    if forced and other_constraint is not None:
        # both would constrain the one output: a call's JSON and the response format cannot both hold
        raise ChatError(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} cannot be "
                        f"combined with an output constraint ({other_constraint.kind}: response_format or "
                        "structured outputs): both would constrain the same output", "tool_choice")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    grammar = None
    if forced:
        try:
            grammar = tool_call_grammar(parser_name, tools, choice, parallel, check_schema)
        except (ValueError, NotImplementedError) as exc:
            raise ChatError(f"cannot force a tool call with these tools: {exc}", "tools") from None
    return ToolPlan(None if choice == "none" else parser_name, tools, choice, parallel, grammar)


class _MissingType:
    pass


_Missing = _MissingType()
