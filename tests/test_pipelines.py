"""The retraining pipeline end to end through KFP's local runner (SubprocessRunner, no venv per
task): real tasks, real worker processes, one of them SIGKILLed, a real MLflow store. The run
happens once and the tests below inspect what it left; a weak champion is registered first, so
the run warm-starts from it and must beat it to be promoted. It then deploys the new champion
(`serve_target=mlflow`) to the cluster its KUBECONFIG names, as a user of kfp.local has one: the
tests' stand-in (tests/cluster), whose pods run on this node and read its MLflow store."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace
from unittest import mock

import httpx
import numpy as np
import pytest
from conftest import cli
from mlflow.tracking import MlflowClient

from elastic_step.audit import audit_report
from elastic_step.pipelines.demo import ask_the_champion, kill_one_worker_mid_epoch

NAME = "digits-pipeline-test"
EPOCHS = 6


@pytest.fixture(scope="module")
def serving_cluster(tmp_path_factory):
    """The cluster the run deploys to: the stand-in with Deployments, Services and readiness
    probes (apps.py), the server pods' account and Secret, and an admin's kubeconfig. Its pods
    run on this node's filesystem (the process runtime without namespaces), so the server reads
    the run's SQLite registry as the run's own tasks do."""
    from kubernetes import client as k8s

    from cluster import Cluster
    from cluster.apps import start_apps

    root = tmp_path_factory.mktemp("serving")
    with Cluster(str(root / "cluster"), isolate=False) as cluster:
        apps = start_apps(cluster)
        try:
            api = cluster.core()
            api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="model-store")))
            api.create_namespaced_service_account(cluster.namespace, k8s.V1ServiceAccount(
                metadata=k8s.V1ObjectMeta(name="model-server"), secrets=[k8s.V1ObjectReference(name="model-store")]))
            yield SimpleNamespace(cluster=cluster, apps=apps, kubeconfig=cluster.kubeconfig(root, "admin", cluster.admin_token))
        finally:
            apps.close()


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, digits, serving_cluster):
    from kfp import local

    from elastic_step.pipelines.retraining_pipeline import retraining_pipeline
    from elastic_step.release.export import export_model
    from elastic_step.release.promote import promote
    from elastic_step.training_step import train_step
    from elastic_step.tracking.run import connect

    root = tmp_path_factory.mktemp("pipeline")
    uri = f"sqlite:///{root}/mlflow.db"
    connect(uri, str(root))
    # A weak champion: one short epoch on big batches.
    weak = train_step(data=digits, model_dir=str(root / "weak-model"), model_def="elastic_step.model_zoo.digits_torch",
                      workers="1", epochs=1, minibatch_size=128, minibatches_per_task=1, checkpoint_steps=0,
                      mlflow_uri=uri, job_dir=str(root / "weak"), job_name="weak")
    weak_version = export_model(run_id=weak.job.run_id, model_uri=weak.job.model_uri, data=digits, registered_model=NAME,
                                mlflow_uri=uri).version
    promote(NAME, weak_version, mlflow_uri=uri)

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root / "kfp"))
    job_dir = str(root / "train")
    killed, stop = [], threading.Event()
    watcher = threading.Thread(target=kill_one_worker_mid_epoch, args=(job_dir, killed, stop), daemon=True)
    watcher.start()
    serve = dict(serve_target="mlflow", serve_namespace=serving_cluster.cluster.namespace,
                 serve_service_account="model-server", serve_storage_secret="model-store")
    try:
        with mock.patch.dict(os.environ, {"KUBECONFIG": serving_cluster.kubeconfig}):  # kfp.local's tasks inherit it
            retraining_pipeline(mlflow_uri=uri, job_dir=job_dir, registered_model=NAME, workers="2:3", epochs=EPOCHS,
                                minibatch_size=16, rows_per_shard=256, floors={"accuracy": 0.9}, min_gains={"accuracy": 0.0},
                                **serve)
    finally:
        stop.set()
    result = json.load(open(os.path.join(job_dir, "result.json")))
    return dict(uri=uri, root=root, job_dir=job_dir, result=result, killed=killed, weak=weak, weak_version=weak_version,
                client=MlflowClient(uri), serving=serving_cluster)


def champion_and_previous(client, name=NAME):
    return tuple(str(client.get_model_version_by_alias(name, a).version) for a in ("champion", "previous-champion"))


def test_training_survives_a_sigkill_and_applies_every_row_exactly_once(pipeline_run):
    assert pipeline_run["killed"], "the worker kill was never injected"
    result = pipeline_run["result"]
    assert result["recoveries_s"] and max(result["recoveries_s"]) < 5
    data = json.load(open(os.path.join(pipeline_run["job_dir"], "model", "model.json")))["data"]
    report = audit_report(os.path.join(pipeline_run["job_dir"], "audit.jsonl"), data, epochs=EPOCHS)
    assert report["exact"], report
    assert result["test_metrics"]["accuracy"] >= 0.90


def test_a_better_model_is_promoted_and_the_previous_champion_kept(pipeline_run):
    client = pipeline_run["client"]
    champion, previous = champion_and_previous(client)
    assert previous == pipeline_run["weak_version"] and champion != previous
    version = client.get_model_version(NAME, champion)
    assert version.tags["elastic_step.source_run_id"] == pipeline_run["result"]["run_id"]
    assert version.tags["pipeline_run_id"]  # the KFP run that produced it
    reason = client.get_run(pipeline_run["result"]["run_id"]).data.tags["elastic_step.gate.reason"]
    assert reason.startswith("blessed against champion v" + previous) and "accuracy_score" in reason
    # The champion's evaluation is a child of the gate's run, in the candidate's experiment (not
    # MLflow's Default one, whose artifacts would land in the working folder of whoever ran it).
    candidate = client.get_run(pipeline_run["result"]["run_id"])
    gate_runs = client.search_runs([candidate.info.experiment_id], f"tags.`mlflow.parentRunId` = '{candidate.info.run_id}'")
    assert len(gate_runs) == 1 and gate_runs[0].data.tags["elastic_step.gate"] == "evaluation"
    children = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  f"tags.`mlflow.parentRunId` = '{gate_runs[0].info.run_id}'")
    assert [c.info.run_name for c in children] == [f"champion v{previous}"]
    assert children[0].info.experiment_id == candidate.info.experiment_id
    assert {a.path for a in client.list_artifacts(children[0].info.run_id)} >= {"confusion_matrix.png"}
    assert children[0].info.artifact_uri.startswith(client.get_experiment(candidate.info.experiment_id).artifact_location)
    assert client.get_run(candidate.info.run_id).data.params["init_from"] == f"models:/{NAME}@champion"  # warm-started

    # The run then deployed the new champion (dsl.If on promotion, serve_target mlflow): a request
    # through its Service answers with the registered version's own predictions, loaded here.
    from elastic_step import defaults
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.release.candidate import split_head
    from elastic_step.release.deploy_render import object_name
    from registered_models import predict

    serving = pipeline_run["serving"]
    (deployment,) = serving.cluster.objects("deployments")
    assert deployment["metadata"]["labels"]["elastic-step.io/model-version"] == champion
    data = json.load(open(os.path.join(pipeline_run["job_dir"], "model", "model.json")))["data"]
    rows = split_head(data, load_model_definition(defaults.MODEL_DEF), rows=8)
    url = serving.apps.service_url(serving.cluster.namespace, object_name(NAME))
    reply = httpx.post(f"{url}/invocations", json={"inputs": rows.tolist()}, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = predict(pipeline_run["uri"], f"models:/{NAME}/{champion}", rows)
    np.testing.assert_allclose(np.asarray(reply.json()["predictions"], dtype=np.float32), expected, rtol=1e-5, atol=1e-6)


def test_the_new_champion_answers_a_request_as_make_demo_sends_it(pipeline_run, digits, tmp_path):
    # `make demo` ends this way: the champion served by MLflow's model server on 127.0.0.1, a few
    # test rows POSTed to it, its classes printed beside the labels.
    answers = ask_the_champion(digits, pipeline_run["uri"], name=NAME, rows=16, log_dir=str(tmp_path))
    assert len(answers) == 16 and all(0 <= predicted <= 9 for predicted, _ in answers)
    right = sum(predicted == label for predicted, label in answers)
    assert right >= 12, answers  # a champion blessed at accuracy >= 0.9 gets most of them right


def test_a_worse_candidate_is_not_blessed_and_the_reason_names_the_metric(pipeline_run, tmp_path):
    client = pipeline_run["client"]
    before = champion_and_previous(client)
    weak = pipeline_run["weak"].job
    data = json.load(open(os.path.join(pipeline_run["job_dir"], "model", "model.json")))["data"]
    done = cli("evaluate", "--run-id", weak.run_id, "--data", data, "--registered-model", NAME,
               "--model-def", "elastic_step.model_zoo.digits_torch", "--floor", "accuracy=0.1",
               "--min-gain", "accuracy=0", "--mlflow-uri", pipeline_run["uri"], "--outputs", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "blessed").read_text() == "false"
    reason = (tmp_path / "reason").read_text()
    assert reason.startswith(f"not blessed against champion v{before[0]}") and "accuracy_score" in reason and "misses the required" in reason
    assert json.loads((tmp_path / "metrics.json").read_text())["accuracy_score"] < 0.9
    assert champion_and_previous(client) == before  # judging promotes nothing


def test_rollback_swaps_the_aliases_and_promote_is_idempotent(pipeline_run, tmp_path):
    client, uri = pipeline_run["client"], pipeline_run["uri"]
    champion, previous = champion_and_previous(client)
    done = cli("promote", "--registered-model", NAME, "--rollback", "--mlflow-uri", uri, "--outputs", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert champion_and_previous(client) == (previous, champion) and (tmp_path / "champion_version").read_text() == previous
    # Back to the new champion in this process (the function the CLI calls: one process less), then
    # the CLI once more with the same version: nothing to move.
    from elastic_step.release.promote import promote

    assert promote(NAME, champion, mlflow_uri=uri).changed
    again = cli("promote", "--registered-model", NAME, "--version", champion, "--mlflow-uri", uri)
    assert again.returncode == 0, again.stderr
    assert "was already @champion" in again.stdout
    assert champion_and_previous(client) == (champion, previous)


def test_promoting_a_version_that_does_not_exist_is_a_clear_error(pipeline_run):
    before = champion_and_previous(pipeline_run["client"])
    done = cli("promote", "--registered-model", NAME, "--version", "42", "--mlflow-uri", pipeline_run["uri"])
    assert done.returncode != 0 and "no version '42'" in done.stderr and "Traceback" not in done.stderr
    assert champion_and_previous(pipeline_run["client"]) == before


def test_when_evaluation_fails_the_retraining_pipeline_promotes_nothing(pipeline_run):
    """Retraining warm-starts from @champion; a threshold on an unknown metric makes evaluation
    fail, so export and promote never run."""
    from elastic_step.pipelines.retraining_pipeline import retraining_pipeline

    client = pipeline_run["client"]
    before = champion_and_previous(client)
    versions = len(client.search_model_versions(f"name = '{NAME}'"))
    job_dir = str(pipeline_run["root"] / "retrain-bad")
    with pytest.raises(RuntimeError, match="evaluate-model"):
        retraining_pipeline(mlflow_uri=pipeline_run["uri"], job_dir=job_dir, registered_model=NAME, workers="1",
                            epochs=1, minibatch_size=128, rows_per_shard=256, floors={"acuracy": 0.9})
    assert champion_and_previous(client) == before
    assert len(client.search_model_versions(f"name = '{NAME}'")) == versions
    retrained = json.load(open(os.path.join(job_dir, "result.json")))
    assert client.get_run(retrained["run_id"]).data.params["init_from"] == f"models:/{NAME}@champion"
