"""What xgrammar (0.2.9) would compile into a grammar without holding the output to it: each rule
here was found with an output that breaks the constraint and that the grammar lets through. Such a
constraint is refused (a ValueError, a 400 to a client), as vLLM's xgrammar backend refuses some;
so is a pattern too costly to match (regex_cost)."""

import json
import re
import string

# Python's own reading of a regex, against which xgrammar's is checked
from re import _constants as sre
from re import _parser as sre_parser
from typing import Any

from minisgl.scheduler.regex_cost import COUNT, too_costly

# xgrammar reads a larger count modulo 2^32: `a{4294967297}` matches "a", maxItems 2^32+1 allows 0
MAX_COUNT = 2**31 - 1
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# keywords xgrammar compiles but does not enforce (vLLM's xgrammar backend refuses most of them);
# patternProperties and propertyNames are dropped where no type is named, beside properties, or
# where two patterns match one name
_NEVER = (
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "dependentRequired",
    "dependentSchemas", "dependencies", "patternProperties", "propertyNames", "$dynamicRef",
    "$recursiveRef",
)  # fmt: skip
# a keyword that holds its type's values, dropped where a schema names no type
_OF_ONE_TYPE = (
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties",
)  # fmt: skip
_HOLDING = (
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems", *_OF_ONE_TYPE,
)  # fmt: skip
# a schema's value is one of these, or another schema's: keywords beside one are dropped
_COMBINING = ("anyOf", "oneOf", "allOf", "$ref")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = (
    "additionalProperties", "items", "then", "else", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "null": (type(None),), "array": (list,), "object": (dict,),
}  # fmt: skip
# an integer's multipleOf holds up to this step, and within bounds only on both sides, spanning
# at most _MULTIPLE_SPAN integers; elsewhere xgrammar drops it (with a warning)
_MULTIPLE_STEP = 1024
_MULTIPLE_SPAN = 10_000
_INT64 = 2**63
# escapes a JSON string's pattern may hold: xgrammar matches a pattern against the string as
# written in JSON, so one that names a quote, a backslash or a control character (`\x22`, `\n`)
# lets through what is no JSON, and one with a character past ASCII drops its exclusion of them
_SAFE_ESCAPES = frozenset("dDwWsSbB" + "".join(c for c in string.punctuation if c not in '"\\'))
# escapes xgrammar reads as the letter itself, with a warning: `\Z`, `\A` (Python's anchors), `\z`,
# `\h`, `\N{DASH}`, ...; `\U` but before 8 hex digits (`\U0001F600`: the code point)
_LETTER_ESCAPE = re.compile(r"\\(?:[ghijlmoqyzACEFGHIJKLMNOQRTVXYZ]|U(?![0-9a-fA-F]{8}))")
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def unenforced_keyword(schema: Any, path: str) -> str | None:
    """The first keyword of a JSON schema that xgrammar would not enforce, as `path/keyword` and
    why; None if there is none. The schema's nesting is bounded (MAX_SCHEMA_DEPTH)."""
    if not isinstance(schema, dict):
        return None
    if "$id" in schema and path != "#":  # xgrammar resolves references from the root's base
        return f"{path}/$id below the root"
    checks = (_combined, _unenforced_values, _of_strings, _of_numbers, _of_containers)
    if (found := next((f for check in checks if (f := check(schema))), None)) is not None:
        return f"{path}/{found}"
    children = [(f"{path}/{k}", schema[k]) for k in _SUBSCHEMA if k in schema]
    children += [
        (f"{path}/{k}/{i}", sub)
        for k in _SUBSCHEMAS
        if isinstance(schema.get(k), list)
        for i, sub in enumerate(schema[k])
    ]
    children += [
        (f"{path}/{k}/{name}", sub)
        for k in _SCHEMA_MAPS
        if isinstance(schema.get(k), dict)
        for name, sub in schema[k].items()
    ]
    return next((found for p, sub in children if (found := unenforced_keyword(sub, p))), None)


