"""What a structured-output spec is checked for before it is compiled: keywords the engine ignores, size, repeat counts.

**Keywords** (:func:`check_schema`): the JSON-schema keywords the grammar engine (xgrammar 0.2.9) compiles without
effect, refused before compiling.

xgrammar builds a grammar from the parts of a schema it knows and silently drops the rest, so a schema with ``not``
or ``uniqueItems`` would compile to a grammar that lets through output the schema forbids — while the response
claims to follow the schema. :func:`check_schema` walks every subschema and raises :class:`ParamError` naming the
first such keyword and its JSON pointer. Each entry below was established by experiment: a schema with the keyword
compiled, and a JSON text violating it was accepted by the matcher (tests/test_structured.py repeats them, so an
engine upgrade that starts enforcing one shows up). The list is documented in docs/http.md (structured output).

**Bounds** (:func:`check_spec_bounds`, run off the loop before a spec waits for a compile): a JSON schema's nesting
depth and size (xgrammar's compile time grows fast with nesting: nested anyOf super-exponentially), and every
repeat count — ``minLength`` / ``maxLength`` / ``minItems`` / ``maxItems`` / ``minProperties`` / ``maxProperties``,
and ``{n}`` / ``{n,}`` / ``{n,m}`` in a regex (``pattern``, ``patternProperties``, kind ``regex``) or an EBNF grammar,
where counts nested in one expression multiply — at most :data:`MAX_REPEAT_COUNT`. xgrammar 0.2.9 compiles large
counts as counters, in about the same time as small ones, but its masks slow down past 128 (xgrammar #805, #852),
earlier versions unrolled them, and no response holds more: a bound keeps an engine change from becoming a way to
stall the verifier.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shared.sampling import GrammarSpec, ParamError

#: A JSON schema deeper than this many nested objects / arrays (of its JSON text), or with more values in all, is
#: refused before compiling.
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 5000
#: The largest repeat count a spec may state (a length, an item count, a regex or EBNF ``{n,m}``; nested counts of one
#: expression multiplied).
MAX_REPEAT_COUNT = 65_536
#: Schema keywords that are repeat counts.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

#: Keywords refused wherever they appear in a schema, with what to do instead.
IGNORED_KEYWORDS: dict[str, str] = {
    "not": "",
    "if": "use anyOf of the cases",
    "then": "use anyOf of the cases",
    "else": "use anyOf of the cases",
    "dependentRequired": "",
    "dependentSchemas": "",
    "dependencies": "",
    "contains": "",
    "minContains": "",
    "maxContains": "",
    "uniqueItems": "",
    "oneOf": "use anyOf (the same output when the branches do not overlap)",
    "additionalItems": "use prefixItems with items",
    "$dynamicRef": "use $ref to #/$defs/...",
    "$recursiveRef": "use $ref to #/$defs/...",
}
#: The string formats the engine constrains (any other ``format`` lets any string through).
KNOWN_FORMATS = frozenset({
    "email", "date-time", "date", "time", "uuid", "ipv4", "ipv6", "hostname", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "duration",
})
#: Keywords that do nothing beside ``enum`` / ``const`` (the engine emits the listed values as they are).
_VALUE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                   "maxLength", "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties")
#: Where subschemas sit: a schema, a list of schemas, or a name → schema map.
_SCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_SCHEMA_LIST = ("anyOf", "allOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _pointer(path: tuple[str, ...]) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path) if path else "/ (the root)"


def _refuse(path: tuple[str, ...], keyword: str, why: str) -> None:
    raise ParamError(f"json_schema: {keyword!r} at {_pointer(path)} is not supported: {why}")


def _has_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


def check_schema(schema: Any, path: tuple[str, ...] = ()) -> None:
    """Raise :class:`ParamError` at the first keyword of ``schema`` (a parsed JSON schema) that the engine would
    compile without effect; values under ``const``, ``enum``, ``default`` and ``examples`` are data, not walked."""
    if not isinstance(schema, dict):
        return  # true / false, or a shape the engine itself refuses
    for keyword, instead in IGNORED_KEYWORDS.items():
        if keyword in schema:
            _refuse((*path, keyword), keyword, "the grammar engine (xgrammar) ignores it, so the output would not be "
                    "held to it" + (f"; {instead}" if instead else ""))
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse((*path, "allOf"), "allOf", "the grammar engine keeps one of several allOf subschemas only; merge "
                "them into one schema")
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        _refuse((*path, "$ref"), "$ref", f"only references inside the schema (#/$defs/...) are resolved, not {ref!r}")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
        _refuse((*path, "format"), "format", f"the grammar engine does not constrain format {fmt!r} (it lets any "
                f"string through); known: {', '.join(sorted(KNOWN_FORMATS))}")
    if "pattern" in schema:
        for keyword in ("minLength", "maxLength"):
            if keyword in schema:
                _refuse((*path, keyword), keyword, "the grammar engine ignores string lengths beside a pattern; "
                        "put the length into the pattern (e.g. ^[a-z]{3,8}$)")
    if schema.get("type") == "number" and "multipleOf" in schema:
        _refuse((*path, "multipleOf"), "multipleOf", 'the grammar engine enforces multipleOf on "type": '
                '"integer" only')
    values = ([schema["const"]] if "const" in schema else []) + (
        list(schema["enum"]) if isinstance(schema.get("enum"), list) else [])
    if "const" in schema or "enum" in schema:
        for keyword in _VALUE_KEYWORDS:
            if keyword in schema:
                _refuse((*path, keyword), keyword, "the grammar engine emits the enum / const values as listed and "
                        "ignores this keyword beside them; list only the values that satisfy it")
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None:
            for i, value in enumerate(values):
                if not any(_has_type(value, t) for t in types if isinstance(t, str)):
                    where = ("const",) if "const" in schema and i == 0 else ("enum", str(i - ("const" in schema)))
                    _refuse((*path, *where), where[0], f"the value {value!r} is not of the schema's type "
                            f"{schema['type']!r}, and the grammar engine would emit it anyway")
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        named = props if isinstance(props, dict) else {}
        for i, name in enumerate(required):
            if isinstance(name, str) and name not in named:
                _refuse((*path, "required", str(i)), "required", f"property {name!r} is required but not in "
                        "properties; the grammar engine would not generate it")
    for keyword in _SCHEMA:
        if keyword in schema:
            check_schema(schema[keyword], (*path, keyword))
    for keyword in _SCHEMA_LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                check_schema(sub, (*path, keyword, str(i)))
    for keyword in _SCHEMA_MAP:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                check_schema(sub, (*path, keyword, str(name)))


# ----------------------------------------------------------------------------------------------------- bounds
def check_spec_bounds(spec: GrammarSpec, max_depth: int = MAX_SCHEMA_DEPTH, max_nodes: int = MAX_SCHEMA_NODES,
                      max_repeat: int = MAX_REPEAT_COUNT) -> None:
    """Refuse (:class:`ParamError`, the client's 400) a spec past the bounds of the module's docstring."""
    if spec.kind == "json_schema":
        schema = _bounded_schema(spec.value, max_depth, max_nodes)
        _check_counts(schema, (), max_repeat)
    elif spec.kind == "regex":
        check_repeats(spec.value, "regex", max_repeat)
    elif spec.kind == "grammar":
        check_repeats(spec.value, "grammar", max_repeat, ebnf=True)


def check_schema_bounds(spec: GrammarSpec, max_depth: int = MAX_SCHEMA_DEPTH,
                        max_nodes: int = MAX_SCHEMA_NODES) -> None:
    """Refuse a ``json_schema`` spec nested deeper than ``max_depth`` or with more than ``max_nodes`` JSON values."""
    if spec.kind == "json_schema":
        _bounded_schema(spec.value, max_depth, max_nodes)


def _bounded_schema(text: str, max_depth: int, max_nodes: int) -> Any:
    """``text`` parsed, once its depth (measured on the text: a deeply nested text would make ``json.loads``
    recurse out of its stack) and its number of values are within bounds."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > max_depth:
        raise ParamError(f"json_schema: nested {deepest} levels deep; at most {max_depth} levels (objects and "
                         "arrays of its JSON text) are accepted")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ParamError(f"json_schema: not valid JSON: {exc}") from None
    stack, nodes = [schema], 0
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ParamError(f"json_schema: more than {max_nodes} JSON values; at most {max_nodes} are accepted")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def _subschemas(schema: dict, path: tuple[str, ...]):
    """``(subschema, its path)`` of every place a schema sits directly under ``schema``."""
    for keyword in _SCHEMA:
        if keyword in schema:
            yield schema[keyword], (*path, keyword)
    for keyword in _SCHEMA_LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield sub, (*path, keyword, str(i))
    for keyword in _SCHEMA_MAP:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield sub, (*path, keyword, str(name))


def _check_counts(schema: Any, path: tuple[str, ...], limit: int) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in COUNT_KEYWORDS:
        value = schema.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            _refuse((*path, keyword), keyword, f"{value:g} is over the largest repeat count accepted, {limit} (leave "
                    "it out for no bound: max_tokens bounds the output anyway)")
    if isinstance(schema.get("pattern"), str):
        check_repeats(schema["pattern"], f"json_schema: pattern at {_pointer((*path, 'pattern'))}", limit)
    if isinstance(schema.get("patternProperties"), dict):
        for name in schema["patternProperties"]:
            check_repeats(str(name), f"json_schema: patternProperties key at {_pointer(path)}", limit)
    for sub, where in _subschemas(schema, path):
        _check_counts(sub, where, limit)


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")


def _count(match: re.Match) -> int:
    """The count a ``{n}`` / ``{n,}`` / ``{n,m}`` stands for (its upper bound, or n when open); digits past nine
    count as more than any bound (and are never handed to ``int``, whose text conversion is bounded)."""
    digits = match[3] if match[3] else match[1]
    return 10**10 if len(digits) > 9 else int(digits)


def _class_end(text: str, i: int) -> int:
    """The index past the ``]`` that closes the character class opening at ``text[i]``."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1  # a ] first in the class is literal
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _string_end(text: str, i: int) -> int:
    """The index past the quote that closes the string literal opening at ``text[i]`` (EBNF)."""
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def check_repeats(text: str, what: str, limit: int = MAX_REPEAT_COUNT, *, ebnf: bool = False) -> None:
    """Refuse (:class:`ParamError`) a regex (or, with ``ebnf``, an EBNF grammar) whose counted repetition states
    more than ``limit`` repeats, alone or multiplied by the counts of the groups around it. Escapes, character
    classes (and, in EBNF, string literals and ``#`` comments) are skipped; ``*``, ``+`` and ``?`` count as one."""
    heaviest = [1]  # per open group: the largest weight of an element in it so far
    last, i = 1, 0  # ``last``: the weight of the element just read (a count multiplies it)
    while i < len(text):
        ch = text[i]
        if ch == "{" and (match := _COUNT.match(text, i)):
            last *= max(_count(match), 1)
            if last > limit:
                raise ParamError(f"{what}: repeats something {match[0]!r} times"
                                 + (" (with the groups around it)" if last != _count(match) else "")
                                 + f"; at most {limit} repeats are accepted")
            heaviest[-1] = max(heaviest[-1], last)
            i = match.end()
            continue
        if ch == "(":
            heaviest.append(1)
            i += 1
            continue
        if ch == ")":
            last = heaviest.pop() if len(heaviest) > 1 else 1
            heaviest[-1] = max(heaviest[-1], last)
            i += 1
            continue
        if ebnf and ch == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end + 1
            continue
        if ch == "[":
            i = _class_end(text, i)
        elif ebnf and ch in "\"'":
            i = _string_end(text, i)
        else:
            i += 2 if ch == "\\" else 1
        last = 1
