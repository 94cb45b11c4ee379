"""benchmarks/gpu_wheels.py: what a GPU machine's Python is given for the GPU check. Its wheels
are the run-time requirements a local job imports, less the cluster's (KFP, Hera, the Kubernetes
client, the object stores) and less what that machine has; a local job must therefore import
nothing of the cluster's, or the check would fail there on an import."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_gpu_wheels():
    """benchmarks/gpu_wheels.py by its path: benchmarks/ is not put on the session's sys.path,
    where its modules (common, ...) could stand for others of the same name."""
    spec = importlib.util.spec_from_file_location("gpu_wheels", os.path.join(ROOT, "benchmarks", "gpu_wheels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _load_gpu_wheels()


def test_what_the_gpu_machine_has_is_read_from_its_pip_list_in_any_spelling(tmp_path):
    listing = tmp_path / "present.txt"
    listing.write_text("# pip list --format=freeze\nNumPy==2.5.2\ntyping_extensions==4.15.0\n"
                       "my.pkg @ file:///tmp/my.pkg\npyarrow\n\n")
    assert gpu_wheels.present_versions(str(listing)) == {"numpy": "2.5.2", "typing-extensions": "4.15.0", "my-pkg": None,
                                                         "pyarrow": None}


def test_its_torch_and_cuda_are_never_carried_what_it_has_at_a_fit_version_neither_nvml_always_if_missing():
    wheels = ["torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_nccl_cu13-2.28-py3-none-any.whl",
              "triton-3.6.0-cp312-cp312-manylinux_2_28_x86_64.whl", "mlflow-3.17.2-py3-none-any.whl",
              "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl",
              "nvidia_ml_py-13.580.82-py3-none-any.whl", "fastapi-0.165.0-py3-none-any.whl"]
    requirements = ["numpy>=2", "fastapi>=0.165", "nvidia-ml-py>=12", "mlflow>=3.17,<3.18"]
    present = {"numpy": "2.5.2", "fastapi": "0.110.0", "torch": "2.11.0"}
    assert gpu_wheels.to_carry(wheels, present, requirements) == [
        "fastapi-0.165.0-py3-none-any.whl",  # too old there for the master's body cap: carried, and shadows it
        "mlflow-3.17.2-py3-none-any.whl", "nvidia_ml_py-13.580.82-py3-none-any.whl",
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl"]


def test_the_requirements_are_pyprojects_less_the_clusters_and_mlflows_extras():
    names = {gpu_wheels.canonical(r.split(">")[0].split("=")[0].split("<")[0]) for r in gpu_wheels.local_job_requirements()}
    assert {"mlflow", "fastapi", "uvicorn", "pydantic", "pyarrow", "tensorboardx"} <= names
    assert not names & gpu_wheels.CLUSTER_ONLY
    assert not [r for r in gpu_wheels.local_job_requirements() if "[" in r]


def test_a_present_list_that_cannot_be_read_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_wheels.py"), str(tmp_path / "none.txt")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("gpu_wheels: cannot read PRESENT") and "pip list --format=freeze" in line


def test_a_local_job_imports_nothing_of_the_clusters_requirements(tmp_path, digits):
    """Every process of a local job (master, workers) records the modules it imported."""
    recorder = tmp_path / "recorder"
    recorder.mkdir()
    (recorder / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "def _record():\n"
        f"    with open(os.path.join({str(recorder)!r}, f'modules.{{os.getpid()}}'), 'w') as f:\n"
        "        f.write('\\n'.join(sorted({m.split('.')[0] for m in list(sys.modules)})))\n"
        "atexit.register(_record)\n"
        "_exit = os._exit\n"
        "def _recording_exit(code):\n"
        "    _record()\n"
        "    _exit(code)\n"
        "os._exit = _recording_exit\n")
    env = dict(os.environ, PYTHONPATH=f"{recorder}{os.pathsep}{ROOT}")
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "train", "--model-def", "elastic_step.model_zoo.digits_torch",
                           "--data", digits, "--job-dir", str(tmp_path / "job"), "--workers", "2", "--epochs", "1",
                           "--checkpoint-steps", "0", "--no-progress"], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    records = list(recorder.glob("modules.*"))
    assert len(records) >= 3  # the master and its two workers
    imported = set().union(*(set(r.read_text().split()) for r in records))
    assert "mlflow" in imported and "torch" in imported  # the recorder saw the job's own imports
    assert not imported & {"kfp", "hera", "kubernetes", "s3fs", "gcsfs"}, imported & {"kfp", "hera", "kubernetes", "s3fs", "gcsfs"}
