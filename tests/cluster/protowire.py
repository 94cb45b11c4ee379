"""Request bodies kubectl sends as `application/vnd.kubernetes.protobuf` (its typed clients do: the
reviews of `kubectl auth can-i`, the Eviction or DeleteOptions of `kubectl drain`), read into the
JSON dict the server works on. Answers stay JSON: those clients accept `application/json` too and
decode by the answer's Content-Type.

The wire format (k8s.io/apimachinery/pkg/runtime/serializer/protobuf): the magic `k8s\\0`, then a
runtime.Unknown {typeMeta 1 {apiVersion 1, kind 2}, raw 2, contentEncoding 3, contentType 4}
whose `raw` is the object's message, with the field numbers of its generated.proto (listed below
for the kinds read; other fields are skipped, as an older client's would be)."""

from __future__ import annotations

import base64

from .objects import ApiError

MAGIC = b"k8s\x00"
PROTOBUF = "application/vnd.kubernetes.protobuf"

# message -> {field number: (json name, sub-message or a scalar type)}
_OBJECT_META = {1: ("name", "string"), 3: ("namespace", "string"), 11: ("labels", ("map", "string")),
                12: ("annotations", ("map", "string"))}
_RESOURCE_ATTRIBUTES = {1: ("namespace", "string"), 2: ("verb", "string"), 3: ("group", "string"), 4: ("version", "string"),
                        5: ("resource", "string"), 6: ("subresource", "string"), 7: ("name", "string")}
_NON_RESOURCE_ATTRIBUTES = {1: ("path", "string"), 2: ("verb", "string")}
_DELETE_OPTIONS = {1: ("gracePeriodSeconds", "int"), 4: ("propagationPolicy", "string")}
MESSAGES = {
    "SelfSubjectAccessReview": {1: ("metadata", _OBJECT_META),
                                2: ("spec", {1: ("resourceAttributes", _RESOURCE_ATTRIBUTES),
                                             2: ("nonResourceAttributes", _NON_RESOURCE_ATTRIBUTES)})},
    "SelfSubjectRulesReview": {1: ("metadata", _OBJECT_META), 2: ("spec", {1: ("namespace", "string")})},
    "SelfSubjectReview": {1: ("metadata", _OBJECT_META)},
    "Eviction": {1: ("metadata", _OBJECT_META), 2: ("deleteOptions", _DELETE_OPTIONS)},
    "DeleteOptions": _DELETE_OPTIONS,
    # `kubectl create secret` and `kubectl create namespace` (k8s.io/api/core/v1 generated.proto)
    "Secret": {1: ("metadata", _OBJECT_META), 2: ("data", ("map", "bytes")), 3: ("type", "string"),
               4: ("stringData", ("map", "string"))},
    "Namespace": {1: ("metadata", _OBJECT_META)},
}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of each field of one message."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = data[at:at + size], at + size
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _message(data: bytes, layout: dict) -> dict:
    out = {}
    for number, _, value in _fields(data):
        if number not in layout:
            continue
        name, kind = layout[number]
        if isinstance(kind, dict):
            out[name] = _message(value, kind)
        elif isinstance(kind, tuple):  # a map: repeated entries {key 1, value 2}; bytes as JSON's base64
            entry = {n: v for n, _, v in _fields(value)}
            raw = entry.get(2, b"")
            out.setdefault(name, {})[entry.get(1, b"").decode()] = (
                base64.b64encode(raw).decode() if kind[1] == "bytes" else raw.decode())
        elif kind == "int":
            out[name] = value - (1 << 64) if value >= 1 << 63 else value
        else:
            out[name] = value.decode()
    return out


def decode(raw: bytes) -> dict:
    """The JSON form of a protobuf request body (400 for a kind not read here)."""
    try:
        if not raw.startswith(MAGIC):
            raise ValueError("no k8s protobuf magic")
        unknown = {n: v for n, _, v in _fields(raw[len(MAGIC):])}
        type_meta = {n: v.decode() for n, _, v in _fields(unknown.get(1, b""))}
        api_version, kind = type_meta.get(1, ""), type_meta.get(2, "")
        if kind not in MESSAGES:
            raise ApiError(415, "UnsupportedMediaType", f"{kind or 'this kind'} is not accepted as protobuf here: send JSON")
        return {"apiVersion": api_version, "kind": kind, **_message(unknown.get(2, b""), MESSAGES[kind])}
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ApiError(400, "BadRequest", f"the body is not a Kubernetes protobuf message: {exc}") from None
