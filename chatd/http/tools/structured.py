"""Structured output as clients ask for it: OpenAI's `response_format` (chat) and `text.format`
(Responses), and vLLM's extras (`structured_outputs`, and the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`), each made into the engine's StructuredOutput.

Only shapes are checked here; whether a schema or grammar compiles is the engine's answer
(`EngineClient.check_structured`), given off the event loop before anything is queued. A schema's
size and depth are measured before anything walks it in Python: orjson first (C speed), then a walk
without recursion, so a deep one is a 400 that names its field, never a RecursionError.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from chatd.engine import StructuredOutput
from chatd.http.errors import APIError, shown

# A schema is compiled per request (then cached); a bigger one is almost surely a mistake.
MAX_SCHEMA_BYTES = 64 * 1024
# Levels of objects and lists a schema may nest. Real ones nest a few (a pydantic model ten models
# deep is ~25); llguidance refuses JSON nested past ~128, and a tool's parameters get two levels
# more around them in the call grammar.
MAX_SCHEMA_DEPTH = 64
# orjson reads 1,024 levels but writes at most 254: a value nested deeper cannot be measured by it.
ORJSON_MAX_DEPTH = 254
ORJSON_MAX_READ_DEPTH = 1024
MAX_FORMAT_NAME_CHARS = 64
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]+")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
EXTRA_FIELDS = {"structured_outputs", *GUIDED_FIELDS}


def response_format(value: Any) -> StructuredOutput | None:
    """Chat's `response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
    if value is None:
        return None
    fmt = _object(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    if kind == "json_schema":
        inner = _object(fmt.get("json_schema"), "response_format.json_schema")
        return _json_schema(inner, "response_format.json_schema")
    raise APIError(400, f"response_format.type must be one of text, json_object, json_schema; got {shown(kind)}",
                   "response_format.type")


def text_format(text: Any) -> StructuredOutput | None:
    """Responses' `text.format`: the same kinds as response_format, with json_schema's fields inline."""
    if text is None:
        return None
    fmt = _object(text, "text").get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    # The response repeats text.format: a field chatd would store and echo unread is refused instead.
    unknown = sorted(set(fmt) - (_TEXT_FORMAT_FIELDS if kind == "json_schema" else {"type"}))
    if unknown and kind in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text.format of type {shown(kind)} has fields chatd does not know: {', '.join(unknown)}",
                       f"text.format.{unknown[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, param="text.format")
    if kind == "json_schema":
        return _json_schema(fmt, "text.format")
    raise APIError(400, f"text.format.type must be one of text, json_object, json_schema; got {shown(kind)}",
                   "text.format.type")


_TEXT_FORMAT_FIELDS = {"type", "name", "schema", "strict", "description"}


def extras(body: dict) -> StructuredOutput | None:
    """chatd's (vLLM's) extensions: `structured_outputs` {json | regex | choice | grammar | json_object},
    or one of `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""
    given = [name for name in (*GUIDED_FIELDS, "structured_outputs") if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "structured_outputs":
        spec = _object(value, name)
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k) not in (None, False)]
        unknown = sorted(set(spec) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise APIError(400, f"{name} has fields chatd does not know: {', '.join(unknown)}", f"{name}.{unknown[0]}")
        if len(kinds) != 1:
            raise APIError(400, f"{name} must give exactly one of json, regex, choice, grammar, json_object", name)
        kind, value, name = kinds[0], spec[kinds[0]], f"{name}.{kinds[0]}"
    else:
        kind = name.removeprefix("guided_")
    if kind == "json_object":
        return StructuredOutput(json_object=True, param=name)
    if kind == "json":
        return StructuredOutput(json_schema=_schema_text(value, name), param=name)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise APIError(400, f"{name} must be a non-empty list of non-empty strings", name)
        return StructuredOutput(choice=tuple(value), param=name)
    if not (isinstance(value, str) and value):
        raise APIError(400, f"{name} must be a non-empty string", name)
    if len(value) > MAX_SCHEMA_BYTES:
        raise APIError(400, f"{name} has {len(value)} characters; the limit is {MAX_SCHEMA_BYTES}", name)
    return StructuredOutput(regex=value, param=name) if kind == "regex" else StructuredOutput(grammar=value, param=name)


def check_name(name: Any, where: str) -> str:
    """A format's or a function's name, as OpenAI allows them: 1 to 64 of a-z, A-Z, 0-9, _ and -."""
    if not (isinstance(name, str) and _FORMAT_NAME.fullmatch(name) and len(name) <= MAX_FORMAT_NAME_CHARS):
        raise APIError(400, f"{where} must be 1 to {MAX_FORMAT_NAME_CHARS} characters of a-z, A-Z, 0-9, _ and -; "
                            f"got {shown(name)}", where)
    return name


def _json_schema(fmt: dict, where: str) -> StructuredOutput:
    check_name(fmt.get("name"), f"{where}.name")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict must be a boolean", f"{where}.strict")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", f"{where}.description")
    if fmt.get("schema") is None:
        raise APIError(400, f"{where}.schema is required", f"{where}.schema")
    # strict or not, chatd enforces the schema token by token: the output always validates.
    return StructuredOutput(json_schema=_schema_text(fmt["schema"], f"{where}.schema"), param=f"{where}.schema")


def schema_length(schema: Any, where: str) -> int:
    """A schema's length as JSON, measured by orjson (C speed, before any walk in Python); 400 naming
    `where` past MAX_SCHEMA_BYTES, or nested past what orjson writes."""
    try:
        length = len(orjson.dumps(schema))
    except orjson.JSONEncodeError:  # what orjson read it writes back, except nesting past its limit
        raise APIError(400, f"{where} nests more than {ORJSON_MAX_DEPTH} levels deep; the limit is {MAX_SCHEMA_DEPTH}",
                       where) from None
    if length > MAX_SCHEMA_BYTES:
        raise APIError(400, f"{where} takes {length} bytes as JSON; the limit is {MAX_SCHEMA_BYTES}", where)
    return length


def check_schema_depth(schema: Any, where: str) -> None:
    """400 naming `where` if a schema nests more than MAX_SCHEMA_DEPTH levels: checked before
    anything recursive (closed(), the grammar compiler) walks it."""
    depth = json_depth(schema, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise APIError(400, f"{where} nests more than {MAX_SCHEMA_DEPTH} levels of objects and lists; "
                            f"the limit is {MAX_SCHEMA_DEPTH}", where)


def json_depth(value: Any, limit: int) -> int:
    """How many levels of objects and lists a JSON value nests, walked with a stack of its own (no
    recursion); the walk stops past `limit` and returns limit + 1."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _schema_text(schema: Any, where: str) -> str:
    """A JSON schema (an object, or JSON text of one) as compact JSON text, its size and depth checked."""
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            if "depth" in str(exc):  # orjson stops reading at its own limit
                raise APIError(400, f"{where} nests more than {ORJSON_MAX_READ_DEPTH} levels deep; the limit is "
                                    f"{MAX_SCHEMA_DEPTH}", where) from None
            raise APIError(400, f"{where} is not valid JSON: {exc}", where) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON schema object", where)
    schema_length(schema, where)
    check_schema_depth(schema, where)
    text = orjson.dumps(closed(schema)).decode()  # key order kept: it is the order properties are written in
    if len(text) > MAX_SCHEMA_BYTES:
        raise APIError(400, f"{where} takes {len(text)} bytes as JSON; the limit is {MAX_SCHEMA_BYTES}", where)
    return text


# Keywords whose value is one schema, a map of schemas, or a list of schemas.
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: closed parts of an allOf could never all hold


def closed(schema: Any) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others closed
    (`additionalProperties: false`), as vLLM's xgrammar backend does: a model is never led to
    invent keys the schema did not ask for (and a weak one would invent them forever). It recurses
    once a level: callers check the depth first (check_schema_depth)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(value) for name, value in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(value) for value in out[key]]
    return out


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise APIError(400, f"{where} must be an object", where)
    return value
