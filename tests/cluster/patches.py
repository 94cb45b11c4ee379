"""PATCH bodies as the API server applies them, by Content-Type:
- `application/merge-patch+json` (and plain JSON): RFC 7386 (objects.merge_patch);
- `application/json-patch+json`: RFC 6902 operations (add, remove, replace, test, move, copy);
- `application/strategic-merge-patch+json` (what `kubectl apply`, `label`, `annotate` send for
  built-in kinds): a merge patch in which a list whose schema says `x-kubernetes-patch-strategy:
  merge` merges element by element on its `x-kubernetes-patch-merge-key` (containers by name,
  env by name, ...), with the `$patch: delete`/`replace` directives, `$deleteFromPrimitiveList/F`
  and `$setElementOrder/F`; the schema is Kubernetes' own (discovery.definitions).
- `application/apply-patch+yaml` (`kubectl apply --server-side`): server-side apply. The applied
  configuration is merged into the object (maps field by field, lists of `x-kubernetes-list-type:
  map` element by element on their keys, every other list whole); the fields it sets become its
  field manager's, recorded in `metadata.managedFields` (FieldsV1, operation Apply). A field the
  manager set before and no longer sets is removed unless another manager owns it too; a field
  another manager owns with a different value is a 409 Conflict unless `force=true`, which takes it.
  A PATCH of an object that does not exist creates it (apiserver.py).
Not modelled: `$retainKeys`; managedFields entries for operations other than Apply.
"""

from __future__ import annotations

import copy
import json

from .discovery import definitions
from .objects import ApiError, merge_patch, now_text

MERGE, JSON_PATCH, STRATEGIC = "application/merge-patch+json", "application/json-patch+json", "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


def is_apply(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip() == APPLY


def apply_patch(content_type: str, target: dict, patch, kind: str, query: dict | None = None) -> dict:
    """The patched object; `query`: the request's (server-side apply's fieldManager and force)."""
    content_type = (content_type or MERGE).split(";")[0].strip()
    if content_type == APPLY:
        query = query or {}
        return server_side_apply(target, patch, kind, query.get("fieldManager"), str(query.get("force")).lower() == "true")
    if content_type in (MERGE, "application/json"):
        return merge_patch(target, patch)
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if content_type == STRATEGIC:
        return strategic_merge(target, patch, _kind_schema(kind))
    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types "
                                                f"include: {JSON_PATCH}, {MERGE}, {APPLY}, {STRATEGIC}")


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


# -- server-side apply ------------------------------------------------------------------------------
# A field is a path of FieldsV1 keys: `f:NAME` for a map's field, `k:{"KEY":VALUE}` for an element of
# a list-map. Paths end at a value that is not merged further (a scalar, an atomic list, an empty map).
UNOWNED = {("f:apiVersion",), ("f:kind",), ("f:status",)}
SERVER_METADATA = {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                   "deletionGracePeriodSeconds", "managedFields", "selfLink"}


def server_side_apply(live: dict | None, applied, kind: str, manager: str | None, force: bool) -> dict:
    """`live` (None: the object is created) with `applied` applied by `manager` (see the module's doc)."""
    if not manager:
        raise ApiError(400, "BadRequest", "PATCH with apply requires a fieldManager: name it in the fieldManager query parameter")
    if not isinstance(applied, dict):
        raise ApiError(400, "BadRequest", "an apply patch must be an object")
    schema, live = _resolve(_kind_schema(kind)), live or {}
    fields = _fields(applied, schema)
    entries = [e for e in (live.get("metadata") or {}).get("managedFields") or [] if e.get("manager")]
    before = next((_paths(e.get("fieldsV1")) for e in entries if e["manager"] == manager and e.get("operation") == "Apply"), set())
    others = {e["manager"]: _paths(e.get("fieldsV1")) for e in entries if e["manager"] != manager}
    # A value differs: a conflict. An element of a list-map is no value of its own: both may own it.
    clashes = {m: sorted(p for p in owned & fields if not p[-1].startswith("k:") and _value(live, p) != _value(applied, p))
               for m, owned in others.items()}
    clashes = {m: paths for m, paths in clashes.items() if paths}
    if clashes and not force:
        told = "; ".join(f'conflict with "{m}": {", ".join(_dotted(p) for p in paths)}' for m, paths in clashes.items())
        raise ApiError(409, "Conflict", f"Apply failed with {sum(map(len, clashes.values()))} conflict(s): {told}")
    others = {m: owned - set(clashes.get(m, ())) for m, owned in others.items()}  # forced: the applier takes what clashed
    result = _apply_map(live, applied, schema)
    kept = set().union(fields, *others.values())
    for path in sorted(before - fields, key=len):  # an element before its fields
        if not any(owned[:len(path)] == path for owned in kept):
            _remove(result, path, kept)
    if before == fields and not clashes and _unmanaged(result) == _unmanaged(live):
        return result  # nothing changed: the managers' entries (and their times) neither
    managed = [e for e in entries if e["manager"] != manager and others.get(e["manager"])]
    for e in managed:
        e["fieldsV1"] = _tree(others[e["manager"]])
    managed.append({"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion", live.get("apiVersion", "v1")),
                    "time": now_text(), "fieldsType": "FieldsV1", "fieldsV1": _tree(fields)})
    result.setdefault("metadata", {})["managedFields"] = managed
    return result


