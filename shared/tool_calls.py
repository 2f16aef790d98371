# TEMPORARY: replaced by part D's module at merge
"""Tool calls in a model's output text (a small stand-in for part D's engine, hermes only): parse them whole or as
the text streams, detect the family from a chat template, and the grammar that forces a call (``required`` or a
named tool)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.sampling import GrammarSpec


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ParsedDelta:
    content: str
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """One per choice: :meth:`push` the committed text, :meth:`finish` at the end."""

    def __init__(self, new_id: Callable[[], str] = random_call_id):
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self.content = ""


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = random_call_id):
        super().__init__(new_id)
        self._held = ""

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(self.new_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))

    def push(self, text: str) -> ParsedDelta:
        self._held += text
        out = ParsedDelta("")
        while True:
            start = self._held.find(self.OPEN)
            if start < 0:
                # keep a tail that could be the start of an opening tag
                keep = next((k for k in range(min(len(self.OPEN) - 1, len(self._held)), 0, -1)
                             if self.OPEN.startswith(self._held[-k:])), 0)
                emit, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                out.content += emit
                break
            out.content += self._held[:start]
            end = self._held.find(self.CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                break
            call = self._call(self._held[start + len(self.OPEN):end])
            if call is None:
                out.content += self._held[start:end + len(self.CLOSE)]
            else:
                out.calls.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
                self.calls.append(call)
            self._held = self._held[end + len(self.CLOSE):]
        self.content += out.content
        return out

    def finish(self) -> ParsedDelta:
        rest, self._held = self._held, ""
        self.content += rest
        return ParsedDelta(rest)


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    parser.push(text)
    parser.finish()
    return parser.content, list(parser.calls)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def parser_name_for_template(chat_template: str | None) -> str | None:
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("tools" in chat_template and "<|eot_id|>" in chat_template):
        return "llama3_json"
    return None


def tool_call_grammar(parser: str, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
                      ) -> GrammarSpec | None:
    if tool_choice in ("auto", "none"):
        return None
    if parser != "hermes":
        raise NotImplementedError(f"temporary module: no grammar for {parser}")
    import xgrammar as xgr

    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        functions = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    ebnf = re.sub(r"\broot\b", "call", ebnf)
    repeat = ' ("\\n" one)*' if parallel_tool_calls else ""
    head = f'root ::= one{repeat}\none ::= "<tool_call>\\n" call "\\n</tool_call>"\n'
    return GrammarSpec("grammar", head + ebnf)
