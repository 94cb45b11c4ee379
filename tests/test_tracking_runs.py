"""Finding a job's run again: `--resume`, and a retried pipeline step by its run id tag."""

import os

from elastic_step.tracking.run import RunTracker, connect


def tracker(tmp_path, job="job", pipeline_run=""):
    client = connect(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path))
    return RunTracker(client, "exp", job, str(tmp_path / "artifacts"), pipeline_run)


def test_a_retried_pipeline_task_finds_its_run_by_the_pipeline_run_it_is_given(tmp_path, monkeypatch):
    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME"):
        monkeypatch.delenv(name, raising=False)
    first = tracker(tmp_path, pipeline_run="kfp-run-7")
    assert first.start(resume=False) is False
    assert first.client.get_run(first.run_id).data.tags["elastic_step.pipeline_run_id"] == "kfp-run-7"
    retry = tracker(tmp_path, pipeline_run="kfp-run-7")
    assert retry.start(resume=False) is True and retry.run_id == first.run_id
    other = tracker(tmp_path, pipeline_run="kfp-run-8")
    assert other.start(resume=False) is False and other.run_id != first.run_id
    assert "ELASTIC_STEP_PIPELINE_RUN_ID" not in os.environ  # passed as a value, not through the environment


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
    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME"):
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


def test_resume_finds_a_run_by_its_exact_job_name_whatever_characters_it_holds(tmp_path, monkeypatch):
    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME"):
        monkeypatch.delenv(name, raising=False)
    names = ["it's", 'say "hi"', "both ' and \"", "x' or tags.`elastic_step.job` != '", "job", "job "]
    runs = {}
    for name in names:
        first = tracker(tmp_path, job=name)
        first.start(resume=False)
        runs[name] = first.run_id
    for name in names:
        again = tracker(tmp_path, job=name)
        assert again.start(resume=True) is True and again.run_id == runs[name], name
    unknown = tracker(tmp_path, job="jo")
    assert unknown.start(resume=True) is False and unknown.run_id not in runs.values()


def test_resume_refuses_a_run_of_other_data_model_or_task_size_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    import pytest

    from elastic_step.errors import ConfigError

    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME"):
        monkeypatch.delenv(name, raising=False)
    params = {"data_content_hash": "aaa", "model_def": "m.py", "model_def_sha256": "111", "rows_per_task": 32, "epochs": 3}
    first = tracker(tmp_path)
    first.start(resume=False)
    first.log_params(params)
    assert first.uploader.drain(30)
    first.client.set_terminated(first.run_id, "FAILED")
    for key, value, what in [("data_content_hash", "bbb", "data content hash"), ("model_def", "n.py", "model definition"),
                             ("model_def_sha256", "222", "model definition's source"), ("rows_per_task", 64, "task size")]:
        with pytest.raises(ConfigError) as refused:
            tracker(tmp_path).start(resume=True, params={**params, key: value})
        message = str(refused.value)
        assert "\n" not in message and what in message and f"cannot resume run {first.run_id}" in message
        assert repr(params[key]) in message or repr(str(params[key])) in message
        assert first.client.get_run(first.run_id).info.status == "FAILED"
    same = tracker(tmp_path)
    assert same.start(resume=True, params={**params, "epochs": 4}) is True and same.run_id == first.run_id


def test_connecting_points_this_process_at_the_store_but_not_the_processes_it_starts(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    connect(uri, str(tmp_path))
    assert mlflow.get_tracking_uri() == uri
    # a job's workers, a pipeline's next step, a later job: none inherits this store (or its password)
    assert "MLFLOW_TRACKING_URI" not in os.environ
