"""JSON-schema constructs the grammar would not enforce: refused by name instead of ignored.

xgrammar turns a JSON schema into a grammar, but some keywords it drops or only approximates, so
an accepted schema could yield output that violates it (issue 49, attack item 8: a `required` name
with no `properties` entry produced `{}`, `{"not": {}}` a number). A schema using one of them is
refused with the construct and where it is (`invalid json_schema: ...`, a 400 at the gateway).
"""

from __future__ import annotations

from typing import Any

# Keywords whose meaning the grammar does not carry.
_NOT_ENFORCED = {
    "not": "'not' (a schema the output must fail) is not enforced",
    "if": "'if'/'then'/'else' are not enforced",
    "dependentRequired": "'dependentRequired' is not enforced",
    "dependentSchemas": "'dependentSchemas' is not enforced",
    "dependencies": "'dependencies' is not enforced",
}
# Keywords holding one subschema, and those holding a map or a list of them.
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "then", "else")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced_construct(schema: Any) -> str | None:
    """Why `schema` cannot be enforced as written (naming the construct and its path), or None."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, why in _NOT_ENFORCED.items():
            if key in node:
                return f"{why} (at {path}/{key})"
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and not node[key]:
                return f"an empty '{key}' admits nothing (at {path}/{key})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of more than one schema is not enforced (at {path}/allOf): merge them into one"
        required = node.get("required")
        if isinstance(required, list):
            properties = node.get("properties")
            declared: dict[str, Any] = properties if isinstance(properties, dict) else {}
            missing = [name for name in required if name not in declared]
            if missing:
                return (f"required property {missing[0]!r} has no entry in 'properties' (at {path}/required): "
                        "declare its schema")
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}"))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key]))
    return None
