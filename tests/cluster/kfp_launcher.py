"""A stand-in for KFP v2's launcher binary (`launcher-v2`), for the cluster's KFP task pods. The
kubelet runs it as the `kfp-launcher` image; the first line (a shebang naming this machine's
Python) is written when the image layer is made. Read from kubeflow/pipelines backend/src/v2
(component/launcher_v2.go, config/env.go, objectstore/object_store.go, cmd/launcher-v2).

  launcher-v2 --copy /kfp-launcher/launch
        the `kfp-launcher` init container: copy itself (and the Service table, below) into the
        shared `kfp-launcher` volume, where `main` runs it from
  /kfp-launcher/launch --pipeline_name P --run_id R --execution_id N --executor_input JSON
        --component_spec JSON --pod_name NAME --pod_uid UID -- COMMAND ARGS...
        `main`, in the user's image, with the pod's own service-account token (in-cluster config):
        1. the launcher configuration: GET ConfigMap `kfp-launcher` in the pod's namespace; not
           found is not an error ("cannot find launcher configmap ..., will use default config"),
           any other refusal is; `defaultPipelineRoot`, else `minio://mlpipeline/v2/artifacts`;
        2. open the pipeline root's bucket: for `minio://` with no `providers` configured, KFP's
           default session (endpoint `minio-service.kubeflow:9000`, no TLS, region `minio`, keys
           `accesskey`/`secretkey` of the Secret `mlpipeline-minio-artifact`, GET in the pod's
           namespace); a missing or forbidden Secret, or one without both keys, fails the task
           in KFP's words (`Failed to open bucket ...: failed to retrieve credentials ...`);
        3. download each input artifact (every object under its key) to its local path
           (`minio://B/K` -> /minio/B/K, `s3://` -> /s3/, `gs://` -> /gcs/);
        4. make the output folders, replace the placeholders (`{{$}}`, `{{$.inputs...}}`,
           `{{$.outputs...}}`) in the command and args, run them (stdin, stdout, stderr its own;
           SIGTERM forwarded);
        5. read the executor output file (`/tmp/kfp_outputs/output_metadata.json`, optional), take
           each output parameter not in it from its `outputFile`, and upload each output
           artifact's local path (a file, or every file under a folder) to its URI's key; a path
           the component did not write is skipped with a warning, as KFP allows;
        6. publish: MLMD is not modelled, so the execution KFP would record there (state, output
           parameters, output artifacts with URIs and metadata) is logged as one line
           `kfp-launcher: publish {...}`.
        Any error: one line `failed to execute component: ...` (glog's fatal line) and exit 1.

The cluster has no DNS or kube-proxy: `services.json` beside the launcher maps a Service's
`NAME.NAMESPACE:PORT` to the address of the process behind it (the tests' S3 server stands
behind `minio-service.kubeflow:9000`); the launcher resolves its endpoint through it.
Not modelled: MLMD (pre-publish, publish, the DAG's state), the cache and its fingerprint,
`providers` other than the minio default (refused), executor logs as an artifact, Modelcar
(`oci://`), the ML pipeline server, non-default buckets of input artifacts.
"""

import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

LAUNCHER_CONFIG = "kfp-launcher"
DEFAULT_PIPELINE_ROOT = "minio://mlpipeline/v2/artifacts"
MINIO_DEFAULT_ENDPOINT = "minio-service.kubeflow:9000"  # objectstore.DefaultMinioEndpointInMultiUserMode
MINIO_SECRET, ACCESS_KEY_KEY, SECRET_KEY_KEY = "mlpipeline-minio-artifact", "accesskey", "secretkey"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICES = "services.json"
OUTPUT_METADATA = "/tmp/kfp_outputs/output_metadata.json"
SCRATCH = (("gs://", "/gcs/"), ("minio://", "/minio/"), ("s3://", "/s3/"))


class Failure(Exception):
    """An error in KFP's words; the chain of `%w` wrappings is the message."""


def copy(destination: str) -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.copy(os.path.realpath(__file__), destination)
    os.chmod(destination, 0o755)
    table = os.path.join(here, SERVICES)
    if os.path.exists(table):
        shutil.copy(table, os.path.join(os.path.dirname(destination), SERVICES))
        os.chmod(os.path.join(os.path.dirname(destination), SERVICES), 0o644)


