"""What xgrammar (0.2.9) would compile into a grammar without holding the output to it: each rule
here was found with an output that breaks the constraint and that the grammar lets through. Such a
constraint is refused (a ValueError, a 400 to a client), as vLLM's xgrammar backend refuses some."""

import json
import re
from typing import Any

# xgrammar reads a larger count modulo 2^32: `a{4294967297}` matches "a", maxItems 2^32+1 allows 0
MAX_COUNT = 2**31 - 1
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# keywords xgrammar compiles but never enforces; vLLM's xgrammar backend refuses them too
_NEVER = (
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "dependentRequired",
    "dependentSchemas", "dependencies",
)  # fmt: skip
# a keyword that holds its type's values, dropped where a schema names no type
_OF_ONE_TYPE = (
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties",
)  # fmt: skip
_HOLDING = (
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "unevaluatedProperties", "items", "prefixItems",
    "unevaluatedItems", *_OF_ONE_TYPE,
)  # fmt: skip
# a schema's value is one of these, or another schema's: keywords beside one are dropped
_COMBINING = ("anyOf", "oneOf", "allOf", "$ref")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = (
    "additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "null": (type(None),), "array": (list,), "object": (dict,),
}  # fmt: skip
_REPETITION = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def unenforced_keyword(schema: Any, path: str) -> str | None:
    """The first keyword of a JSON schema that xgrammar would not enforce, as `path/keyword` and
    why; None if there is none. The schema's nesting is bounded (MAX_SCHEMA_DEPTH)."""
    if not isinstance(schema, dict):
        return None
    found = _unenforced_here(schema, path)
    if found is not None:
        return found
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


def _unenforced_here(schema: dict[str, Any], path: str) -> str | None:
    """As unenforced_keyword, for the schema's own keywords (not its subschemas')."""
    if never := next((k for k in _NEVER if k in schema and schema[k] is not False), None):
        return f"{path}/{never}"
    holding = [k for k in _HOLDING if k in schema]
    combining = [k for k in _COMBINING if k in schema]
    if len(combining) > 1 or (combining and holding):
        return f"{path}/{combining[0]} beside {(combining[1:] + holding)[0]}"
    for key in ("enum", "const"):
        if key in schema and (found := _unenforced_values(schema, key, holding)) is not None:
            return f"{path}/{key} {found}"
    if "type" not in schema and (untyped := [k for k in _OF_ONE_TYPE if k in schema]):
        return f"{path}/{untyped[0]} without a type"
    for key in _COUNTS:
        count = schema.get(key)
        if isinstance(count, int) and count > MAX_COUNT:
            return f"{path}/{key} past {MAX_COUNT}"
    patterns = [("pattern", schema.get("pattern"))]
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [(f"patternProperties {json.dumps(p)}", p) for p in schema["patternProperties"]]
    for key, pattern in patterns:
        if isinstance(pattern, str) and repeats_past_limit(pattern):
            return f"{path}/{key}: a repetition count past {MAX_COUNT}"
    if "multipleOf" in schema and not (
        schema.get("type") == "integer" and isinstance(schema["multipleOf"], int)
    ):
        return f"{path}/multipleOf (on other than an integer's)"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"{path}/pattern with minLength or maxLength"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{path}/$ref to another document"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}/allOf of more than one schema"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list):
        for name in schema["required"]:
            # then never enforced, nor at times allowed (a name that is no string: xgrammar's error)
            if isinstance(name, str) and name not in properties:
                return f"{path}/required {json.dumps(name)} outside its properties"
    return None


def _unenforced_values(schema: dict[str, Any], key: str, holding: list[str]) -> str | None:
    """Why the values of `enum` or `const` would go out unchecked against the other keywords
    (xgrammar writes any of them): they are checked against `type` here, and refused beside any
    other; None if they hold."""
    beside = [k for k in holding if k not in (key, "type")]
    if beside:
        return f"beside {beside[0]}"
    named = schema.get("type")
    types = [named] if isinstance(named, str) else named
    if not isinstance(types, list) or not all(t in _JSON_TYPES for t in types):
        return None  # no type, or one xgrammar refuses itself
    values = [schema["const"]] if key == "const" else schema["enum"]
    if not isinstance(values, list):
        return None  # xgrammar refuses it
    for value in values:
        if not any(_of_type(value, t) for t in types):
            return f"value {json.dumps(value)} is not of type {json.dumps(named)}"
    return None


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
        elif char == "{" and (match := _REPETITION.match(text, i)):
            # the length first: int() refuses a string of over 4,300 digits
            if any(n and (len(n) > 10 or int(n) > MAX_COUNT) for n in match.groups()):
                return True
            i = match.end()
            continue
        i += 1
    return False
