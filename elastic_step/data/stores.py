"""Object stores: opening a data URI, handing its options to workers, and naming what went wrong.

Every place that opens a dataset, a shard or an output folder goes through `resolve`, so a local
path, `s3://`, `gs://` and any other fsspec URI behave the same way. Endpoint and credentials come
the way users already configure them, never on a command line:

- S3 and S3-compatible stores (MinIO, KFP's own artifact store): `AWS_ENDPOINT_URL`,
  `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` (botocore reads them; a worker
  process or pod needs nothing else).
- GCS: `GOOGLE_APPLICATION_CREDENTIALS` or workload identity (`STORAGE_EMULATOR_HOST` for an
  emulator).
- What else a store needs that is not a secret (`endpoint_url`, `anon`, `requester_pays`,
  `client_kwargs` with `region_name`, ...: ALLOWED_OPTIONS names them all) as fsspec storage
  options: `set_storage_options` applies them in this
  process and `worker_env` hands the same options to workers as an `FSSPEC_<PROTOCOL>` variable
  (a JSON object), which fsspec reads by itself when a worker imports it.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit

import fsspec
import fsspec.config
from fsspec.implementations.local import LocalFileSystem

from elastic_step.errors import ConfigError, DataError

# KFP (v2, standalone or in Kubeflow) stores artifacts in this in-cluster MinIO service unless the
# installation says otherwise; `minio://bucket/key` artifact URIs refer to it.
KFP_DEFAULT_MINIO_ENDPOINT = "http://minio-service.kubeflow:9000"

# Option names that carry secrets. They must come from the environment (AWS_*, a mounted Secret,
# GOOGLE_APPLICATION_CREDENTIALS, workload identity): options travel in worker environments, pod
# specs and logs, where a secret must never be.
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "credentials", "session")

# The storage options a job takes, by name: where a store is and how to talk to it, never who is
# asking. An allow-list, since options travel as literal values in worker environments and pod
# specs (readable with `pods get`): a name not listed here could carry a credential (s3fs passes
# `client_kwargs={"headers": {"Authorization": ...}}` on to botocore). A nested dict lists the keys
# its option may hold; None, a plain value (string, number, boolean).
ALLOWED_OPTIONS: dict[str, dict | None] = {
    # s3fs (S3, MinIO)
    "endpoint_url": None, "anon": None, "requester_pays": None, "use_ssl": None, "version_aware": None,
    "default_block_size": None, "default_cache_type": None, "default_fill_cache": None, "cache_regions": None,
    "skip_instance_cache": None, "use_listings_cache": None, "listings_expiry_time": None, "max_concurrency": None,
    "fixed_upload_size": None,
    "client_kwargs": {"region_name": None, "endpoint_url": None, "verify": None, "use_ssl": None, "api_version": None},
    "config_kwargs": {"signature_version": None, "region_name": None, "connect_timeout": None, "read_timeout": None,
                      "max_pool_connections": None, "retries": {"max_attempts": None, "total_max_attempts": None, "mode": None},
                      "s3": {"addressing_style": None, "use_accelerate_endpoint": None, "payload_signing_enabled": None}},
    # gcsfs (GCS)
    "project": None, "default_location": None, "consistency": None, "cache_timeout": None, "block_size": None,
    "check_connection": None, "requests_timeout": None, "timeout": None, "access": None,
}

# Options applied through set_storage_options in this process, by protocol: what workers inherit.
_applied: dict[str, dict] = {}


def resolve(uri: str):
    """(filesystem, path, canonical URI) for a local path or any fsspec URI.

    Local paths stay plain absolute paths; remote ones keep their protocol so they can be reopened
    by another process. S3 takes its endpoint from `AWS_ENDPOINT_URL` (botocore reads it)."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:  # e.g. s3:// without s3fs installed
        raise DataError(f"cannot open {uri}: {e} — install the fsspec backend for it or use a local path") from None
    canonical = path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
    return fs, path, canonical


def is_local(uri: str) -> bool:
    """A plain path or a file:// URI (what every process on this machine can open as it is)."""
    return "://" not in uri or uri.split("://", 1)[0].lower() in ("file", "local")


def _protocol(protocol_or_uri: str) -> str:
    text = str(protocol_or_uri)
    if "://" in text:
        text = text.split("://", 1)[0]
    elif "/" in text or os.path.exists(text) or text.lower() not in fsspec.available_protocols():
        return "file"  # a path
    try:
        cls = fsspec.get_filesystem_class(text.lower())
    except (ImportError, ValueError) as e:
        raise ConfigError(f"unknown storage protocol {text!r} ({e}) — use s3, gs or another fsspec protocol") from None
    protos = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    return protos[0]  # fsspec applies config entries of any of a class's names; keep one


