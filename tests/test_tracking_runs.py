"""Finding a job's run again: `--resume`, and a retried pipeline step by its run id tag."""

from elastic_step.tracking.run import RunTracker, connect


def tracker(tmp_path, job="job"):
    client = connect(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path))
    return RunTracker(client, "exp", job, str(tmp_path / "artifacts"))


def test_a_retried_pipeline_step_reopens_its_run_and_a_finished_one_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("KFP_RUN_ID", "pipeline-run-1")
    first = tracker(tmp_path)
    assert first.start(resume=False) is False
    retry = tracker(tmp_path)
    assert retry.start(resume=False) is True and retry.run_id == first.run_id
    retry.finish(ok=True)
    again = tracker(tmp_path)
    assert again.start(resume=False) is False and again.run_id != first.run_id
    monkeypatch.setenv("KFP_RUN_ID", "pipeline-run-2")
    other = tracker(tmp_path)
    assert other.start(resume=False) is False and other.run_id not in (first.run_id, again.run_id)


def test_resume_finds_the_jobs_run_without_a_pipeline_and_nests_under_a_parent(tmp_path, monkeypatch):
    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME", "ELASTIC_STEP_PIPELINE_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    parent = tracker(tmp_path, job="pipeline")
    parent.start(resume=False)
    first = tracker(tmp_path)
    first.start(resume=False, parent_run_id=parent.run_id)
    assert first.client.get_run(first.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    fresh = tracker(tmp_path)
    assert fresh.start(resume=False) is False  # without --resume a job starts a new run
    resumed = tracker(tmp_path)
    assert resumed.start(resume=True) is True and resumed.run_id == fresh.run_id
