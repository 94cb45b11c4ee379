"""A job whose master is gone and whose folder nobody outside its pod can read, as its MLflow run
recorded it: what `get --backend kubernetes` shows once the job has ended (its master deleted
the status it kept in the cluster with everything else of the job)."""

from __future__ import annotations

from elastic_step.errors import ElasticStepError
from elastic_step.tracking.run import JOB_TAG, run_outcome
from elastic_step.tracking.uri import redact

# An MLflow run's status, as the job's state (a run's elastic_step.state tag says more: preempted).
RUN_STATES = {"FINISHED": "succeeded", "FAILED": "failed", "KILLED": "stopped", "RUNNING": "running (no status: master gone?)",
              "SCHEDULED": "pending"}


def job_from_mlflow(job: str, tracking_uri: str) -> dict | None:
    """The newest run tagged with job `job`, as a job `folder.view_of` shows; None without one."""
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri)
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, filter_string=f"tags.`{JOB_TAG}` = '{job.replace(chr(39), '')}'",
                                  order_by=["attributes.start_time DESC"], max_results=1) if experiments else []
    except Exception as exc:
        raise ElasticStepError(f"cannot search MLflow at {redact(tracking_uri)} for job {job!r} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check --mlflow-uri and its credentials") from None
    if not runs:
        return None
    run = runs[0]
    metrics = run.data.metrics
    losses = client.get_metric_history(run.info.run_id, "loss") if "loss" in metrics else []
    status = {
        "job": job, "state": (run_outcome(run) if run.info.status in ("FINISHED", "FAILED", "KILLED")
                              else RUN_STATES.get(run.info.status, run.info.status.lower())),
        "started_at": run.info.start_time / 1000 if run.info.start_time else None,
        "ended_at": run.info.end_time / 1000 if run.info.end_time else None,
        "step": max(m.step for m in losses) if losses else None, "loss": metrics.get("loss"),
        "workers": [],
    }
    test_metrics = {k[len("test_"):]: v for k, v in metrics.items() if k.startswith("test_")}
    info = {"job": job, "backend": "kubernetes",
            "mlflow": {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": redact(tracking_uri),
                       "ui": ""}}
    history = [client.get_metric_history(run.info.run_id, "recovery_s")] if "recovery_s" in metrics else [[]]
    events = [{"event": "recovered", "seconds": m.value, "time": m.timestamp / 1000} for m in history[0]]
    return {"live": False, "remote": True, "status": status, "events": events, "info": info,
            "result": {"run_id": run.info.run_id, **({"test_metrics": test_metrics} if test_metrics else {})}}