def _check_not_secret(protocol: str, key: str) -> None:
    words = re.split(r"[^a-z0-9]+", key.lower())
    if any(w in _SECRET_WORDS for w in words) or any(s in key.lower() for s in ("secret", "token", "password")):
        hint = ("GOOGLE_APPLICATION_CREDENTIALS or workload identity" if protocol in ("gs", "gcs")
                else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (a Kubernetes Secret on a cluster)")
        raise ConfigError(f"storage option {key!r} looks like a credential; options travel in worker environments "
                          f"and logs, so set credentials through {hint} instead")


def parse_storage_option(text: str) -> tuple[str, object]:
    """`key=value` (as `--storage-option` takes it) → (key, value); the value is JSON when it parses
    as JSON (`anon=true`, `client_kwargs={"region_name": "eu-west-1"}`), else the plain string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ConfigError(f"--storage-option {text!r} is not KEY=VALUE (e.g. endpoint_url=http://minio:9000)")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def set_storage_options(protocol_or_uri: str, options: dict) -> None:
    """Apply fsspec storage options for a protocol (given by name or by a URI of it) in this process,
    and remember them so `worker_env` hands them to workers. Secret-looking keys are refused."""
    if not options:
        return
    protocol = _protocol(protocol_or_uri)
    if protocol in ("file", "local"):
        raise ConfigError(f"storage options apply to object store URIs (s3://, gs://, ...), not to the local path "
                          f"{protocol_or_uri!r}")

    def check(mapping: dict, allowed: dict, where: str) -> None:  # nested too: client_kwargs={"headers": ...}
        for key, value in mapping.items():
            _check_not_secret(protocol, str(key))
            name = f"{where}{key}"
            if key not in allowed:
                raise ConfigError(f"storage option {name!r} is not one elastic-step hands to workers (options travel as "
                                  f"plain values in worker environments and pod specs); it takes: {', '.join(sorted(allowed))}")
            if isinstance(value, dict) != (allowed[key] is not None) or isinstance(value, list):
                raise ConfigError(f"storage option {name!r} takes " + ("an object of " + ", ".join(sorted(allowed[key]))
                                  if allowed[key] is not None else "a plain value (a string, a number or true/false)"))
            if isinstance(value, dict):
                check(value, allowed[key], f"{name}.")

    check(options, ALLOWED_OPTIONS, "")
    fsspec.config.conf.setdefault(protocol, {}).update(options)
    _applied.setdefault(protocol, {}).update(options)


# Where the stores are, not who may use them: safe to copy into a worker pod's spec.
STORE_LOCATION_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                      "STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def worker_env() -> dict[str, str]:
    """Environment variables that point a worker process or pod at the same stores as this process:
    the store location variables set here (`AWS_ENDPOINT_URL`, `AWS_REGION`, ...) and the storage
    options applied here, one `FSSPEC_<PROTOCOL>` variable per protocol holding them as a JSON
    object (the form fsspec documents as JSON, so `anon=false` stays a bool and `client_kwargs`
    a dict; fsspec applies it when a worker imports it). Credentials are never among them:
    workers take those from their own environment (a local worker inherits this process's; a pod
    gets them from a Secret)."""
    env = {name: os.environ[name] for name in STORE_LOCATION_ENV if os.environ.get(name)}
    for protocol, options in _applied.items():
        env[f"FSSPEC_{protocol.upper()}"] = json.dumps(options, sort_keys=True)
    return env


def kfp_artifact_uri_to_fsspec(uri: str) -> tuple[str, dict]:
    """The fsspec URI a worker can open for a KFP artifact URI, and the storage options it needs.

    KFP records artifacts kept in its MinIO as `minio://bucket/key`; fsspec reads them as
    `s3://bucket/key`, with the S3 endpoint from `AWS_ENDPOINT_URL`. When that is unset, the
    options name KFP's default in-cluster MinIO service (`http://minio-service.kubeflow:9000`) as
    `endpoint_url`: applied with `set_storage_options`, this process and the workers it starts
    reach the same store. `s3://`, `gs://` and local paths are returned unchanged, without options."""
    if not uri.startswith("minio://"):
        return uri, {}
    options = {} if os.environ.get("AWS_ENDPOINT_URL") else {"endpoint_url": KFP_DEFAULT_MINIO_ENDPOINT}
    return "s3://" + uri[len("minio://"):], options


def artifact_data_uri(uri: str, path: str, workers_share_filesystem: bool) -> tuple[str, dict]:
    """Where a pipeline step's workers should read a KFP `Dataset` artifact from, and the storage
    options of that store (see `kfp_artifact_uri_to_fsspec`).

    Workers that are processes beside the step (the local backend) read the copy the KFP launcher
    downloaded to the artifact's `.path`. Workers elsewhere (pods) cannot see that path: they read
    the artifact's store URI (`minio://` → `s3://` with the endpoint from the environment, `s3://`,
    `gs://`). A local URI (`kfp.local` runs, a mounted volume) is used as its `.path`."""
    if not uri or is_local(uri) or workers_share_filesystem:
        return path or uri, {}
    return kfp_artifact_uri_to_fsspec(uri)


def _chain(exc: BaseException):
    seen = []
    while exc is not None and exc not in seen and len(seen) < 10:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _status(exc: BaseException):
    for attr in ("code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _endpoint_hint(protocol: str) -> str:
    if protocol in ("gs", "gcs"):
        return "check the GCS endpoint (STORAGE_EMULATOR_HOST for an emulator) and the network"
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        where = f" (now {endpoint})" if endpoint else ""
        return f"check AWS_ENDPOINT_URL{where} / the endpoint and the network"
    return "check the endpoint and the network"


def _credentials_hint(protocol: str) -> str:
    if protocol in ("gs", "gcs"):
        return "check GOOGLE_APPLICATION_CREDENTIALS / the workload identity"
    return "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN if you use one)"


def _bucket(uri: str) -> str:
    parts = urlsplit(uri)
    return parts.netloc or uri


_CONNECTION_WORDS = ("connection refused", "could not connect", "connect call failed", "name or service not known",
                     "temporary failure in name resolution", "nodename nor servname", "cannot connect to host",
                     "failed to establish a new connection", "timed out", "connection reset")
_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                     "InvalidClientTokenId", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "Unauthorized")
_PERMISSION_CODES = ("AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden")


class Failure:
    """What kind of failure an object store client's exception means (see `classify`)."""

    UNREACHABLE = "unreachable"
    CREDENTIALS = "credentials"
    NO_BUCKET = "no_bucket"
    PERMISSION = "permission"
    NOT_FOUND = "not_found"
    OTHER = "other"