def _combined(schema: dict[str, Any]) -> str | None:
    """Keywords xgrammar never holds, or drops beside others; references it resolves wrongly."""
    if never := next((k for k in _NEVER if k in schema and schema[k] is not False), None):
        return never
    if empty := next((k for k in ("anyOf", "oneOf") if schema.get(k) == []), None):
        return f"{empty} of no schema (no value matches it)"
    holding = [k for k in _HOLDING if k in schema and not (k == "type" and _typed_alike(schema))]
    combining = [k for k in _COMBINING if k in schema]
    if len(combining) > 1 or (combining and holding):
        return f"{combining[0]} beside {(combining[1:] + holding)[0]}"
    if "type" not in schema and (untyped := [k for k in _OF_ONE_TYPE if k in schema]):
        return f"{untyped[0]} without a type"
    if "type" in schema and not _types(schema["type"]):
        return f"type {json.dumps(schema['type'])} naming no JSON type"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf of more than one schema"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return "$ref to other than a JSON pointer in this document"
    return None


def _typed_alike(schema: dict[str, Any]) -> bool:
    """Every branch of the schema's anyOf, oneOf or allOf names a type its own `type` allows
    (`{"type": "object", "anyOf": [{"type": "object", ...}, ...]}`): the type beside them,
    which xgrammar drops, says nothing more."""
    named = _types(schema.get("type"))
    branches = [b for k in ("anyOf", "oneOf", "allOf") for b in _list(schema.get(k))]
    return (
        named is not None
        and bool(branches)
        and all(isinstance(b, dict) and (own := _types(b.get("type"))) and own <= named
                for b in branches)
    )  # fmt: skip


def _types(named: Any) -> set[str] | None:
    """The JSON types a `type` keyword names; None if it names none xgrammar knows."""
    types = [named] if isinstance(named, str) else named
    if not isinstance(types, list) or not all(
        isinstance(t, str) and t in _JSON_TYPES for t in types
    ):
        return None
    return set(types)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _unenforced_values(schema: dict[str, Any]) -> str | None:
    """Why the values of `enum` or `const` would go out unchecked against the other keywords
    (xgrammar writes any of them): they are checked against `type` here, and refused beside any
    other; integers past 64 bits become doubles."""
    for key in ("enum", "const"):
        if key not in schema:
            continue
        if beside := [k for k in _HOLDING if k in schema and k not in (key, "type")]:
            return f"{key} beside {beside[0]}"
        values = [schema["const"]] if key == "const" else schema["enum"]
        if not isinstance(values, list):
            return None  # xgrammar refuses it
        if any(_has_big_int(value) for value in values):
            return f"{key} with an integer past 64 bits"
        types = _types(schema.get("type"))
        if types is None:
            continue  # no type, or one xgrammar refuses itself
        for value in values:
            if not any(_of_type(value, t) for t in types):
                named = json.dumps(schema["type"])
                return f"{key} value {json.dumps(value)} is not of type {named}"
    return None


def _of_strings(schema: dict[str, Any]) -> str | None:
    beside_format = [k for k in ("pattern", "minLength", "maxLength") if k in schema]
    if "format" in schema and beside_format:
        return f"format beside {beside_format[0]}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return "pattern with minLength or maxLength"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        if repeats_past_limit(pattern):
            return f"pattern: a repetition count past {MAX_COUNT}"
        if (found := too_costly(pattern)) is not None:
            return f"pattern: {found}"
        if (found := _unsafe_in_pattern(pattern)) is not None:
            return f"pattern: {found} in a JSON string's pattern"
        if (found := misread_in_regex(pattern)) is not None:
            return f"pattern: {found}"
    return None


def misread_in_regex(pattern: str) -> str | None:
    """What xgrammar reads otherwise than Python in a regex: an escape it reads as a letter, `^`
    where text may come before it or `$` where text may follow (it ignores them there: Python's
    `a^b` matches nothing, xgrammar's "ab"); None if nothing."""
    i = 0
    while (i := pattern.find("\\", i)) >= 0:
        if _LETTER_ESCAPE.match(pattern, i):
            return f"the escape {pattern[i : i + 2]}, which xgrammar reads as its letter"
        i += 2
    try:
        parsed = sre_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):  # xgrammar's own error, or its own reading
        return None
    return _misread_anchor(parsed, text_before=False, text_after=False)


