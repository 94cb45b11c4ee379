"""`make demo`: the training pipeline, then the retraining pipeline, run by KFP's local runner.

1. `training_pipeline` with 3 local workers: one of them is killed with SIGKILL mid-epoch; the
   job goes on without it, the evaluation gate judges the model, and it becomes @champion.
2. `retraining_pipeline`: warm-starts from @champion, is judged against it, and is promoted
   only if it is better — the demo says which, and why.
3. The champion is served (`elastic-step serve`'s server, on 127.0.0.1) and answers a request of
   a few test rows; the answers are printed beside the rows' labels.
MLflow keeps everything in a local SQLite file; the summary ends with the command that opens
the MLflow UI on those runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time

from elastic_step.audit import audit_report
from elastic_step.operate.client import try_status

OUT = os.path.abspath(os.environ.get("ELASTIC_STEP_DEMO_DIR", "demo-output"))
MODEL = "digits"
SETTINGS = dict(source="sklearn:digits", model_def="elastic_step.model_zoo.digits_torch", registered_model=MODEL,
                workers="2:3", minibatch_size=16, rows_per_shard=256)


def kill_one_worker_mid_epoch(job_dir: str, killed: list, stop: threading.Event) -> None:
    """Once all 3 workers train, from epoch 2 on and with a fifth of the rows still to go, SIGKILL
    the rank-1 worker (a real signal to a real process, as a node failure would deliver it). Not
    "in epoch 2" only: an epoch of the demo's data takes a fifth of a second, shorter than a few
    of these looks at the job's status."""
    while not stop.is_set():
        status = try_status(job_dir)
        if (status and status["epoch"] >= 1 and status["world_size"] == 3
                and status["rows_total"] * 0.15 < status["rows_done"] < status["rows_total"] * 0.8):
            victim = next(w for w in status["workers"] if w["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim)
            print(f"   >>> killed worker {victim['id']} (pid {victim['pid']}) with SIGKILL in epoch {status['epoch'] + 1}",
                  flush=True)
            return
        time.sleep(0.05)


def run_pipeline(pipeline, job_dir: str, mlflow_uri: str, inject_kill: bool, **params) -> dict:
    killed: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=kill_one_worker_mid_epoch, args=(job_dir, killed, stop), daemon=True)
    if inject_kill:
        watcher.start()
    try:
        pipeline(mlflow_uri=mlflow_uri, job_dir=job_dir, **SETTINGS, **params)
    finally:
        stop.set()
    with open(os.path.join(job_dir, "result.json")) as f:
        result = json.load(f)
    result["killed"] = killed
    return result


def trained_data(job_dir: str) -> str:
    """The prepared dataset the job trained on, as its model metadata records it."""
    with open(os.path.join(job_dir, "model", "model.json")) as f:
        return json.load(f)["data"]


def exactly_once(job_dir: str, epochs: int) -> dict:
    return audit_report(os.path.join(job_dir, "audit.jsonl"), trained_data(job_dir), epochs=epochs)


def ask_the_champion(data: str, mlflow_uri: str, name: str = MODEL, rows: int = 8, log_dir: str = OUT) -> list[tuple[int, int]]:
    """Serve models:/NAME@champion as `elastic-step serve` does, POST the first `rows` test rows
    of `data` to its /invocations and return (predicted class, label) pairs."""
    import httpx
    import numpy as np

    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import ShardReader
    from elastic_step.frameworks.model_def import batch_arrays, load_model_definition
    from elastic_step.release import serve

    manifest = load_manifest(data)
    reader = ShardReader(manifest)
    try:
        batch = reader.read("test", 0, 0, rows)
    finally:
        reader.close()
    features, labels = batch_arrays(load_model_definition(SETTINGS["model_def"]), batch, manifest.features, manifest.label)
    server = serve.start(f"models:/{name}@champion", mlflow_uri=mlflow_uri, log=open(os.path.join(log_dir, "serve.log"), "w"))
    try:
        answer = httpx.post(f"{server.url}/invocations", json={"inputs": np.asarray(features).tolist()}, timeout=60)
        answer.raise_for_status()
    finally:
        server.stop()
    predicted = np.asarray(answer.json()["predictions"]).argmax(axis=1)
    return [(int(p), int(label)) for p, label in zip(predicted, np.asarray(labels).reshape(-1))]


def main() -> int:
    import logging

    from kfp import local

    from elastic_step.pipelines.retraining_pipeline import retraining_pipeline
    from elastic_step.pipelines.training_pipeline import training_pipeline
    from elastic_step.tracking.run import connect

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    started = time.time()
    mlflow_uri = f"sqlite:///{OUT}/mlflow.db"
    client = connect(mlflow_uri, OUT)  # creates the schema once, before any task opens the file
    logging.getLogger("httpx").setLevel(logging.WARNING)  # kfp.local sets the root logger to INFO
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=os.path.join(OUT, "kfp"))

    print("1. training_pipeline (kfp.local): prepare -> train (3 workers, one SIGKILLed) -> evaluate -> export -> promote", flush=True)
    first = run_pipeline(training_pipeline, os.path.join(OUT, "train"), mlflow_uri, inject_kill=True, epochs=8)
    print("2. retraining_pipeline: warm start from @champion, judged against it", flush=True)
    second = run_pipeline(retraining_pipeline, os.path.join(OUT, "retrain"), mlflow_uri, inject_kill=False, epochs=3)

    champion = client.get_model_version_by_alias(MODEL, "champion")
    gate = client.get_run(second["run_id"]).data.tags
    audit = exactly_once(os.path.join(OUT, "train"), epochs=8)
    recovery = ", ".join(f"{s:.2f}s" for s in first["recoveries_s"]) or "no recovery recorded"
    print("\n3. summary")
    print(f"   training:   test accuracy {first['test_metrics']['accuracy']:.4f}; recovery after the SIGKILL {recovery}")
    print(f"   rows audited: {audit['rows_applied']} of {audit['rows_expected']} "
          f"({'every row of every epoch exactly once' if audit['exact'] else 'NOT exact: ' + json.dumps(audit)})")
    print(f"   retraining: test accuracy {second['test_metrics']['accuracy']:.4f}; "
          f"{'promoted' if str(champion.run_id) == second['run_id'] else 'not promoted'}: "
          f"{gate.get('elastic_step.gate.reason', 'the gate left no reason')}")
    print(f"   champion:   {MODEL} version {champion.version} (run {champion.run_id})")
    answers = ask_the_champion(trained_data(os.path.join(OUT, "train")), mlflow_uri)
    right = sum(p == label for p, label in answers)
    print(f"   served:     the champion answered {len(answers)} test rows over HTTP, {right} right: "
          + ", ".join(f"{p} (label {label})" for p, label in answers))
    print(f"   took {time.time() - started:.0f}s; everything is in {OUT}")
    print(f"   open the MLflow UI on these runs:  mlflow ui --backend-store-uri {mlflow_uri}")
    return 0 if audit["exact"] and first["killed"] and answers else 1


if __name__ == "__main__":
    sys.exit(main())
