"""Promotion by registry aliases (stages are deprecated in MLflow 3): `champion` moves to the new
version and the version it left keeps `previous-champion`, so a rollback is one alias swap."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elastic_step.release.registry import CHAMPION, PREVIOUS_CHAMPION, get_version, registry_client, version_by_alias
from elastic_step.tracking.run import TrackingError

log = logging.getLogger("elastic_step.release")


@dataclass
class Promotion:
    name: str
    champion: str
    previous_champion: str | None
    changed: bool

    def describe(self) -> str:
        before = f"; previous-champion is version {self.previous_champion}" if self.previous_champion else ""
        verb = "is now" if self.changed else "was already"
        return f"{self.name}: version {self.champion} {verb} @{CHAMPION}{before}"


def promote(registered_model: str, version: str, mlflow_uri: str | None = None) -> Promotion:
    """Point @champion at `version`. Idempotent: a retried promote of the same version changes
    nothing, so the previous champion is never lost to a retry."""
    client = registry_client(mlflow_uri)
    target = get_version(client, registered_model, version)
    current = version_by_alias(client, registered_model, CHAMPION)
    previous = version_by_alias(client, registered_model, PREVIOUS_CHAMPION)
    if current is not None and current.version == target.version:
        return Promotion(registered_model, str(target.version), str(previous.version) if previous else None, changed=False)
    if current is not None:
        client.set_registered_model_alias(registered_model, PREVIOUS_CHAMPION, current.version)
    client.set_registered_model_alias(registered_model, CHAMPION, target.version)
    promotion = Promotion(registered_model, str(target.version), str(current.version) if current else None, changed=True)
    log.info(promotion.describe())
    return promotion


def rollback(registered_model: str, mlflow_uri: str | None = None) -> Promotion:
    """Swap @champion and @previous-champion (a second rollback undoes the first)."""
    client = registry_client(mlflow_uri)
    previous = version_by_alias(client, registered_model, PREVIOUS_CHAMPION)
    if previous is None:
        raise TrackingError(
            f"registered model {registered_model!r} has no @{PREVIOUS_CHAMPION} to roll back to; "
            "a rollback needs at least one promotion that replaced a champion"
        )
    current = version_by_alias(client, registered_model, CHAMPION)
    client.set_registered_model_alias(registered_model, CHAMPION, previous.version)
    if current is not None:
        client.set_registered_model_alias(registered_model, PREVIOUS_CHAMPION, current.version)
    return Promotion(registered_model, str(previous.version), str(current.version) if current else None, changed=True)
