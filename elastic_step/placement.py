"""Worker pods' node selector and tolerations as a pipeline hands them over — a dict or list (KFP's
struct and list parameters), their JSON text, or the `train` command's own strings — turned into
the strings `TrainConfig` takes (`KEY=VALUE`, `KEY[=VALUE][:EFFECT]`). Anything those cannot say
exactly is refused in one line naming the input, rather than dropped."""

from __future__ import annotations

import json

from elastic_step.errors import ConfigError

TOLERATION_FIELDS = {"key", "operator", "value", "effect"}


def _loaded(name: str, value, kind: type):
    """The value itself, or parsed from JSON text; "" and None are empty."""
    if value is None or value == "":
        return kind()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            if kind is list:  # a single toleration in train's own syntax
                return [value]
            raise ConfigError(f"{name} {value!r} is neither a mapping nor its JSON text; give e.g. "
                              '{"cloud.google.com/gke-nodepool": "gpu"}') from None
    if not isinstance(value, kind):
        raise ConfigError(f"{name} {value!r} is not a {'mapping' if kind is dict else 'list'}")
    return value


def node_selector_items(value, name: str = "node_selector") -> list[str]:
    """`{"pool": "gpu"}` (or its JSON) → `["pool=gpu"]`."""
    selector = _loaded(name, value, dict)
    items = []
    for key, label in selector.items():
        if not isinstance(key, str) or not key or not isinstance(label, str) or "," in key + label or "=" in key:
            raise ConfigError(f"{name}: {key!r}: {label!r} is not a node label (a non-empty key, a string value)")
        items.append(f"{key}={label}")
    return items


def toleration_items(value, name: str = "tolerations") -> list[str]:
    """`[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]` (or its JSON, or
    `["nvidia.com/gpu:NoSchedule"]`) → `["nvidia.com/gpu:NoSchedule"]`."""
    from elastic_step.backends.kubernetes.options import parse_toleration

    items = []
    for toleration in _loaded(name, value, list):
        text = toleration if isinstance(toleration, str) else _toleration_text(name, toleration)
        try:
            parse_toleration(text)  # what the backend will read, checked now
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        items.append(text)
    return items


def _toleration_text(name: str, toleration) -> str:
    if not isinstance(toleration, dict) or set(toleration) - TOLERATION_FIELDS:
        extra = sorted(set(toleration) - TOLERATION_FIELDS) if isinstance(toleration, dict) else None
        raise ConfigError(f"{name}: {toleration!r} is not a toleration with fields {', '.join(sorted(TOLERATION_FIELDS))}"
                          + (f" (not supported: {', '.join(extra)})" if extra else ""))
    key, value, effect = (str(toleration.get(f) or "") for f in ("key", "value", "effect"))
    operator = toleration.get("operator") or "Equal"  # Kubernetes' default
    if not key or operator not in ("Equal", "Exists") or (operator == "Exists" and value):
        raise ConfigError(f"{name}: {toleration!r} needs a key, and operator Equal with a value or Exists without one")
    return key + (f"={value}" if operator == "Equal" else "") + (f":{effect}" if effect else "")