# -- the API server, as client-go's in-cluster config reaches it -----------------------------------
def api_get(path: str) -> tuple[int, dict]:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    with open(f"{SERVICE_ACCOUNT}/token") as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=f"{SERVICE_ACCOUNT}/ca.crt")
    request = urllib.request.Request(f"https://{host}:{port}{path}", headers={"Authorization": f"Bearer {token}",
                                                                              "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, json.loads(body)
        except ValueError:
            return error.code, {"message": body.decode(errors="replace")}


def namespace() -> str:
    with open(f"{SERVICE_ACCOUNT}/namespace") as f:
        return f.read().strip()


def launcher_config(ns: str) -> dict:
    """config.FromConfigMap: the ConfigMap's data; {} (the defaults) when there is none."""
    code, body = api_get(f"/api/v1/namespaces/{ns}/configmaps/{LAUNCHER_CONFIG}")
    if code == 404:
        print(f'cannot find launcher configmap: name="{LAUNCHER_CONFIG}" namespace="{ns}", will use default config', flush=True)
        return {}
    if code != 200:
        raise Failure(body.get("message") or f"the server answered {code}")
    return body.get("data") or {}


def bucket_credentials(ns: str, secret: str) -> tuple[str, str]:
    """getS3BucketCredential."""
    wrap = f'failed to get Bucket credentials from secret name="{secret}" namespace="{ns}": '
    code, body = api_get(f"/api/v1/namespaces/{ns}/secrets/{secret}")
    if code != 200:
        raise Failure(wrap + (body.get("message") or f"the server answered {code}"))
    data = {k: base64.b64decode(v).decode() for k, v in (body.get("data") or {}).items()}
    if not data.get(ACCESS_KEY_KEY) or not data.get(SECRET_KEY_KEY):
        raise Failure(wrap + "could not find required bucket credential values; both access key and secret key must be present")
    return data[ACCESS_KEY_KEY], data[SECRET_KEY_KEY]


def service_address(endpoint: str) -> str:
    """What the cluster's DNS and kube-proxy make of a Service address (the table beside us)."""
    table = os.path.join(os.path.dirname(os.path.realpath(__file__)), SERVICES)
    services = json.load(open(table)) if os.path.exists(table) else {}
    return services.get(endpoint, endpoint)


class Bucket:
    """objectstore.OpenBucket for the pipeline root's bucket (minio's default session)."""

    def __init__(self, root: str, config: dict, ns: str):
        scheme, _, rest = root.partition("://")
        self.scheme, self.name = scheme, rest.split("/", 1)[0]
        try:
            if scheme != "minio" or config.get("providers"):
                raise Failure(f"pipeline root {root} with providers {config.get('providers')!r}: only minio's default "
                              f"session is modelled")
            try:
                key_id, secret = bucket_credentials(ns, MINIO_SECRET)
            except Failure as error:
                raise Failure(f"failed to retrieve credentials for bucket {self.name}: {error}") from None
        except Failure as error:
            raise Failure(f'Failed to open bucket "{self.name}": {error}') from None
        import boto3

        self.client = boto3.client("s3", endpoint_url="http://" + service_address(MINIO_DEFAULT_ENDPOINT), region_name="minio",
                                   aws_access_key_id=key_id, aws_secret_access_key=secret)

    def key(self, uri: str) -> str:
        prefix = f"{self.scheme}://{self.name}/"
        if not uri.startswith(prefix):
            raise Failure(f"URI {uri!r} is not in bucket {prefix!r}: other buckets are not modelled")
        return uri[len(prefix):]

    def download(self, key: str, local: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=key)
        for obj in (o for page in pages for o in page.get("Contents") or []):
            if obj["Key"] != key and not obj["Key"].startswith(key.rstrip("/") + "/"):
                continue
            if ".." in obj["Key"].split("/"):
                raise Failure(f"path traversal detected: blob key {obj['Key']!r} contains '..' component")
            path = os.path.join(local, os.path.relpath(obj["Key"], key)) if obj["Key"] != key else local
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.client.download_file(self.name, obj["Key"], path)

    def upload(self, local: str, key: str) -> list[str]:
        if os.path.isdir(local):
            return [k for name in sorted(os.listdir(local)) for k in self.upload(os.path.join(local, name), f"{key}/{name}")]
        self.client.upload_file(local, self.name, key)
        print(f'uploadFile(localFilePath="{local}", blobFilePath="{key}")', flush=True)
        return [key]


def local_path(uri: str) -> str:
    for prefix, mount in SCRATCH:
        if uri.startswith(prefix):
            return mount + uri[len(prefix):]
    raise Failure(f"failed to generate local path for URI {uri}: unsupported storage scheme")


def placeholders(executor_input: dict) -> dict[str, str]:
    """getPlaceholders."""
    values = {"{{$}}": json.dumps(executor_input, separators=(",", ":"))}
    for name, artifacts in (executor_input["inputs"].get("artifacts") or {}).items():
        uri = artifacts["artifacts"][0]["uri"]
        values[f"{{{{$.inputs.artifacts['{name}'].uri}}}}"] = uri
        values[f"{{{{$.inputs.artifacts['{name}'].path}}}}"] = local_path(uri)
    for name, artifacts in (executor_input["outputs"].get("artifacts") or {}).items():
        uri = artifacts["artifacts"][0]["uri"]
        values[f"{{{{$.outputs.artifacts['{name}'].uri}}}}"] = uri
        values[f"{{{{$.outputs.artifacts['{name}'].path}}}}"] = local_path(uri)
    for name, value in (executor_input["inputs"].get("parameterValues") or {}).items():
        values[f"{{{{$.inputs.parameters['{name}']}}}}"] = value if isinstance(value, str) else json.dumps(value)
    for name, parameter in (executor_input["outputs"].get("parameters") or {}).items():
        values[f"{{{{$.outputs.parameters['{name}'].output_file}}}}"] = parameter["outputFile"]
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def run_user_command(command: list[str]) -> None:
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    code = child.wait()
    if code != 0:
        raise Failure(f"exit status {code}" if code > 0 else f"signal: {signal.Signals(-code).name.lower()[3:]}")


def parameter_value(text: str, kind: str):
    """metadata.TextToPbValue."""
    if kind == "STRING":
        return text
    if kind in ("NUMBER_INTEGER", "NUMBER_DOUBLE"):
        return float(text)
    if kind == "BOOLEAN":
        return text.strip().lower() == "true"
    return json.loads(text)


def collect_outputs(executor_input: dict, component: dict, bucket: Bucket) -> dict:
    """getExecutorOutputFile, collectOutputParameters, uploadOutputArtifacts."""
    output_file = executor_input["outputs"].get("outputFile") or OUTPUT_METADATA
    executor_output = json.load(open(output_file)) if os.path.exists(output_file) else {}
    parameters = dict(executor_output.get("parameterValues") or {})
    definitions = (component.get("outputDefinitions") or {}).get("parameters") or {}
    for name, parameter in (executor_input["outputs"].get("parameters") or {}).items():
        if name in parameters:
            continue
        try:
            with open(parameter["outputFile"]) as f:
                parameters[name] = parameter_value(f.read(), definitions[name]["parameterType"])
        except (OSError, ValueError, KeyError) as error:
            raise Failure(f'failed to read output parameter name="{name}" path="{parameter["outputFile"]}": {error}') from None
    artifacts = {}
    for name, listed in (executor_input["outputs"].get("artifacts") or {}).items():
        artifact = dict(listed["artifacts"][0])
        written = ((executor_output.get("artifacts") or {}).get(name) or {}).get("artifacts") or []
        if written:
            artifact["uri"] = written[0].get("uri") or artifact["uri"]
            artifact["metadata"] = {**(artifact.get("metadata") or {}), **(written[0].get("metadata") or {})}
        local = local_path(artifact["uri"])
        if os.path.exists(local):
            artifact["uploaded"] = bucket.upload(local, bucket.key(artifact["uri"]))
        else:
            print(f'Local filepath "{local}" does not exist', flush=True)
        artifacts[name] = artifact
    return {"parameters": parameters, "artifacts": artifacts}


def launch(options: dict[str, str], command: list[str]) -> None:
    if not command:
        raise Failure("failed to create component launcher v2: command and arguments are empty")
    for flag in ("pod_name", "pod_uid"):
        if not options.get(flag):
            raise Failure(f"failed to create component launcher v2: invalid launcher options: must specify {flag}")
    executor_input = json.loads(options["executor_input"])
    component = json.loads(options.get("component_spec") or "{}")
    ns = namespace()
    config = launcher_config(ns)
    root = config.get("defaultPipelineRoot") or DEFAULT_PIPELINE_ROOT
    bucket = Bucket(root, config, ns)
    for name, listed in (executor_input["inputs"].get("artifacts") or {}).items():
        uri = listed["artifacts"][0]["uri"]
        try:
            bucket.download(bucket.key(uri), local_path(uri))
        except Exception as error:  # noqa: BLE001 - every cause is the task's failure, in its words
            raise Failure(f'failed to download input artifact "{name}" from remote storage URI "{uri}": {error}') from None
    for parameter in (executor_input["outputs"].get("parameters") or {}).values():
        os.makedirs(os.path.dirname(parameter["outputFile"]), exist_ok=True)
    for listed in (executor_input["outputs"].get("artifacts") or {}).values():
        os.makedirs(os.path.dirname(local_path(listed["artifacts"][0]["uri"])), exist_ok=True)
    values = placeholders(executor_input)
    state = "FAILED"
    outputs: dict = {}
    try:
        run_user_command([substitute(part, values) for part in command])
        outputs = collect_outputs(executor_input, component, bucket)
        state = "COMPLETE"
    finally:  # published whether the task succeeded or not
        print("kfp-launcher: publish " + json.dumps({"pipeline": options.get("pipeline_name"), "run_id": options.get("run_id"),
                                                     "execution_id": options.get("execution_id"), "pod": options["pod_name"],
                                                     "state": state, **outputs}), flush=True)


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    flags, command = argv[:split], argv[split + 1:]
    options = {flags[i].lstrip("-"): flags[i + 1] for i in range(0, len(flags) - 1, 2)}
    return options, command


def main() -> None:
    if sys.argv[1:2] == ["--copy"]:
        copy(sys.argv[2])
        return
    options, command = parse(sys.argv[1:])
    try:
        launch(options, command)
    except Failure as error:
        print(f"failed to execute component: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
