"""A stand-in for Argo's executor binary (`argoexec`, emissary executor, v3.6), for the cluster's
Argo step pods. The kubelet runs it as the `argoexec` image; the first line (a shebang naming this
machine's Python) is written when the image layer is made. Read from argoproj/argo-workflows
(cmd/argoexec/commands/{init,wait,emissary}.go, workflow/executor/executor.go `SaveParameters`,
`SaveArtifacts`, `stageArchiveFile`, `saveArtifactFromFile`, taskresult.go, emissary/emissary.go,
workflow/artifacts/s3, pkg/apis/workflow/v1alpha1 `ArtifactLocation.Get`).

  argoexec init       copy itself to /var/run/argo/argoexec and the template (ARGO_TEMPLATE) to
                      /var/run/argo/template; download the input artifacts from S3 into
                      /argo/inputs/artifacts/NAME (folders, not archives)
  argoexec emissary -- CMD...
                      main's wrapper: run CMD, forward SIGTERM; then, whatever CMD's exit code,
                      copy each output parameter's `valueFrom.path` to
                      /var/run/argo/outputs/parameters/PATH and tar+gzip each output artifact's
                      `path` to /var/run/argo/outputs/artifacts/PATH.tgz (a path that does not
                      exist is skipped: it may be optional); write the exit code for `wait`
  argoexec wait       the `wait` sidecar, with the pod's own service-account token:
                      1. create the node's WorkflowTaskResult (named ARGO_NODE_ID, labelled
                         `workflows.argoproj.io/report-outputs-completed: "false"`, owned by the
                         Workflow) — needs `create` on workflowtaskresults (Argo's executor Role);
                      2. wait for main's exit code (a SIGTERM does not stop the wait: main's
                         emissary still writes it);
                      3. SaveParameters: each `valueFrom.path` from the shared volume, one trailing
                         newline trimmed; missing and no `valueFrom.default`: the error is
                         `open /var/run/argo/outputs/parameters/PATH: no such file or directory`;
                      4. SaveArtifacts: each staged archive; missing and not `optional: true`:
                         `open /var/run/argo/outputs/artifacts/PATH.tgz: no such file or
                         directory`; uploaded to the template's `archiveLocation` (S3, keys read
                         from the Secret volumes at /argo/secret/NAME/KEY; `insecure` is http) at
                         KEY/NAME.tgz, or with `archive: {none: {}}` untarred: KEY/BASENAME (a
                         folder: every file under it); no location at all: `artifact storage is
                         not configured; see the docs for setup instructions: ...` (Argo's words);
                      5. patch the task result with the outputs (parameter values, artifact S3
                         locations), then its label to "true";
                      every error is logged as `executor error: ...` and the first one makes
                      `wait` exit 1 (the controller's Error). A pod without ARGO_NODE_ID (built
                      without a Workflow) reports no task result.
Not modelled: termination messages (Argo writes the first error to /dev/termination-log, which
becomes the node's message: here it is in the wait container's log only), zip archives,
artifacts with their own location, log archiving, script results, GCS/Azure/... repositories.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

ARGO = "/var/run/argo"
EXIT_FILE = f"{ARGO}/ctr/main/exitcode"
NOT_CONFIGURED = ("artifact storage is not configured; see the docs for setup instructions: "
                  "https://argo-workflows.readthedocs.io/en/latest/configure-artifact-repository/")
COMPLETED_LABEL = "workflows.argoproj.io/report-outputs-completed"


def init() -> None:
    shutil.copy(os.path.realpath(__file__), f"{ARGO}/argoexec")
    os.chmod(f"{ARGO}/argoexec", 0o755)
    with open(f"{ARGO}/template", "w") as f:
        f.write(os.environ.get("ARGO_TEMPLATE", "{}"))
    os.chmod(f"{ARGO}/template", 0o444)
    template = json.loads(os.environ.get("ARGO_TEMPLATE", "{}"))
    for artifact in (template.get("inputs") or {}).get("artifacts") or []:
        s3 = artifact["s3"]
        import fsspec

        fs = fsspec.filesystem("s3", anon=True, endpoint_url=s3["endpoint"])
        dest = f"/argo/inputs/artifacts/{artifact['name']}"
        os.makedirs(dest, exist_ok=True)
        for path in fs.find(f"{s3['bucket']}/{s3['key']}"):
            local = os.path.join(dest, os.path.relpath(path, f"{s3['bucket']}/{s3['key']}"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get(path, local)
        print(f"argoexec init: artifact {artifact['name']} -> {artifact['path']}", flush=True)


# -- main's side ------------------------------------------------------------------------------------
def emissary(argv: list[str]) -> None:
    proc = subprocess.Popen(argv)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    code = proc.wait()
    code = 128 - code if code < 0 else code
    with open(f"{ARGO}/template") as f:
        outputs = json.load(f).get("outputs") or {}
    for parameter in outputs.get("parameters") or []:
        source = (parameter.get("valueFrom") or {}).get("path")
        if source and os.path.exists(source):
            os.makedirs(os.path.dirname(f"{ARGO}/outputs/parameters{source}"), exist_ok=True)
            shutil.copyfile(source, f"{ARGO}/outputs/parameters{source}")
    for artifact in outputs.get("artifacts") or []:
        source = artifact.get("path", "").rstrip("/")
        if source and os.path.exists(source):
            staged = f"{ARGO}/outputs/artifacts{source}.tgz"
            os.makedirs(os.path.dirname(staged), exist_ok=True)
            with tarfile.open(staged, "w:gz") as tar:
                tar.add(source, arcname=os.path.basename(source))
    os.makedirs(os.path.dirname(EXIT_FILE), exist_ok=True)
    with open(EXIT_FILE, "w") as f:
        f.write(str(code))
    sys.exit(code)


# -- the wait container -----------------------------------------------------------------------------
class TaskResults:
    """The node's WorkflowTaskResult, through the API with the pod's own token."""

    def __init__(self):
        from kubernetes import client, config

        config.load_incluster_config()
        self.api = client.CustomObjectsApi()
        self.exception = client.ApiException
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            self.namespace = f.read().strip()
        self.name, self.workflow = os.environ["ARGO_NODE_ID"], os.environ["ARGO_WORKFLOW_NAME"]
        self.created = False

    def _call(self, verb: str, body: dict) -> None:
        try:
            if verb == "create":
                self.api.create_namespaced_custom_object("argoproj.io", "v1alpha1", self.namespace, "workflowtaskresults", body)
            else:
                self.api.patch_namespaced_custom_object("argoproj.io", "v1alpha1", self.namespace, "workflowtaskresults", self.name, body)
        except self.exception as exc:
            message = json.loads(exc.body or "{}").get("message") or str(exc.reason)
            if exc.status == 403:
                print("argoexec wait: failed to patch task result, see https://argo-workflows.readthedocs.io/en/latest/workflow-rbac/",
                      flush=True)
            raise RuntimeError(message) from None

    def upsert(self, result: dict) -> None:
        """upsertTaskResult: create it (until that worked once), else patch it."""
        if self.created:
            return self._call("patch", result)
        self._call("create", {"apiVersion": "argoproj.io/v1alpha1", "kind": "WorkflowTaskResult", "metadata": {
            "name": self.name, "labels": {"workflows.argoproj.io/workflow": self.workflow, COMPLETED_LABEL: "false"},
            "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": self.workflow,
                                 "uid": os.environ["ARGO_WORKFLOW_UID"]}]}, **result})
        self.created = True

    def initialize(self) -> None:
        self.upsert({})

    def report(self, outputs: dict) -> None:
        self.upsert({"outputs": outputs})

    def finalize(self) -> None:
        self._call("patch", {"metadata": {"labels": {COMPLETED_LABEL: "true"}}})


def save_parameters(outputs: dict) -> list[dict]:
    saved = []
    for parameter in outputs.get("parameters") or []:
        value_from = parameter.get("valueFrom") or {}
        if not value_from.get("path"):
            continue
        try:
            with open(os.path.normpath(f"{ARGO}/outputs/parameters/{value_from['path']}")) as f:
                value = f.read()
        except OSError as exc:
            if "default" not in value_from:
                raise RuntimeError(f"open {exc.filename}: no such file or directory") from None
            value = str(value_from["default"])
        saved.append({**parameter, "value": value[:-1] if value.endswith("\n") else value})
    return saved


def s3_client(location: dict):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    def secret(selector: dict | None) -> str | None:
        if not selector:
            return None
        with open(f"/argo/secret/{selector['name']}/{selector['key']}") as f:
            return f.read()
    key_id, key = secret(location.get("accessKeySecret")), secret(location.get("secretKeySecret"))
    scheme = "http" if location.get("insecure") else "https"
    return boto3.client("s3", endpoint_url=f"{scheme}://{location['endpoint']}", region_name=location.get("region") or "us-east-1",
                        aws_access_key_id=key_id, aws_secret_access_key=key,
                        config=None if key_id else Config(signature_version=UNSIGNED))


def save_artifact(artifact: dict, location: dict | None, scratch: str) -> dict | None:
    """Stage one artifact, then upload it; its reported location, or None (optional, absent)."""
    source = artifact["path"].rstrip("/")
    staged = f"{ARGO}/outputs/artifacts{source}.tgz"
    if not os.path.exists(staged):
        if artifact.get("optional"):
            print(f"argoexec wait: ignoring optional artifact {artifact['name']} which does not exist in path {source}", flush=True)
            return None
        raise RuntimeError(f"open {staged}: no such file or directory")
    archive = artifact.get("archive") or {"tar": {}}
    if set(archive) - {"tar", "none"}:
        raise RuntimeError(f"artifact {artifact['name']}: archive {sorted(archive)} is not modelled (tar or none)")
    if location is None:
        raise RuntimeError("key unsupported: cannot get key for artifact location, because it is invalid")
    if not location.get("s3"):
        raise RuntimeError(NOT_CONFIGURED)
    s3 = location["s3"]
    client = s3_client(s3)
    if "none" in archive:
        with tarfile.open(staged) as tar:
            tar.extractall(scratch, filter="data")
        unpacked = os.path.join(scratch, os.path.basename(source))
        key = f"{s3['key']}/{os.path.basename(source)}"
        files = [os.path.join(d, n) for d, _, names in os.walk(unpacked) for n in names] if os.path.isdir(unpacked) else [unpacked]
        for path in files:
            client.upload_file(path, s3["bucket"], key if path == unpacked else f"{key}/{os.path.relpath(path, unpacked)}")
    else:
        key = f"{s3['key']}/{artifact['name']}.tgz"
        client.upload_file(staged, s3["bucket"], key)
    print(f"argoexec wait: artifact {artifact['name']} saved to s3://{s3['bucket']}/{key}", flush=True)
    return {**artifact, "s3": {**{k: v for k, v in s3.items() if k != "key"}, "key": key}}


def wait() -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # main's emissary still writes its exit code
    template = json.loads(os.environ.get("ARGO_TEMPLATE", "{}"))
    outputs = template.get("outputs") or {}
    errors: list[str] = []

    def attempt(what, *args):
        try:
            return what(*args)
        except Exception as exc:  # every step runs; each failure is the executor's error, logged
            errors.append(str(exc))
            print(f"argoexec wait: executor error: {exc}", flush=True)
            return None

    results = TaskResults() if os.environ.get("ARGO_NODE_ID") else None
    if results is not None:
        attempt(results.initialize)
    while not os.path.exists(EXIT_FILE):
        time.sleep(0.2)
    print(f"argoexec wait: main exited with {open(EXIT_FILE).read()}", flush=True)
    parameters = attempt(save_parameters, outputs) or []
    artifacts, failures = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for artifact in outputs.get("artifacts") or []:
            try:
                saved = save_artifact(artifact, template.get("archiveLocation"), scratch)
                artifacts += [saved] if saved else []
            except Exception as exc:  # SaveArtifacts goes on with the next one and joins the errors
                failures.append(f"{exc}; ")
    if failures:
        errors.append("".join(failures))
        print(f"argoexec wait: executor error: {errors[-1]}", flush=True)
    if results is not None:
        attempt(results.report, {"parameters": parameters, "artifacts": artifacts})
        attempt(results.finalize)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "init":
        init()
    elif command == "wait":
        wait()
    elif command == "emissary":
        emissary(sys.argv[sys.argv.index("--") + 1:])
    else:
        sys.exit(f"argoexec stand-in: unknown command {command}")