def _unmanaged(obj: dict) -> dict:
    return {**obj, "metadata": {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}}


def _list_keys(schema: dict | None) -> list[str]:
    schema = schema or {}
    if schema.get("x-kubernetes-list-type") == "map":
        return list(schema.get("x-kubernetes-list-map-keys") or [])
    merge_key = schema.get("x-kubernetes-patch-merge-key")
    return [merge_key] if merge_key and schema.get("x-kubernetes-list-type") != "atomic" else []


def _element_key(item: dict, keys: list[str]) -> str:
    return "k:" + json.dumps({k: item[k] for k in keys if k in item}, separators=(",", ":"), sort_keys=True)


def _field_schema(schema: dict | None, key: str) -> dict | None:
    schema = schema or {}
    if schema.get("properties"):
        return _resolve(schema["properties"].get(key))
    return _resolve(schema.get("additionalProperties"))


def _fields(obj: dict, schema: dict | None, prefix: tuple = ()) -> set[tuple]:
    paths: set[tuple] = set()
    for key, value in obj.items():
        path = (*prefix, f"f:{key}")
        if path in UNOWNED or (prefix == ("f:metadata",) and key in SERVER_METADATA):
            continue
        field_schema = _field_schema(schema, key)
        keys = _list_keys(field_schema)
        if isinstance(value, dict) and value:
            paths |= _fields(value, field_schema, path)
        elif isinstance(value, list) and keys and all(isinstance(item, dict) for item in value):
            item_schema = _resolve((field_schema or {}).get("items"))
            for item in value:
                element = (*path, _element_key(item, keys))
                paths |= {element} | _fields(item, item_schema, element)
        else:
            paths.add(path)
    return paths


def _apply_map(live: dict, applied: dict, schema: dict | None) -> dict:
    result = copy.deepcopy(live)
    for key, value in applied.items():
        field_schema = _field_schema(schema, key)
        keys = _list_keys(field_schema)
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _apply_map(result[key], value, field_schema)
        elif isinstance(value, list) and keys and isinstance(result.get(key), list):
            item_schema = _resolve((field_schema or {}).get("items"))
            merged = list(result[key])
            for item in value:
                index = next((i for i, old in enumerate(merged) if isinstance(old, dict) and isinstance(item, dict)
                              and _element_key(old, keys) == _element_key(item, keys)), None)
                if index is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[index] = _apply_map(merged[index], item, item_schema)
            result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


_MISSING = object()


def _step(node, part: str):
    if isinstance(node, dict) and part.startswith("f:"):
        return node.get(part[2:], _MISSING)
    if isinstance(node, list) and part.startswith("k:"):
        wanted = json.loads(part[2:])
        return next((item for item in node if isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items())), _MISSING)
    return _MISSING


def _value(obj, path: tuple):
    for part in path:
        obj = _step(obj, part)
        if obj is _MISSING:
            return _MISSING
    return obj


def _remove(obj, path: tuple, kept: set[tuple]) -> None:
    """The field at `path` removed, and the maps and lists it leaves empty that no field in `kept` lies under."""
    parent = _value(obj, path[:-1])
    child = _step(parent, path[-1]) if parent is not _MISSING else _MISSING
    if child is _MISSING:
        return
    if isinstance(parent, dict):
        parent.pop(path[-1][2:], None)
    else:
        parent.remove(child)
    if len(path) > 1 and not parent and not any(owned[:len(path) - 1] == path[:-1] for owned in kept):
        _remove(obj, path[:-1], kept)


def _tree(paths: set[tuple]) -> dict:
    """Paths as FieldsV1: nested maps; an element of a list-map carries `.` for itself."""
    tree: dict = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        if path[-1].startswith("k:"):
            node["."] = {}
    return tree


def _paths(tree: dict | None, prefix: tuple = ()) -> set[tuple]:
    paths: set[tuple] = set()
    for part, sub in (tree or {}).items():
        if part == ".":
            paths.add(prefix)
        elif sub:
            paths |= _paths(sub, (*prefix, part))
        else:
            paths.add((*prefix, part))
    return paths


def _dotted(path: tuple) -> str:
    return "".join(f".{p[2:]}" if p.startswith("f:") else f"[{p[2:]}]" for p in path)
