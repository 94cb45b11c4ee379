"""The README's walk-through on the local cluster, played literally: its shell blocks marked
`walkthrough` are read from README.md (so the README cannot drift from what works), the first
(`make cluster CLUSTER_DOCKER=1 CLUSTER_POD_NETWORK=1`: Docker pods of the image `make image-smoke`
builds, each on an address of its own) run as a person's first terminal, the second command by
command in one bash as their second terminal, from a copy of the checkout made of links (its own
build/ folder; the image's Docker data root is the checkout's, as IMAGE_SMOKE_DIR names it).
Asserted: what a person looks at — the node, the pods on their own addresses, a worker pod
deleted mid-run and the job going on (its slot relaunched once, no drop repeated), the job
Succeeded with every row of every epoch audited once, `get`, `logs` and `delete`; a second job
scaled down to one worker and stopped at a checkpoint; the cluster's stop."""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest

from cluster.network import available
from cluster.runtime import image_smoke_dir
from cluster.rbac import REPO

pytestmark = pytest.mark.e2e

MARKER = "<!-- walkthrough: played literally by tests/test_walkthrough.py -->"
DIGITS_TRAIN_ROWS = 1437  # sklearn:digits' train split as prepare-data makes it (seed 0)


def walkthrough_blocks() -> list[list[str]]:
    """Each marked ```bash block of README.md as its commands (continuation lines joined)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(re.escape(MARKER) + r"\n```bash\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        commands.append([line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")])
    return commands


def checkout_of_links() -> str:
    """The repository as links, but for build/: the walk-through's cluster folder is its own. It
    lies in the repository's build/, which pods see as they see the repository (a folder under
    /tmp would be hidden by each pod's own /tmp, and the links in it with it)."""
    os.makedirs(os.path.join(REPO, "build"), exist_ok=True)
    folder = tempfile.mkdtemp(prefix="walkthrough-", dir=os.path.join(REPO, "build"))
    os.chmod(folder, 0o755)  # pods run as the image's user, who must reach the venv through it
    for name in os.listdir(REPO):
        if name not in ("build", ".git", ".pytest_cache", ".hypothesis", "mlruns"):
            os.symlink(os.path.join(REPO, name), os.path.join(folder, name))
    return folder


