"""`make image-smoke`, second part: the compiled training pipeline
(pipelines/compiled/training_pipeline.yaml) run by KFP's own `kfp.local.DockerRunner` on the
built image, so each component starts in its image exactly as KFP starts it: the command and
arguments of the compiled YAML, the image's user, nothing of this checkout inside. The tasks use
the host's network (the machine has no bridge) to reach an MLflow server on 127.0.0.1, whose
artifacts it stores itself. Asserts that the pipeline trained, judged and promoted a model.

Needs DOCKER_HOST pointing at a daemon that holds the image (images/smoke.sh sets it)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPILED = os.path.join(ROOT, "pipelines", "compiled", "training_pipeline.yaml")
MODEL_NAME = "digits-in-docker"


def main() -> int:
    from kfp import local
    from kfp.components import load_component_from_file
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from mlflow_server import MlflowServer

    # The tasks run as the image's user (1000), not as this process's: the folders KFP's local
    # runner makes here for their outputs must be writable by it.
    os.umask(0)
    root = tempfile.mkdtemp(prefix="kfp-docker-")
    pipeline_root = os.path.join(root, "kfp")
    os.makedirs(pipeline_root)
    for folder in (root, pipeline_root):
        os.chmod(folder, 0o777)
    server = MlflowServer(os.path.join(root, "mlflow"))
    server.start()
    started = time.monotonic()
    try:
        local.init(runner=local.DockerRunner(network_mode="host", entrypoint=[]),
                   pipeline_root=pipeline_root, raise_on_error=True)
        pipeline = load_component_from_file(COMPILED)
        pipeline(mlflow_uri=server.uri, registered_model=MODEL_NAME, workers="2", epochs=3, minibatch_size=16,
                 rows_per_shard=256, floors={"accuracy": 0.85}, job_dir="/tmp/train")
        client = MlflowClient(server.uri)
        champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
        run = client.get_run(champion.run_id)
        accuracy = run.data.metrics.get("test_accuracy")
        assert accuracy is not None and accuracy >= 0.85, f"champion's test accuracy {accuracy}"
        print(f"kfp-docker: PASSED: the compiled training pipeline ran in the image under kfp.local.DockerRunner in "
              f"{time.monotonic() - started:.0f}s; {MODEL_NAME} v{champion.version} is champion "
              f"(test accuracy {accuracy:.3f})")
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
