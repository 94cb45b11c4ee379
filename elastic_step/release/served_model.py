"""Which model is served: `models:/NAME@ALIAS` or `models:/NAME/VERSION` resolved through the
MLflow registry to one exact version, its MLflow run and its artifact location, so that nobody
types a storage URI and a moving alias never changes what a running server holds."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_step.errors import ConfigError
from elastic_step.release.registry import get_version, registry_client, version_by_alias
from elastic_step.tracking.run import TrackingError

_MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))$")

# MLflow flavour -> KServe's modelFormat name. The pyfunc (mlflow) format serves every flavour
# through MLServer's MLflow runtime; the native formats need the runtime of that framework.
KSERVE_FORMATS = {"mlflow": "mlflow", "pytorch": "pytorch", "tensorflow": "tensorflow"}


@dataclass(frozen=True)
class ServedModel:
    name: str
    version: str
    run_id: str
    storage_uri: str  # the version's artifact location, as the registry gives it
    flavors: tuple[str, ...]

    @property
    def model_uri(self) -> str:
        """The exact version, never the alias it was found by."""
        return f"models:/{self.name}/{self.version}"


def parse_model_uri(uri: str) -> tuple[str, str]:
    """(name, alias-or-version) of `models:/NAME@ALIAS` or `models:/NAME/VERSION`."""
    m = _MODEL_URI.match(uri.strip())
    if not m:
        raise ConfigError(f"model {uri!r} is not models:/NAME@ALIAS or models:/NAME/VERSION "
                          "(e.g. models:/digits@champion)")
    return m["name"], m["alias"] or m["version"]


def resolve(name: str, alias_or_version: str, mlflow_uri: str | None = None) -> ServedModel:
    """The exact version `alias_or_version` names, checked servable: it exists and its MLmodel
    has a signature (a server without one cannot check a request's columns and types)."""
    client = registry_client(mlflow_uri)
    ref = str(alias_or_version).strip()
    if ref.isdigit():
        version = get_version(client, name, ref)
    else:
        version = version_by_alias(client, name, ref)
        if version is None:
            raise TrackingError(f"registered model {name!r} has no alias @{ref}; "
                                f"pass an alias it has ({_aliases(client, name)}) or a version number")
    model = ServedModel(name, str(version.version), version.run_id or "",
                        client.get_model_version_download_uri(name, version.version),
                        _flavors_with_signature(client.tracking_uri, name, str(version.version)))
    return model


def _flavors_with_signature(tracking_uri: str, name: str, version: str) -> tuple[str, ...]:
    """The version's flavours, read from its MLmodel file (only that file is fetched)."""
    import mlflow.models

    from elastic_step.tracking.uri import use_tracking_uri

    use_tracking_uri(tracking_uri)
    try:
        info = mlflow.models.get_model_info(f"models:/{name}/{version}")
    except Exception as exc:
        raise TrackingError(f"version {version} of {name!r} has no readable MLmodel ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); register a model that MLflow logged") from None
    if info.signature is None:
        raise ConfigError(f"version {version} of {name!r} has no signature; serve a version that export_model "
                          "registered (it logs the signature), or log the model with one")
    return tuple(sorted(info.flavors))


def _aliases(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        aliases = sorted(client.get_registered_model(name).aliases)
    except MlflowException:
        return "the model is not registered"
    return ", ".join(f"@{a}" for a in aliases) or "it has none"


def kserve_format(model: ServedModel) -> str:
    """modelFormat for KServe: `mlflow` (MLServer's MLflow runtime loads the pyfunc of any flavour)."""
    if "python_function" not in model.flavors:
        native = [f for f in model.flavors if f in KSERVE_FORMATS]
        if not native:
            raise ConfigError(f"version {model.version} of {model.name!r} has flavours {', '.join(model.flavors)}, "
                              "none of which a KServe runtime serves")
        return KSERVE_FORMATS[native[0]]
    return "mlflow"