def _misread_anchor(sequence: Any, text_before: bool, text_after: bool) -> str | None:
    """An anchor of Python's parsed sequence that text may come before (`^`) or after (`$`),
    given whether text may come before and after the sequence."""
    items = list(sequence)
    widths = [sre_parser.SubPattern(sequence.state, [item]).getwidth()[1] for item in items]
    for i, (op, value) in enumerate(items):
        before, after = text_before or any(widths[:i]), text_after or any(widths[i + 1 :])
        inner: list[tuple[Any, bool, bool]] = []
        if op is sre.AT and value is sre.AT_BEGINNING and before:
            return "^ where text may come before it (xgrammar ignores it there)"
        if op is sre.AT and value is sre.AT_END and after:
            return "$ where text may follow it (xgrammar ignores it there)"
        if op is sre.BRANCH:
            inner = [(option, before, after) for option in value[1]]
        elif op is sre.SUBPATTERN:
            inner = [(value[3], before, after)]
        elif op is sre.ATOMIC_GROUP:
            inner = [(value, before, after)]
        elif op in _REPEATS:
            again = value[1] > 1 and widths[i] > 0  # the other copies come before and after
            inner = [(value[2], before or again, after or again)]
        for part, part_before, part_after in inner:
            if (found := _misread_anchor(part, part_before, part_after)) is not None:
                return found
    return None


def _of_numbers(schema: dict[str, Any]) -> str | None:
    if "multipleOf" not in schema:
        return None
    step = schema["multipleOf"]
    if not (schema.get("type") == "integer" and isinstance(step, int)):
        return "multipleOf (on other than an integer's)"
    if step > _MULTIPLE_STEP:
        return f"multipleOf past {_MULTIPLE_STEP}"
    low = _bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", -1)
    if (low is None) != (high is None):
        return "multipleOf with a bound on one side only"
    if low is not None and high is not None and high - low + 1 > _MULTIPLE_SPAN:
        return f"multipleOf within bounds spanning over {_MULTIPLE_SPAN} integers"
    return None


def _of_containers(schema: dict[str, Any]) -> str | None:
    for key in _COUNTS:
        count = schema.get(key)
        if isinstance(count, int) and count > MAX_COUNT:
            return f"{key} past {MAX_COUNT}"
    # a name written twice counts twice
    if "minProperties" in schema and any(
        schema.get(k, False) is not False for k in ("additionalProperties", "unevaluatedProperties")
    ):
        return "minProperties where other properties are allowed"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list):
        for name in schema["required"]:
            # then never enforced, nor at times allowed (a name that is no string: xgrammar's error)
            if isinstance(name, str) and name not in properties:
                return f"required {json.dumps(name)} outside its properties"
    return None


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, inward: int) -> float | None:
    """The integers' bound on one side (the tighter if both keywords are there); None if none."""
    bounds = [schema[inclusive]] if isinstance(schema.get(inclusive), (int, float)) else []
    if isinstance(schema.get(exclusive), (int, float)):
        bounds.append(schema[exclusive] + inward)
    if not bounds:
        return None
    return max(bounds) if inward > 0 else min(bounds)


def _unsafe_in_pattern(pattern: str) -> str | None:
    """A character or escape of a pattern that names what JSON writes escaped, or is past ASCII;
    None if there is none."""
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escaped = pattern[i + 1 : i + 2]
            if escaped not in _SAFE_ESCAPES:
                return f"the escape {json.dumps(chr(92) + escaped)}"
            i += 2
            continue
        if char == '"' or not " " <= char <= "~":
            return f"the character {json.dumps(char)}"
        i += 1
    return None


def _has_big_int(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_big_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_big_int(v) for v in value.values())
    return isinstance(value, int) and not -_INT64 <= value < _INT64


def _of_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[name])


def repeats_past_limit(text: str, ebnf: bool = False) -> bool:
    """A repetition count (`{n}`, `{n,}`, `{n,m}`) of a regex or, with `ebnf`, an EBNF grammar is
    past MAX_COUNT. Escapes and character classes are skipped, and in EBNF strings and comments."""
    i, closer = 0, None  # closer: the character that ends the class, string or comment we are in
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if closer is not None:
            closer = None if char == closer else closer
        elif char == "[":
            closer = "]"
        elif ebnf and char in '"#':
            closer = '"' if char == '"' else "\n"
        elif char == "{" and (match := COUNT.match(text, i)):
            # the length first: int() refuses a string of over 4,300 digits
            if any(n and (len(n) > 10 or int(n) > MAX_COUNT) for n in (match[1], match[3])):
                return True
            i = match.end()
            continue
        i += 1
    return False
