"""Tool calls in a model's output: the parsers that find them (streamed or whole) and the grammar that forces them.

Three output formats (families), each a :class:`ToolCallParser` subclass in :data:`PARSERS`:

* ``hermes`` — Qwen2.5 / Qwen3 (and Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several calls one after another (separated by a newline);
* ``llama3_json`` — Llama 3.1 / 3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}`` as the whole output
  (optionally after ``<|python_tag|>``), several calls separated by ``;``;
* ``mistral`` — the v3 tokenizer's ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (a JSON array after
  the marker; the newer ``[TOOL_CALLS]name[ARGS]{...}`` form is not parsed).

**Streaming equals whole text, by construction.** :meth:`ToolCallParser.push` feeds its text through one state
machine one character at a time (a run of characters none of which can change the state is taken at once, with the
effect of its single steps), and :func:`parse_whole` is ``push(text)`` then ``finish()``; so any split of the same
text makes the same decisions at the same characters, and the pieces concatenate to the whole result. A
call is emitted **whole**: one :class:`ToolCallDelta` carrying its id, name and complete ``arguments`` text, at the
character that closes its JSON object, and only if that object parses as a call (``name`` a non-empty string, the
arguments a JSON object, no other keys). Nothing emitted is ever taken back, so a call is never dropped, cut or
doubled however many tokens a round commits at once (the class of vLLM #41967, #35800, #46249, #52767, which
stream partial arguments and then correct them). The price: a client sees a call's arguments when the call's JSON
closes, not token by token. ``arguments`` is the model's own JSON text of the object (never re-serialised).

**What is held back:** in plain text only a tail that may be the start of a call marker (``<tool_c``); from a
marker on, the call's text until its JSON object closes; after a call, whitespace and what may be its closing
marker or a separator (whitespace between and after calls is dropped). **Malformed calls are plain content**: a
marker not followed by a JSON object, an object that does not parse as a call (JSON invalid, a key missing or
extra, arguments not an object), or a call still open when the output ends is released, as written, as content —
never an exception. Calls already emitted stay calls (a Mistral array whose third element is broken keeps its
first two calls; the broken element on is content).

:func:`tool_call_grammar` builds the output constraint of ``tool_choice`` ``"required"`` or a named function: an
EBNF grammar (kind ``grammar``) in the family's own format whose arguments follow each function's ``parameters``
schema (xgrammar's JSON-schema conversion, rules renamed per tool), one call or (``parallel_tool_calls``) several,
then the end token. :func:`parser_name_for_template` tells the family from a chat template's text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.sampling import MAX_GRAMMAR_CHARS, GrammarSpec, ParamError


def random_call_id() -> str:
    """A fresh call id: ``call_`` and 24 random hex characters (OpenAI's shape)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One complete call."""

    id: str
    name: str
    arguments: str  # the arguments object as JSON text, exactly as the model wrote it


@dataclass
class ToolCallDelta:
    """One streamed fragment, OpenAI's ``delta.tool_calls[i]``."""

    index: int  # the call's position in this answer (0, 1, ...)
    id: str | None  # set on the call's first fragment only
    name: str | None  # set on the call's first fragment only
    arguments: str  # the next piece of the arguments text (may be "")


@dataclass
class ParsedDelta:
    """What one :meth:`ToolCallParser.push` (or ``finish``) releases."""

    content: str = ""  # plain text to show as delta.content ("" if none)
    calls: list[ToolCallDelta] = field(default_factory=list)


_WS = " \t\n\r"  # JSON's whitespace
# runs of a call's JSON text that change neither the depth nor the string state (push's fast path)
_JSON_PLAIN = re.compile(r'[^"{}\[\]]*')
_STRING_PLAIN = re.compile(r'[^"\\]*')


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# NaN / Infinity are Python's extension, not JSON: a call carrying them is not a valid call
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


class ToolCallParser:
    """One per choice: feed it the committed text as it comes (:meth:`push`), then :meth:`finish`. Subclasses set
    the family's markers (class attributes below); the state machine is shared."""

    #: opens a call (or, ``ARRAY``, an array of calls); None: no marker
    MARKER: ClassVar[str | None] = None
    #: may follow a call (consumed, once); "" for none
    CLOSE: ClassVar[str] = ""
    #: the keys that may hold the arguments object
    ARGS_KEYS: ClassVar[tuple[str, ...]] = ("arguments",)
    #: the marker is followed by a JSON array of calls
    ARRAY: ClassVar[bool] = False
    #: a ``{`` at the start of the output (after whitespace), and after a call, opens a call without a marker
    BARE_START: ClassVar[bool] = False
    #: may separate two calls; "" for none
    SEPARATOR: ClassVar[str] = ""

    def __init__(self, new_id: Callable[[], str] = random_call_id):
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._content: list[str] = []  # all plain content so far, in pieces (joined on demand)
        self._state = "lead" if self.BARE_START else "content"
        self._held = ""  # text not yet classified (see the module docstring)
        self._obj_start = 0  # where the call's JSON object starts in _held
        self._depth = 0
        self._in_str = self._escaped = False
        self._in_array = False  # inside the marker's array (ARRAY)
        self._closed = False  # the CLOSE after the last call was seen
        self._finished = False
        self._out: list[str] = []  # content since the last push / finish returned
        self._out_calls: list[ToolCallDelta] = []

    @property
    def content(self) -> str:
        """All plain content so far."""
        if len(self._content) > 1:
            self._content = ["".join(self._content)]
        return self._content[0] if self._content else ""

    # -- the public interface ------------------------------------------------------------------------------------

    def push(self, text: str) -> ParsedDelta:
        """Feed the next committed text (any length); what is now known to be content or a call comes back."""
        if self._finished:
            raise RuntimeError("push after finish")
        i = 0
        while i < len(text):
            # Fast paths, each exactly what the per-character steps would do over the run they skip: plain text
            # that cannot start the marker is content; inside a call's JSON, characters that change no count.
            if self._state == "content" and not self._held and self.MARKER:
                j = text.find(self.MARKER[0], i)
                j = len(text) if j < 0 else j
                if j > i:
                    self._emit(text[i:j])
                    i = j
                    continue
            elif self._state == "object" and not self._escaped:
                m = (_STRING_PLAIN if self._in_str else _JSON_PLAIN).match(text, i)
                if m.end() > i:
                    self._held += m.group()
                    i = m.end()
                    continue
            self._step(text[i])
            i += 1
        return self._take()

    def finish(self) -> ParsedDelta:
        """The output ended: release what was held (an unfinished call as content; whitespace after a call, and
        the start of its closing marker cut off by the end, are dropped). Later pushes are refused."""
        if not self._finished:
            self._finished = True
            rest = self._held.strip(_WS)
            if self._state in ("after", "array_after") and (
                    not rest or (self.CLOSE and not self._closed and self.CLOSE.startswith(rest))):
                self._held = ""
            self._emit(self._held)
            self._held = ""
        return self._take()

    # -- the state machine (one character at a time: the reason any split gives the same result) -----------------

    def _step(self, ch: str) -> None:
        getattr(self, "_on_" + self._state)(ch)

    def _on_content(self, ch: str) -> None:
        s = self._held + ch
        marker = self.MARKER
        if marker and marker.startswith(s):
            self._held = s
            if s == marker:
                self._state = "open"
            return
        keep = 0  # the longest tail that may still start the marker
        if marker:
            for k in range(min(len(s), len(marker) - 1), 0, -1):
                if marker.startswith(s[-k:]):
                    keep = k
                    break
        self._emit(s[:len(s) - keep])
        self._held = s[len(s) - keep:]

    def _on_lead(self, ch: str) -> None:
        if ch in _WS:
            self._held += ch
        elif ch == "{":
            self._open_object(self._held + ch)
        else:
            self._fail(ch)

    def _on_open(self, ch: str) -> None:
        if ch in _WS:
            self._held += ch
        elif self.ARRAY and not self._in_array and ch == "[":
            self._held += ch
            self._in_array = True
        elif ch == "{":
            self._open_object(self._held + ch)
        else:
            self._fail(ch)

    def _on_object(self, ch: str) -> None:
        self._held += ch
        if self._in_str:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_str = False
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._close_object()

    def _on_after(self, ch: str) -> None:
        s = self._held + ch
        rest = s.lstrip(_WS)
        separated = bool(self.SEPARATOR) and rest.startswith(self.SEPARATOR)
        if separated:
            rest = rest[len(self.SEPARATOR):].lstrip(_WS)
        if not rest:
            self._held = s
        elif self.CLOSE and not separated and not self._closed and self.CLOSE.startswith(rest):
            self._held = s
            if rest == self.CLOSE:
                self._closed, self._held = True, ""
        elif self.MARKER and self.MARKER.startswith(rest):
            self._held = s
            if rest == self.MARKER:
                self._state = "open"
        elif self.BARE_START and rest == "{":
            self._open_object(s)
        else:
            self._fail(ch)

    def _on_array_after(self, ch: str) -> None:
        s = self._held + ch
        rest = s.lstrip(_WS)
        if not rest:
            self._held = s
        elif rest == "]":
            self._held, self._in_array, self._closed, self._state = "", False, True, "after"
        elif rest[0] == ",":
            tail = rest[1:].lstrip(_WS)
            if not tail:
                self._held = s
            elif tail == "{":
                self._open_object(s)
            else:
                self._fail(ch)
        else:
            self._fail(ch)

    def _open_object(self, held: str) -> None:
        """``held`` ends with the ``{`` that opens a call's JSON object."""
        self._held, self._obj_start, self._state = held, len(held) - 1, "object"
        self._depth, self._in_str, self._escaped = 1, False, False

    def _close_object(self) -> None:
        found = self._read_call(self._held[self._obj_start:])
        if found is None:  # not a call: what was held is content, as written
            self._in_array = False
            self._emit(self._held)
            self._held, self._state = "", "content"
            return
        name, arguments = found
        call = ToolCall(self.new_id(), name, arguments)
        self._out_calls.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
        self.calls.append(call)
        self._held, self._closed = "", False
        self._state = "array_after" if self._in_array else "after"

    def _fail(self, ch: str) -> None:
        """What was held is not a call after all: it is content, and ``ch`` is read again as plain text."""
        self._emit(self._held)
        self._held, self._state, self._in_array = "", "content", False
        self._on_content(ch)

    def _read_call(self, text: str) -> tuple[str, str] | None:
        """(name, arguments text) if ``text`` (one JSON object) is a call of this family, else None."""
        members = _members(text)
        if members is None or "name" not in members or len(members) != 2:
            return None
        key = next((k for k in self.ARGS_KEYS if k in members), None)
        name = members["name"][0]
        if key is None or not isinstance(name, str) or not name or not isinstance(members[key][0], dict):
            return None
        _, start, end = members[key]
        return name, text[start:end]

    # -- output --------------------------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(text)
            self._content.append(text)

    def _take(self) -> ParsedDelta:
        out = ParsedDelta("".join(self._out), self._out_calls)
        self._out, self._out_calls = [], []
        return out


def _members(text: str) -> dict[str, tuple[Any, int, int]] | None:
    """The members of one JSON object text: key → (value, start, end) with the value's span in ``text``; None if it
    is not exactly one valid JSON object (or repeats a key)."""
    def skip(i: int) -> int:
        while i < len(text) and text[i] in _WS:
            i += 1
        return i

    out: dict[str, tuple[Any, int, int]] = {}
    try:
        i = skip(1)
        if text[i] == "}":
            return out if i == len(text) - 1 else None
        while True:
            if text[i] != '"':
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = skip(i)
            if text[i] != ":":
                return None
            start = skip(i + 1)
            value, end = _DECODER.raw_decode(text, start)
            if key in out:
                return None
            out[key] = (value, start, end)
            i = skip(end)
            if text[i] == "}":
                return out if i == len(text) - 1 else None
            if text[i] != ",":
                return None
            i = skip(i + 1)
    except (ValueError, IndexError, RecursionError):
        return None


class HermesParser(ToolCallParser):
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    MARKER = "<tool_call>"
    CLOSE = "</tool_call>"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON: ``{"name": ..., "parameters": {...}}`` at the start of the output (or after
    ``<|python_tag|>``), calls separated by ``;``. ``arguments`` is accepted for ``parameters`` too."""

    MARKER = "<|python_tag|>"
    ARGS_KEYS = ("parameters", "arguments")
    BARE_START = True
    SEPARATOR = ";"


class MistralParser(ToolCallParser):
    """Mistral (v3 tokenizer): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a
    special token: the text must be detokenized with it kept."""

    MARKER = "[TOOL_CALLS]"
    ARRAY = True


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The whole output at once: ``push(text)`` then ``finish()`` (the streaming path itself); (content, calls)."""
    parser.push(text)
    parser.finish()
    return parser.content, list(parser.calls)


def parser_name_for_template(chat_template: str | None) -> str | None:
    """The tool-call family a chat template writes calls in, from its text; None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters": dictionary of argument name' in chat_template:
        return "llama3_json"
    return None


# -- the grammar of tool_choice "required" / a named function ------------------------------------------------------

#: OpenAI's rule for a function name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: How each family writes one call (before and after the arguments: the name goes in between), what separates two
#: calls, and what surrounds the calls. The spacing is the chat templates' own (``tojson``: ``", "`` and ``": "``).
_FORMATS: dict[str, dict[str, str]] = {
    "hermes": {"before": '<tool_call>\n{"name": ', "args": ', "arguments": ', "after": "}\n</tool_call>",
               "sep": "\n", "open": "", "close": ""},
    "llama3_json": {"before": '{"name": ', "args": ', "parameters": ', "after": "}", "sep": "; ", "open": "",
                    "close": ""},
    "mistral": {"before": '{"name": ', "args": ', "arguments": ', "after": "}", "sep": ", ",
                "open": "[TOOL_CALLS][", "close": "]"},
}


def tool_call_grammar(parser: str, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool,
                      check_schema: Callable[[Any], None] | None = None) -> GrammarSpec | None:
    """The output constraint of ``tool_choice`` in family ``parser``'s format: None for ``"auto"`` / ``"none"``;
    for ``"required"`` one call (several with ``parallel_tool_calls``) of any of ``tools``, for
    ``{"type": "function", "function": {"name": X}}`` of X only — nothing before the calls, the end token after.
    Arguments follow each function's ``parameters`` (strict: no properties it does not name, unless the function
    says ``"strict": false``). ``check_schema``: called on each ``parameters`` schema before it is converted (the
    HTTP server passes the verifier's keyword and bound checks). Bad input raises :class:`ParamError` naming it."""
    if parser not in _FORMATS:
        raise ParamError(f"tool-call parser must be one of {', '.join(_FORMATS)}, got {parser!r}")
    if not isinstance(parallel_tool_calls, bool):
        raise ParamError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
    functions = _functions(tools)
    if tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        chosen = list(functions)
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict) and set(tool_choice) == {"type", "function"}):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise ParamError(f"tool_choice names function {name!r}, which is not in tools")
        chosen = [name]
    else:
        raise ParamError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         f'{{"name": ...}}}}, got {tool_choice!r}')
    if not chosen:
        raise ParamError(f"tool_choice {tool_choice!r} needs at least one function in tools")
    # The conversion runs where this is called (the HTTP server's loop) and grows with the schema's text: a nested
    # anyOf of 52 KB converts in 0.1 s, one of 3 MB (it doubles per level) in half a minute. Bounded as a
    # json_schema spec's text is, before anything is converted.
    size = sum(len(json.dumps(functions[name][1].get("parameters", {}))) for name in chosen)
    if size > MAX_GRAMMAR_CHARS:
        raise ParamError(f"tools: the parameter schemas of the functions tool_choice allows are {size} characters "
                         f"of JSON; at most {MAX_GRAMMAR_CHARS} are accepted")
    fmt = _FORMATS[parser]
    rules: list[str] = []
    shared: dict[str, tuple[str, str]] = {}  # xgrammar's basic rule → (its text, its line)
    alternatives = []
    for i, name in enumerate(chosen):
        index, function = functions[name]
        args_root = _schema_rules(index, i, function, check_schema, rules, shared)
        rules.append(f"tc_fn_{i} ::= {_literal(fmt['before'] + json.dumps(name) + fmt['args'])} {args_root} "
                     f"{_literal(fmt['after'])}")
        alternatives.append(f"tc_fn_{i}")
    more = f" ({_literal(fmt['sep'])} tc_call)*" if parallel_tool_calls else ""
    around = [_literal(fmt["open"])] if fmt["open"] else []
    root = " ".join([*around, "tc_call" + more, *([_literal(fmt["close"])] if fmt["close"] else [])])
    basics = [line for _, line in shared.values()]
    text = "\n".join([f"root ::= {root}", "tc_call ::= " + " | ".join(alternatives), *rules, *basics])
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ParamError(f"tools: the tool-call grammar of these functions is {len(text)} characters; at most "
                         f"{MAX_GRAMMAR_CHARS} are accepted (fewer or smaller parameter schemas)")
    return GrammarSpec("grammar", text)