class Shell:
    """One bash, fed one command at a time, as a person's terminal: what each printed, and its
    exit status (a command still running after `timeout` seconds fails the test)."""

    def __init__(self, cwd: str, env: dict):
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.proc.stdin.write("exec 2>&1\n")
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def run(self, command: str, timeout: float = 420) -> tuple[int, str]:
        mark = f"__walkthrough_done_{time.monotonic_ns()}__"
        self.proc.stdin.write(f"{command}\n__walkthrough_rc=$?; echo; echo {mark} $__walkthrough_rc\n")
        self.proc.stdin.flush()
        lines, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{command!r} still runs after {timeout}s:\n{''.join(lines)[-4000:]}") from None
            if line.startswith(mark):
                return int(line.split()[1]), "".join(lines)
            lines.append(line)

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def job_record(root: str, job: str) -> tuple[list[dict], str]:
    """The master's events.jsonl as the node holds its scratch volume (before `delete` removes it),
    and the tail of its container's log (for a failure's message)."""
    pods = os.path.join(root, "build", "cluster", "cluster", "node", "pods")
    for uid in os.listdir(pods):
        path = os.path.join(pods, uid, "volumes", "scratch", job, "events.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                events = [json.loads(line) for line in f if line.strip()]
            log = ""
            for name in sorted(os.listdir(os.path.join(pods, uid, "containers"))):
                if os.path.exists(os.path.join(pods, uid, "containers", name, "log")):
                    with open(os.path.join(pods, uid, "containers", name, "log"), errors="replace") as f:
                        log += f.read()[-6000:]
            return events, log
    raise AssertionError(f"no events.jsonl of job {job} under {pods}")


@pytest.mark.timeout(1200)  # about 5 minutes on 2 loaded cores (more where the image is built first)
def test_the_readme_walkthrough_on_the_local_cluster_with_docker_pods():
    if not available():
        pytest.fail("this node cannot make network namespaces (needs root, iproute2 and unshare --net)")
    [[start], commands] = walkthrough_blocks()
    begun = time.monotonic()
    work = image_smoke_dir()
    root = checkout_of_links()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "MLFLOW_", "AWS_", "ELASTIC_STEP_"))}
    env["IMAGE_SMOKE_DIR"] = work  # the links' checkout has a build/ of its own
    env["PATH"] = os.path.join(REPO, ".venv", "bin") + os.pathsep + env.get("PATH", "")
    first = subprocess.Popen(["bash", "-c", start], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    shell = Shell(root, env)
    # took: each phase's seconds, printed (pytest shows them with a failure, or with -s) for whoever cuts its time
    said, took = {}, [("image-smoke's image checked", time.monotonic() - begun)]
    try:
        started, up = [], time.monotonic()
        for line in first.stdout:  # the first terminal, until it says the cluster is up
            started.append(line)
            if "Local cluster stand-in up" in line:
                break
        assert "Local cluster stand-in up" in "".join(started), "".join(started)
        took.append((start, time.monotonic() - up))
        for command in commands:
            if command.startswith("elastic-step delete "):  # what the master recorded, before its pod goes
                said[f"events {command.split()[2]}"], said[f"log {command.split()[2]}"] = job_record(root, command.split()[2])
            began = time.monotonic()
            code, out = shell.run(command)
            took.append((command.split("#")[0].strip(), time.monotonic() - began))
            said[command.split("#")[0].strip()] = out
            assert code == 0, f"{command}\n{out[-4000:]}"
        began = time.monotonic()
        assert first.wait(180) == 0  # every container and sandbox removed, the Docker daemon stopped
        took.append(("the first terminal's end", time.monotonic() - began))
    finally:
        print("where the walk-through's time went:", *(f"{s:7.1f} s  {c[:100]}" for c, s in took), sep="\n  ")
        shell.close()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGTERM)
            first.wait(60)
        shutil.rmtree(root)  # the links themselves, never what they point to

    def output(prefix: str) -> str:
        return next(out for command, out in said.items() if command.startswith(prefix))

    assert re.search(r"node-1\s+Ready", output("kubectl get nodes")), output("kubectl get nodes")
    pods = output("kubectl get pods -o wide")
    addresses = re.findall(r"^try-\S+\s+1/1\s+Running\s+\d+\s+\S+\s+(\S+)", pods, re.M)
    assert len(addresses) == 3 and len(set(addresses)) == 3, pods  # the master and two workers, each its own
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network("10.244.0.0/16") for a in addresses), pods
    epochs = int(re.search(r"--epochs (\d+)", next(c for c in said if c.startswith("elastic-step submit"))).group(1))
    logs = output("elastic-step logs")
    assert f"rows audited: {DIGITS_TRAIN_ROWS * epochs}" in logs, logs[-3000:]  # every row of every epoch, once
    assert "succeeded" in said["elastic-step get try"], said["elastic-step get try"]
    events = said["events try"]
    assert [e["event"] for e in events if e["event"].startswith("job_")] == ["job_succeeded"]
    # The pod the walk-through deleted: its worker left on the kubelet's TERM, or its pod was seen
    # deleted, or (on a loaded node, its TERM handled late) the master dropped it first as absent.
    slot_1 = [e for e in events if str(e.get("worker", "")).startswith("w1.")]
    gone = [e for e in slot_1 if e["event"] in ("left", "died", "dropped")]
    # None at all: the job ended before the delete took effect (a machine faster than the
    # README's --epochs allows for): the walk-through no longer shows what it says.
    assert len(gone) == 1, f"the deleted worker's events: {slot_1}"
    assert gone[0]["event"] == "dropped" or "deleted" in gone[0]["reason"] or "SIGTERM" in gone[0]["reason"], slot_1
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert [e["slot"] for e in relaunched] == [1], relaunched  # replaced once: no relaunch loop
    dropped = [e for e in events if e["event"] == "dropped"]
    assert len(dropped) <= 1, dropped  # never the same drop over and over
    # The second job: scaled to one worker, then stopped at a checkpoint (its master's pod Succeeded).
    assert "stopped at a checkpoint" in output("elastic-step stop more"), output("elastic-step stop more")
    more, seen = said["events more"], f"{[e['event'] for e in said['events more']]}\n{said['log more']}"
    assert [e.get("target") for e in more if e["event"] == "scaled"] == [1], seen
    assert [e["event"] for e in more if e["event"] in ("stopped", "job_succeeded", "job_failed")] == ["stopped"], seen
    assert "job more: stopped" in said["elastic-step get more"], said["elastic-step get more"]