def classify(exc: BaseException) -> str:
    """One of `Failure`'s kinds for what s3fs/gcsfs/botocore/aiohttp (or the OS) raised, judged by
    the whole exception chain: s3fs turns botocore's ClientError into an OSError subclass and keeps
    the original as its cause."""
    chain = _chain(exc)
    codes = [c for c in (_code(e) for e in chain) if c]
    names = " ".join(type(e).__name__ for e in chain)
    text = " ".join(str(e) for e in chain).lower()
    statuses = [s for s in (_status(e) for e in chain) if s]
    if (any(n in names for n in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                                 "ConnectionClosedError", "ServerTimeoutError", "ConnectionRefusedError",
                                 "ClientConnectorDNSError", "gaierror"))
            or any(w in text for w in _CONNECTION_WORDS)):
        return Failure.UNREACHABLE
    if any(c in _CREDENTIAL_CODES for c in codes) or 401 in statuses or "invalid_grant" in text \
            or "access key id you provided does not exist" in text or "signature we calculated does not match" in text:
        return Failure.CREDENTIALS
    if "NoSuchBucket" in codes or "bucket does not exist" in text or "no such bucket" in text:
        return Failure.NO_BUCKET
    if any(c in _PERMISSION_CODES for c in codes) or 403 in statuses or isinstance(exc, PermissionError):
        return Failure.PERMISSION
    if "NoSuchKey" in codes or 404 in statuses or isinstance(exc, FileNotFoundError):
        return Failure.NOT_FOUND
    return Failure.OTHER


def _has_s3_error_code(exc: BaseException) -> bool:
    return any(c and not c.isdigit() for c in (_code(e) for e in _chain(exc)))


def _diagnose_s3(uri: str):
    """S3 answers a HEAD request with a bare 403 (a HEAD response has no body), which could mean
    wrong credentials or missing permission. A listing of the key's folder carries the error code
    in its body: ask once to tell the two apart (None when that says nothing more)."""
    try:
        fs, path, _ = resolve(uri)
        fs.ls(path.rsplit("/", 1)[0] if "/" in path else path, refresh=True)
    except Exception as probe:  # noqa: BLE001 — only a diagnosis; the original error is reported
        if _has_s3_error_code(probe):
            return classify(probe)
    return None


def store_error(uri: str, exc: BaseException) -> DataError:
    """One line naming `uri` and what to check, for what an object store client raised.

    Covers an unreachable endpoint, rejected credentials, a missing bucket, a missing key and a
    permission error; anything else keeps the first line of the client's own message. Never
    includes the values of credentials (only the names of the variables to check)."""
    protocol = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    kind = classify(exc)
    if kind == Failure.PERMISSION and protocol in ("s3", "s3a") and not _has_s3_error_code(exc):
        kind = _diagnose_s3(uri) or kind
    if kind == Failure.UNREACHABLE:
        return DataError(f"cannot reach the object store for {uri} — {_endpoint_hint(protocol)}")
    if kind == Failure.CREDENTIALS:
        return DataError(f"the object store rejected the credentials for {uri} — {_credentials_hint(protocol)}")
    if kind == Failure.NO_BUCKET:
        return DataError(f"bucket {_bucket(uri)!r} does not exist (for {uri}) — check the bucket name, "
                         "or create it" + (" at AWS_ENDPOINT_URL" if protocol in ("s3", "s3a") else ""))
    if kind == Failure.PERMISSION:
        hint = "check the file's permissions" if protocol == "file" else (
            f"grant these credentials access to it (read for inputs, write for outputs); {_credentials_hint(protocol)}")
        return DataError(f"permission denied for {uri} — {hint}")
    if kind == Failure.NOT_FOUND:
        return DataError(f"{uri} does not exist — check the path (and that prepare-data finished writing it)")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return DataError(f"cannot access {uri}: {detail[:200]}")
