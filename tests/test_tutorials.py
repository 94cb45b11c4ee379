"""The tutorials in docs/tutorials/ as a platform engineer follows them, on the cluster stand-in.

Each ```bash block of a tutorial starts with a marker line: `# played` (optionally `# played: WHY
PARTLY`) — run here, as written, with bash in a scratch folder that links only deploy/ and .venv,
with the Debian package's kubectl and a kubeconfig of the stand-in's admin (`Cluster.kubeconfig`),
and the **Expected output** ```text block under it checked line by line against what it printed;
or `# not played: REASON` — needs a registry, Docker, or KFP's or Argo's own server; listed with
its reason, never faked. What the played blocks made is then checked through the API: the Secrets
and their keys, the rights of the account the steps run as, the image the rendered files name.

KFP's or Kubeflow's own install (their roles, the `pipeline-runner` or `default-editor` account,
KFP's store Secret) stands in for what a real install already has, as in
tests/test_cluster_kfp_installed.py. `kubectl apply -k deploy/mlflow` is played partly: the stand-in
has no Deployments or PersistentVolumeClaims (no controllers), so the kustomization kubectl renders
is applied without those two kinds (SERVED_PART_OF_MLFLOW)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from cluster import Cluster, REPO
from elastic_step import defaults
from cluster.rbac import read_platform

pytestmark = pytest.mark.e2e

KUBECTL = shutil.which("kubectl")
TUTORIALS = os.path.join(REPO, "docs", "tutorials")
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
# What the stand-in cannot serve of deploy/mlflow (it has no controllers): `kubectl apply -k
# deploy/mlflow` is played as the same kustomization, rendered by kubectl, without these kinds.
UNSERVED_KINDS = ["Deployment", "PersistentVolumeClaim"]
SERVED_PART_OF_MLFLOW = (
    "kubectl kustomize deploy/mlflow | python -c 'import sys, yaml; yaml.safe_dump_all([o for o in "
    f"yaml.safe_load_all(sys.stdin) if o and o[\"kind\"] not in {json.dumps(UNSERVED_KINDS)}], sys.stdout)' "
    "| kubectl apply -f -")


@dataclass
class Block:
    marker: str  # "played" or "not played"
    reason: str  # the marker's, continued on the comment lines under it
    script: str
    first_command: str
    expected: list[str] = field(default_factory=list)


def blocks(name: str) -> list[Block]:
    """The tutorial's bash blocks with their markers, each with the text block that follows it
    (before the next bash block) as its expected output."""
    with open(os.path.join(TUTORIALS, name), encoding="utf-8") as f:
        found = BLOCK.findall(f.read())
    out: list[Block] = []
    for lang, body in found:
        if lang == "bash":
            lines = body.splitlines()
            match = re.fullmatch(r"# (played|not played)(?::\s*(.*))?", lines[0].strip())
            assert match, f"{name}: a bash block without a '# played' or '# not played: REASON' marker: {lines[0]!r}"
            assert match.group(1) == "played" or match.group(2), f"{name}: a block not played without a reason"
            lead = next((i for i, line in enumerate(lines[1:], 1) if not line.startswith("#")), len(lines))
            reason = " ".join([match.group(2) or ""] + [line[1:].strip() for line in lines[1:lead]]).strip()
            out.append(Block(match.group(1), reason, body, lines[lead] if lead < len(lines) else ""))
        elif lang == "text" and out and not out[-1].expected:
            out[-1].expected = [line.strip() for line in body.splitlines() if line.strip()]
    return out


def dockerfile_from(name: str) -> str:
    with open(os.path.join(TUTORIALS, name), encoding="utf-8") as f:
        docker = [body for lang, body in BLOCK.findall(f.read()) if lang == "dockerfile"]
    assert len(docker) == 1, f"{name}: one FROM example"
    return docker[0].splitlines()[0].split()[1]


@pytest.fixture(scope="module")
def kubectl_ok():
    if KUBECTL is None:
        pytest.fail("kubectl is not installed (.ci/run installs Debian's kubectl)")


def made_by_stand_in(line: str) -> str:
    """The line kubectl prints for an object the stand-in made before the tutorial began: the
    cluster starts with deploy/'s namespace and service accounts (Cluster.__enter__), which
    `kubectl apply` then reports as configured where a fresh cluster says created."""
    kind = line.split("/", 1)[0]
    return line.replace(" created", " configured") if kind in ("namespace", "serviceaccount") else line


def play(name: str, cluster: Cluster, tmp_path) -> dict[str, str]:
    """Every played block of tutorial `name`, in order; their outputs by block index. A block that
    fails fails the test."""
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(os.path.join(REPO, "deploy"), work / "deploy")
    os.symlink(os.path.join(REPO, ".venv"), work / ".venv")
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(tmp_path),
           "KUBECONFIG": cluster.kubeconfig(tmp_path, "admin", cluster.admin_token)}
    outputs, not_played = {}, []
    for index, block in enumerate(blocks(name)):
        if block.marker == "not played":
            not_played.append(f"{block.first_command}  ({block.reason})")
            continue
        script = block.script.replace("kubectl apply -k deploy/mlflow", SERVED_PART_OF_MLFLOW)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{name}, block {index} exited {done.returncode}:\n{script}\n{output}"
        for line in block.expected:
            assert line in output or made_by_stand_in(line) in output, \
                f"{name}, block {index}: {line!r} not in its output:\n{output}"
        outputs[index] = output
    print(f"{name}: not played (need a real cluster):\n  " + "\n  ".join(not_played))
    assert not_played, f"{name}: says nothing of what needs a real cluster"
    return outputs


def secret_keys(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    secret = cluster.server.get("secrets", namespace, name)
    assert secret is not None, f"Secret {namespace}/{name} was not made"
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def can_i(cluster: Cluster, tmp_path, namespace: str, account: str, *what: str) -> str:
    config = cluster.kubeconfig(tmp_path, f"{namespace}-{account}", cluster.token_for(namespace, account))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "KUBECONFIG": config}
    done = subprocess.run([KUBECTL, "auth", "can-i", *what, "-n", namespace], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def check_mlflow_and_image(cluster: Cluster, name: str, namespace: str, tmp_path) -> None:
    """What every tutorial makes the same way: MLflow's admin Secret, the pipelines' MLflow user's
    Secret in the steps' namespace, and a FROM line on the name `make push` pushes."""
    files = tmp_path / "work" / "secrets"
    admin = secret_keys(cluster, "mlflow", "mlflow-auth")
    assert set(admin) == {"admin-username", "admin-password", "flask-secret-key"} and len(admin["admin-password"]) >= 24
    assert admin["admin-password"] == (files / "mlflow-auth" / "admin-password").read_text()
    assert oct((files / "mlflow-auth" / "admin-password").stat().st_mode & 0o777) == "0o600"  # umask 077
    assert cluster.server.get("networkpolicies", "mlflow", "mlflow") is not None
    user = secret_keys(cluster, namespace, "mlflow-credentials")
    # The uri is the default every shipped file names (deploy/mlflow's Service), and the password the
    # one the (not played) create_user step gives MLflow: the same file.
    assert user == {"uri": defaults.MLFLOW_SERVICE_URI, "username": "pipelines",
                    "password": (files / "mlflow-user" / "password").read_text()}
    assert len(user["password"]) >= 24
    pushed = subprocess.run(["make", "-n", "push", "IMAGE_REGISTRY=registry.example.com/team"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    assert f"push {dockerfile_from(name)}" in pushed, pushed


def test_argo_tutorial(kubectl_ok, tmp_path):
    with Cluster(str(tmp_path / "cluster")) as cluster:
        play("argo.md", cluster, tmp_path)
        check_mlflow_and_image(cluster, "argo.md", "ml", tmp_path)
        for name, keys in (("argo-artifacts-s3", {"accesskey", "secretkey"}),
                           ("training-data-store", {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"})):
            assert set(secret_keys(cluster, "ml", name)) == keys
        # The steps' account may do what Argo's executor and the master do, after `kubectl apply -k deploy/`.
        for what in (("create", "workflowtaskresults.argoproj.io"), ("create", "networkpolicies.networking.k8s.io"),
                     ("create", "pods"), ("delete", "secrets")):
            assert can_i(cluster, tmp_path, "ml", "elastic-step-runner", *what) == "yes", what
        # The deploy step's own account writes the model server; the runner may not.
        for what in (("create", "deployments.apps"), ("update", "services")):
            assert can_i(cluster, tmp_path, "ml", "elastic-step-deployer", *what) == "yes", what
            assert can_i(cluster, tmp_path, "ml", "elastic-step-runner", *what) == "no", what
        template = (tmp_path / "work" / "my-argo" / "training-workflowtemplate.yaml").read_text()
        assert "name: training-data-store" in template and "name: mlflow-credentials" in template
        assert "mlflow-uri" not in template  # with credentials, no parameter can send them elsewhere


@pytest.mark.parametrize("tutorial, namespace, account, platform", [
    ("kfp-standalone.md", "kubeflow", "pipeline-runner", "kfp-single-user"),
    ("kubeflow-multi-user.md", "kubeflow-user-example-com", "default-editor", "kubeflow-multi-user"),
])
def test_kfp_tutorials(kubectl_ok, tmp_path, tutorial, namespace, account, platform):
    with Cluster(str(tmp_path / "cluster"), namespace=namespace) as cluster:
        cluster.apply(read_platform(platform), namespace)  # what KFP's (or Kubeflow's) install already made
        play(tutorial, cluster, tmp_path)
        check_mlflow_and_image(cluster, tutorial, namespace, tmp_path)
        assert set(secret_keys(cluster, namespace, "elastic-step-data-reader")) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        labels = cluster.server.get("namespaces", "", namespace)["metadata"]["labels"]
        assert labels.get("elastic-step/jobs") == "true"  # what deploy/mlflow's NetworkPolicy admits
        assert cluster.server.get("serviceaccounts", namespace, "elastic-step-worker") is not None
        # The task's account may now do what the master calls, with its own token.
        for what in (("create", "secrets"), ("patch", "configmaps"), ("create", "networkpolicies.networking.k8s.io"),
                     ("create", "pods")):
            assert can_i(cluster, tmp_path, namespace, account, *what) == "yes", what
        compiled = (tmp_path / "work" / "my-kfp" / "training_pipeline.yaml").read_text()
        assert "mlflow-credentials" in compiled and "ghcr.io" not in compiled