def _functions(tools: Any) -> dict[str, tuple[int, dict]]:
    """name → (position, function object) of a request's ``tools``, checked."""
    if not isinstance(tools, list):
        raise ParamError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    out: dict[str, tuple[int, dict]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ParamError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ParamError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}")
        if name in out:
            raise ParamError(f"{where}.function.name {name!r} is given twice")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ParamError(f"{where}.function.strict must be true or false, got {strict!r}")
        out[name] = (i, function)
    return out


def _schema_rules(index: int, i: int, function: dict, check_schema: Callable[[Any], None] | None,
                  rules: list[str], shared: dict[str, tuple[str, str]]) -> str:
    """Add the rules of one function's arguments (renamed ``t{i}_...``; xgrammar's ``basic_*`` rules once for all)
    and return the name of their root rule."""
    import xgrammar  # lazily: only requests that force a call pay for it

    where = f"tools[{index}].function.parameters"
    schema = function.get("parameters", {"type": "object", "properties": {}})  # absent: no arguments
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ParamError(f'{where} must be a JSON schema of an object ({{"type": "object", ...}})')
    schema = {"type": "object", **schema}
    if check_schema is not None:
        try:
            check_schema(schema)
        except ParamError as exc:
            raise ParamError(f"{where}: {exc}") from None
    try:
        text = json.dumps(schema)
        ebnf = str(xgrammar.Grammar.from_json_schema(text, any_whitespace=False,
                                                     strict_mode=function.get("strict") is not False))
    except (TypeError, ValueError, RuntimeError, RecursionError) as exc:
        raise ParamError(f"{where}: refused by the grammar engine (xgrammar): {str(exc).strip()[:500]}") from None
    parsed = [line.split(" ::= ", 1) for line in ebnf.splitlines() if line.strip()]
    names = {}
    for rule, body in parsed:
        # the basic rules are the same text for every schema: shared; a differing one is kept apart
        same = rule.startswith("basic_") and shared.get(rule, (body, ""))[0] == body
        names[rule] = rule if same else f"t{i}_{rule}"
    for rule, body in parsed:
        line = f"{names[rule]} ::= {_rename(body, names)}"
        if names[rule] == rule:
            shared[rule] = (body, line)
        else:
            rules.append(line)
    return names["root"]


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _rename(body: str, names: dict[str, str]) -> str:
    """``body`` (one EBNF rule's right side) with its rule references renamed; string literals and character
    classes are copied as they are."""
    out = []
    i = 0
    while i < len(body):
        c = body[i]
        if c in '"[':
            end = "]" if c == "[" else '"'
            j = i + 1
            while body[j] != end:
                j += 2 if body[j] == "\\" else 1
            out.append(_unescape_wide(body[i:j + 1]))
            i = j + 1
        elif c.isalpha() or c == "_":
            m = _IDENT.match(body, i)
            assert m is not None
            out.append(names.get(m.group(), m.group()))
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


