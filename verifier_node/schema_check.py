"""JSON-schema keywords the grammar engine (xgrammar 0.2.9) compiles without effect, refused before compiling.

xgrammar builds a grammar from the parts of a schema it knows and silently drops the rest, so a schema with ``not``
or ``uniqueItems`` would compile to a grammar that lets through output the schema forbids — while the response
claims to follow the schema. :func:`check_schema` walks every subschema and raises :class:`ParamError` naming the
first such keyword and its JSON pointer. Each entry below was established by experiment: a schema with the keyword
compiled, and a JSON text violating it was accepted by the matcher (tests/test_structured.py repeats them, so an
engine upgrade that starts enforcing one shows up). The list is documented in docs/http.md (structured output).
"""

from __future__ import annotations

from typing import Any

from shared.sampling import ParamError

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
