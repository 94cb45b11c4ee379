"""PATCH bodies as the API server applies them, by Content-Type:
- `application/merge-patch+json` (and plain JSON): RFC 7386 (objects.merge_patch);
- `application/json-patch+json`: RFC 6902 operations (add, remove, replace, test, move, copy);
- `application/strategic-merge-patch+json` (what `kubectl apply`, `label`, `annotate` send for
  built-in kinds): a merge patch in which a list whose schema says `x-kubernetes-patch-strategy:
  merge` merges element by element on its `x-kubernetes-patch-merge-key` (containers by name,
  env by name, ...), with the `$patch: delete`/`replace` directives, `$deleteFromPrimitiveList/F`
  and `$setElementOrder/F`; the schema is Kubernetes' own (discovery.definitions).
Not modelled: `$retainKeys`, server-side apply (`application/apply-patch+yaml`: 415).
"""

from __future__ import annotations

import copy

from .discovery import definitions
from .objects import ApiError, merge_patch

MERGE, JSON_PATCH, STRATEGIC = "application/merge-patch+json", "application/json-patch+json", "application/strategic-merge-patch+json"


def apply_patch(content_type: str, target: dict, patch, kind: str) -> dict:
    content_type = (content_type or MERGE).split(";")[0].strip()
    if content_type in (MERGE, "application/json"):
        return merge_patch(target, patch)
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if content_type == STRATEGIC:
        return strategic_merge(target, patch, _kind_schema(kind))
    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types "
                                                f"include: {JSON_PATCH}, {MERGE}, {STRATEGIC}")


def _kind_schema(kind: str) -> dict | None:
    for schema in definitions().values():
        if any(g.get("kind") == kind for g in schema.get("x-kubernetes-group-version-kind") or []):
            return schema
    return None  # a custom resource: strategic merge is refused for it by the real server too


def _resolve(schema: dict | None) -> dict | None:
    while schema and "$ref" in schema:
        schema = definitions().get(schema["$ref"].rsplit("/", 1)[-1])
    return schema


def strategic_merge(target, patch, schema: dict | None):
    if schema is None and isinstance(patch, dict):
        raise ApiError(415, "UnsupportedMediaType", "strategic merge patch format is not supported for this kind")
    return _merge_map(target if isinstance(target, dict) else {}, patch, _resolve(schema))


def _merge_map(target: dict, patch: dict, schema: dict | None) -> dict:
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return {}
    result = dict(target)
    properties = (schema or {}).get("properties") or {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key == "$retainKeys":
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
            continue
        field_schema = _resolve(properties.get(key))
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            item_schema = _resolve((field_schema or {}).get("additionalProperties")) if not (field_schema or {}).get("properties") else field_schema
            result[key] = _merge_map(result[key], value, item_schema)
        elif isinstance(value, list) and (field_schema or {}).get("x-kubernetes-patch-strategy", "").startswith("merge"):
            result[key] = _merge_list(result.get(key) or [], value, field_schema)
        else:
            result[key] = copy.deepcopy(value) if not isinstance(value, dict) else _merge_map({}, value, field_schema)
    return result


def _merge_list(target: list, patch: list, schema: dict) -> list:
    merge_key = schema.get("x-kubernetes-patch-merge-key")
    if not merge_key:  # a list of primitives merged as a set
        return list(dict.fromkeys([*target, *[v for v in patch if not isinstance(v, dict)]]))
    item_schema = _resolve(schema.get("items"))
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        index = next((i for i, old in enumerate(result) if old.get(merge_key) == item.get(merge_key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(_merge_map({}, item, item_schema))
        else:
            result[index] = _merge_map(result[index], item, item_schema)
    return result


def json_patch(target: dict, operations: list) -> dict:
    doc = copy.deepcopy(target)
    if not isinstance(operations, list):
        raise ApiError(400, "BadRequest", "a JSON patch is a list of operations")
    for operation in operations:
        op, path = operation.get("op"), operation.get("path", "")
        if op in ("add", "replace", "test"):
            value = copy.deepcopy(operation.get("value"))
        elif op in ("move", "copy"):
            parent, last = _locate(doc, operation.get("from", ""))
            value = copy.deepcopy(parent[last])
            if op == "move":
                doc = _apply(doc, "remove", operation["from"], None)
        if op == "test":
            parent, last = _locate(doc, path)
            if parent[last] != value:
                raise ApiError(422, "Invalid", f"the test operation failed at {path}")
            continue
        doc = _apply(doc, "add" if op in ("move", "copy") else op, path, value if op != "remove" else None)
    return doc


def _locate(doc, path: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    node = doc
    try:
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
    except (KeyError, IndexError, ValueError):
        raise ApiError(422, "Invalid", f"the path {path} does not exist") from None
    last = parts[-1] if parts else ""
    return node, (int(last) if isinstance(node, list) and last != "-" else last)


def _apply(doc, op: str, path: str, value):
    parent, last = _locate(doc, path)
    try:
        if op == "remove":
            del parent[last]
        elif op == "replace":
            if not isinstance(parent, list) and last not in parent:
                raise KeyError(last)
            parent[last] = value
        elif isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else last, value)
        else:
            parent[last] = value
    except (KeyError, IndexError):
        raise ApiError(422, "Invalid", f"the path {path} does not exist") from None
    return doc
