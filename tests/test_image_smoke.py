"""The image `make image-smoke` builds is reused by the Docker tests and `make cluster
CLUSTER_DOCKER=1` only while it was built from the checkout as it is (cluster/image_sources.py's
digest, the image's label), and a second Docker daemon is never started on a data root a live one
holds (it would take that one's socket and unmount its data root): refused in one line naming it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cluster.image_sources import LABEL, digest, source_files
from cluster.rbac import REPO
from cluster.runtime import DaemonBusy, DockerDaemon, ImageState, live_daemon
from waiting import wait_for


def write(root, path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, path)) or root, exist_ok=True)
    with open(os.path.join(root, path), "w") as f:
        f.write(text)


def test_the_digest_follows_what_goes_into_the_image_and_nothing_else(tmp_path):
    for path, text in {"images/Dockerfile": "FROM x\n", "images/lock/torch.txt": "a==1\n", "pyproject.toml": "[project]\n",
                       "constraints.txt": "", "elastic_step/cli.py": "print(1)\n", "model_zoo/m.py": "", "README.md": "prose\n",
                       "tests/test_x.py": ""}.items():
        write(tmp_path, path, text)
    first = digest(str(tmp_path))
    assert "README.md" not in source_files(str(tmp_path)) and "images/Dockerfile" in source_files(str(tmp_path))
    write(tmp_path, "elastic_step/__pycache__/cli.cpython-311.pyc", "bytecode")  # .dockerignore keeps it out
    write(tmp_path, "README.md", "other prose\n")  # only the package's long description
    write(tmp_path, "tests/test_x.py", "changed")  # not in the image
    assert digest(str(tmp_path)) == first
    changes = [lambda: write(tmp_path, "elastic_step/cli.py", "print(2)\n"),
               lambda: write(tmp_path, "images/lock/torch.txt", "a==2\n"),
               lambda: write(tmp_path, "images/Dockerfile", "FROM y\n"),
               lambda: write(tmp_path, "elastic_step/new.py", ""),
               lambda: os.rename(tmp_path / "elastic_step/new.py", tmp_path / "elastic_step/renamed.py")]
    seen = {first}
    for change in changes:
        change()
        seen.add(digest(str(tmp_path)))
    assert len(seen) == len(changes) + 1  # each change made a digest of its own
    # The tensorflow image is built from the same files: its digest is its own, and follows them too.
    tensorflow = digest(str(tmp_path), "tensorflow")
    assert tensorflow not in seen and digest(str(tmp_path), "torch") in seen
    write(tmp_path, "images/lock/torch-tensorflow.txt", "keras==3\n")
    assert digest(str(tmp_path), "tensorflow") != tensorflow


def test_an_image_labelled_with_another_digest_is_stale_and_counts_as_absent(tmp_path, monkeypatch):
    """image_state reads the image's label through `docker image inspect` (a stand-in docker here)."""
    fake = tmp_path / "bin" / "docker"
    write(tmp_path, "bin/docker", '#!/bin/sh\n[ -n "$IMAGE_LABEL" ] || exit 1\necho "$IMAGE_LABEL"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    daemon = DockerDaemon(str(tmp_path / "work"))
    states = {}
    for case, label in {"missing": "", "unlabelled": "<no value>", "older": "0" * 64, "current": digest()}.items():
        monkeypatch.setenv("IMAGE_LABEL", label)
        states[case] = (daemon.image_state("img"), daemon.has_image("img"))
    assert states == {"missing": (ImageState.MISSING, False), "unlabelled": (ImageState.STALE, False),
                      "older": (ImageState.STALE, False), "current": (ImageState.CURRENT, True)}
    with open(os.path.join(REPO, "images", "smoke.sh")) as f:  # the label smoke.sh gives what it builds
        assert f'--label "{LABEL}=$(python3 tests/cluster/image_sources.py --variant "$1")"' in f.read()
    for variant, expected in {"torch": digest(), "tensorflow": digest(variant="tensorflow")}.items():
        said = subprocess.run(["python3", os.path.join(REPO, "tests", "cluster", "image_sources.py"), "--variant", variant],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert said == expected


def test_the_smoke_builds_trains_in_pushes_and_pulls_both_variants():
    """CI's `make image-smoke` covers every image `make images` builds: the tensorflow image is built
    with its own extras and label, trained in with Keras, pushed by `make push` and pulled back."""
    with open(os.path.join(REPO, "images", "smoke.sh")) as f:
        smoke = f.read()
    assert 'build_image torch torch "$IMAGE"' in smoke and 'build_image tensorflow torch,tensorflow "$IMAGE_TF"' in smoke
    assert '--entrypoint python "$IMAGE_TF" /smoke_keras_job.py' in smoke
    assert 'push IMAGE_REGISTRY="127.0.0.1:$RPORT/elastic-step" IMAGE_VARIANTS="torch tensorflow"' in smoke
    assert smoke.count("for v in torch tensorflow; do") == 3  # tagged, checked in the registry, pulled and run
    with open(os.path.join(REPO, "images", "smoke_keras_job.py")) as f:
        job = f.read()
    assert '"elastic_step.model_zoo.digits_keras"' in job and '"--workers", "2"' in job and 'report.get("exact")' in job


@pytest.fixture
def live(tmp_path):
    """A process named dockerd whose pid is in the folder's pidfile, as a running daemon leaves it."""
    work = tmp_path / "work"
    work.mkdir()
    named = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'dockerd'); time.sleep(120)"  # PR_SET_NAME: its comm
    proc = subprocess.Popen([sys.executable, "-c", named])
    (work / "dockerd.pid").write_text(f"{proc.pid}\n")
    wait_for(lambda: live_daemon(str(work)) == proc.pid, 30, "the fake daemon listed")
    yield work, proc
    proc.kill()
    proc.wait()


def test_a_second_daemon_on_a_folder_a_live_one_holds_is_refused_naming_it(live):
    work, proc = live
    daemon = DockerDaemon(str(work))
    with pytest.raises(DaemonBusy) as refused:
        daemon.start()
    message = str(refused.value)
    assert "\n" not in message and f"a Docker daemon already runs on {work} (pid {proc.pid}, started by pid {os.getpid()}" in message
    assert f"`kill {proc.pid}`" in message and "IMAGE_SMOKE_DIR" in message
    daemon.stop()  # nothing of the live one's is touched
    assert proc.poll() is None and sorted(os.listdir(work)) == ["dockerd.pid"]
    proc.kill()
    proc.wait()
    assert live_daemon(str(work)) is None  # a pidfile whose process is gone holds nothing


def test_make_cluster_with_docker_refuses_a_busy_folder_in_one_line(live, tmp_path):
    work, proc = live
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests"), "IMAGE_SMOKE_DIR": str(work)}
    done = subprocess.run([sys.executable, "-m", "cluster.local", "--docker", "--root", str(tmp_path / "root")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"cluster: a Docker daemon already runs on {work} (pid {proc.pid}"), done.stderr
    assert proc.poll() is None and not os.path.exists(work / "data")
