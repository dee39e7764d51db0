"""tool_choice "required" or a named function: the output is constrained by a JSON schema so that
it is a call, whatever the model would rather write. The constrained output is plain JSON, not
the family's format: for a named function its arguments, for "required" the calls themselves."""

from __future__ import annotations

import json

from candelabra.core.server.tool_calls.calls import Parsed, ToolCall, call_from_object
from candelabra.core.server.tool_calls.family import ToolCallParser

ANY_OBJECT = {"type": "object"}
# Keywords whose value is one subschema, or a list or a name-keyed map of them.
_SUBSCHEMA = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
# What an object schema may say of keys beyond its `properties` (an `allOf` may list more of them).
_OTHER_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf"})


def arguments_schema(tool: dict) -> dict:
    """The tool's parameters as the constraint of a forced call's arguments, each object that lists
    its properties closed to others unless the schema says otherwise: the arguments go to a
    function, which takes the parameters it declares. Left open, a small model forced to call a tool
    it has no use for fills the object with keys of its own (`get_time(city=..., arguments=...)`)."""
    return closed_objects(tool["function"].get("parameters") or ANY_OBJECT)


def closed_objects(schema):
    """`schema` with `additionalProperties: false` added to every object schema that has `properties`
    and says nothing of other keys (no `additionalProperties`, `patternProperties` or
    `unevaluatedProperties`). The branches of an `allOf` are left as they are: each names only part
    of the object's keys."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(branch) for branch in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    if isinstance(closed.get("properties"), dict) and not _OTHER_KEYS & closed.keys():
        closed["additionalProperties"] = False
    return closed


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """One call (parallel false) or a list of at least one, each naming an offered tool with
    arguments that fit that tool's parameters."""
    one_call = {"anyOf": [
        {"type": "object",
         "properties": {"name": {"const": tool["function"]["name"]}, "arguments": arguments_schema(tool)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for tool in tools]}
    return {"type": "array", "items": one_call, "minItems": 1} if parallel else one_call


class NamedCallParser(ToolCallParser):
    """The output is the named function's arguments; text that is no JSON object stays text."""

    def __init__(self, tool_names, name: str) -> None:
        super().__init__(tool_names)
        self.name = name

    def parse(self, text: str) -> Parsed:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return Parsed(text)
        if not isinstance(arguments, dict):
            return Parsed(text)
        return Parsed("", [ToolCall(self.name, json.dumps(arguments, ensure_ascii=False))])

    def settled(self, text: str) -> int:
        return 0


class RequiredCallsParser(ToolCallParser):
    """The output is one call object or a list of them, as `required_schema` asks."""

    def parse(self, text: str) -> Parsed:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return Parsed(text)
        calls = [call_from_object(v, self.tool_names) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return Parsed(text)
        return Parsed("", calls)

    def settled(self, text: str) -> int:
        return 0
