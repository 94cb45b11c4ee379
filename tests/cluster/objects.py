"""The API server stand-in's objects: the store (objects, watch history, the resourceVersion
clock), `Status` errors, label (labels.py) and field selectors, JSON merge patches."""

from __future__ import annotations

import copy
import datetime
import threading

from .labels import SelectorError, selector_matches


def now_text(after_s: float = 0) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=after_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details or {}, "code": code}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.body = status_body(code, reason, message, details)


def not_found(plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})


def label_matches(labels: dict | None, selector: str | None) -> bool:
    """Equality- and set-based selectors (labels.py); one that does not parse is a 400."""
    try:
        return selector_matches(labels, selector)
    except SelectorError as exc:
        raise ApiError(400, "BadRequest", str(exc)) from None


def field_matches(obj: dict, selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        negate = "!=" in term
        path, value = term.split("!=" if negate else "=", 1)
        current = obj
        for part in path.strip().lstrip("=").split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if ((current or "") == value) == negate:
            return False
    return True


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class Store:
    """Objects, their history (for watches) and the resourceVersion clock. One lock for all."""

    def __init__(self):
        self.cond = threading.Condition()
        self.rv = 1000
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.history: list[tuple[int, str, str, str, dict]] = []  # (rv, plural, namespace, type, object)
        self.oldest_rv = 0  # a watch from before this is 410 Gone
        self.generation = 0  # bumped to drop every open watch connection

    def commit(self, kind: str, plural: str, obj: dict) -> dict:
        self.rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self.rv)
        key = (plural, meta.get("namespace", ""), meta["name"])
        if kind == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((self.rv, plural, key[1], kind, copy.deepcopy(obj)))
        self.cond.notify_all()
        return obj