_WIDE = {"x": 2, "u": 4, "U": 8}


def _unescape_wide(text: str) -> str:
    """A literal or character class of xgrammar's printed EBNF, with its code-point escapes made safe to read back:
    the printer writes U+00B0 as ``\\xb0``, but the parser's ``\\x`` takes every hex digit that follows, so
    ``"\\xb0C"`` (the JSON text ``°C``) would read back as U+0B0C. A character past ASCII becomes itself (UTF-8 in
    the grammar); one below, ``\\u`` with exactly four digits."""
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        kind = text[i + 1]
        digits = _WIDE.get(kind, 0)
        hex_digits = text[i + 2:i + 2 + digits]
        if digits and len(hex_digits) == digits and all(h in "0123456789abcdefABCDEF" for h in hex_digits):
            point = int(hex_digits, 16)
            if 0x80 <= point <= 0x10FFFF and not 0xD800 <= point <= 0xDFFF:
                out.append(chr(point))
            else:
                out.append(f"\\u{point:04x}" if point < 0x10000 else text[i:i + 2 + digits])
            i += 2 + digits
        else:
            out.append(text[i:i + 2])  # any other escape, as printed
            i += 2
    return "".join(out)


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal (quote, backslash and control characters escaped)."""
    escaped = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}
    return '"' + "".join(escaped.get(c, c if ord(c) >= 0x20 else f"\\u{ord(c):04x}") for c in text) + '"'
