"""Exit codes a retry policy can use, and the pods' priority: the table (exit_codes.ExitCode) is the
one README.md shows and the one every error exits with; the shipped Argo train template retries
by it (its `retryStrategy.expression`, evaluated here as Argo's controller evaluates it); every pod
the job creates carries `--priority-class` and the project's one grace period."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from elastic_step import defaults
from elastic_step.argo import RenderOptions
from elastic_step.argo.render import render_texts
from elastic_step.errors import ConfigError, DataError, JobFailed, JobPreempted, ModelDefinitionError
from elastic_step.exit_codes import ExitCode, argo_retry_expression

ROOT = Path(__file__).resolve().parent.parent


def argo_decides(expression: str, exit_code: str, retries: int, status: str = "Failed") -> bool:
    """The expression as Argo's controller evaluates it after an attempt (operator.go
    processNodeRetries): expr-lang over buildRetryStrategyLocalScope's variables, all strings
    (`lastRetry.exitCode` "-1" when the pod left none; `retries` the retries made so far), with
    env.GetFuncMap's `asInt`. The grammar the template uses (string literals, == != <, and/or,
    parentheses, asInt) means the same in Python, which evaluates it here with those variables
    only; anything else in it is refused rather than guessed at."""
    allowed = re.sub(r"lastRetry\.(exitCode|status)|retries|asInt|and|or|'[^']*'|\d+|[()<=!]|\s", "", expression)
    assert allowed == "", f"the expression uses more than this evaluator knows: {allowed!r}"
    scope = {"lastRetry": SimpleNamespace(exitCode=exit_code, status=status), "retries": str(retries), "asInt": int}
    return bool(eval(expression, {"__builtins__": {}}, scope))  # noqa: S307 (the template's own text, checked above)


def train_template(options: RenderOptions | None = None, pipeline: str = "training") -> dict:
    texts = render_texts([pipeline], options or RenderOptions(image="example.org/elastic-step:test"))
    return yaml.safe_load(texts[f"{pipeline}-workflowtemplate.yaml"])


def test_every_error_exits_with_its_code_from_the_table():
    assert {ConfigError.exit_code, DataError.exit_code, ModelDefinitionError.exit_code} == {ExitCode.BAD_INPUT}
    assert JobFailed.exit_code == ExitCode.FAILED == 1 and JobPreempted.exit_code == ExitCode.PREEMPTED == 75
    assert ExitCode.SUCCESS == 0 and ExitCode.BAD_INPUT == 2


def test_the_readme_shows_the_table_as_it_is():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Exit codes"):]
    section = section[:section.index("\n## ", 1)]
    rows = dict(re.findall(r"^\| (\d+) \| `([A-Z_]+)` \|", section, re.M))
    assert rows == {str(code.value): code.name for code in ExitCode}, rows


@pytest.mark.parametrize("pipeline", ["training", "retraining"])
def test_the_shipped_train_template_retries_preemptions_and_failures_but_never_bad_input(pipeline):
    shipped = yaml.safe_load((ROOT / "pipelines" / "argo" / f"{pipeline}-workflowtemplate.yaml").read_text())
    retry = next(t for t in shipped["spec"]["templates"] if t["name"] == "train")["retryStrategy"]
    assert retry["retryPolicy"] == "Always"  # Failed (an exit code) and Error (a pod deleted) alike
    expression = retry["expression"]
    assert expression == argo_retry_expression(3)
    for code in ("75", "1", "137", "143", "-1"):  # preempted, failed, SIGKILLed, SIGTERMed, no exit code
        assert argo_decides(expression, code, retries=0), code
    assert not argo_decides(expression, "2", retries=0)  # bad input: never
    assert not argo_decides(expression, "1", retries=3) and not argo_decides(expression, "-1", retries=3, status="Error")
    assert argo_decides(expression, "75", retries=3) and argo_decides(expression, "75", retries=retry["limit"] - 1)
    assert "maxDuration" not in retry["backoff"]  # counted from the first attempt: it would end a long run's retries


def test_the_priority_class_reaches_every_pod_of_the_workflow_and_a_bad_name_is_refused():
    doc = train_template(RenderOptions(image="example.org/elastic-step:test", priority_class="batch-low"))
    assert doc["spec"]["podPriorityClassName"] == "batch-low"  # every step pod, the train step's master among them
    train = next(t for t in doc["spec"]["templates"] if t["name"] == "train")["container"]["args"]
    assert train[train.index("--priority-class") + 1] == "batch-low"  # its worker pods
    plain = train_template()
    assert "podPriorityClassName" not in plain["spec"]
    assert "--priority-class" not in next(t for t in plain["spec"]["templates"] if t["name"] == "train")["container"]["args"]
    with pytest.raises(ConfigError, match="--priority-class 'Batch Low'"):
        train_template(RenderOptions(image="example.org/elastic-step:test", priority_class="Batch Low"))


def test_worker_pods_carry_the_priority_class_and_the_one_grace_period():
    from elastic_step.backends.kubernetes.manifests import JobNames, worker_pod
    from elastic_step.backends.kubernetes.options import PodSettings

    settings = PodSettings(namespace="ml", image="example.org/elastic-step:test", priority_class="batch-low")
    pod = worker_pod(settings, JobNames("job", "abc123"), None, settings.image, "w0.1", 0, "http://10.0.0.1:8000")
    assert pod.spec.priority_class_name == "batch-low"
    assert pod.spec.termination_grace_period_seconds == defaults.TERMINATION_GRACE_S


def test_the_component_and_the_train_command_take_the_priority_class_and_the_grace():
    from elastic_step.cli import build_parser

    component = yaml.safe_load((ROOT / "components" / "train_elastic" / "component.yaml").read_text())
    inputs = component["root"]["inputDefinitions"]["parameters"]
    assert inputs["priority_class"]["defaultValue"] == ""
    args = build_parser().parse_args(["train", "--model-def", "m", "--data", "d", "--job-dir", "j"])
    assert args.termination_grace == defaults.TERMINATION_GRACE_S == 30  # Kubernetes' own default


def test_a_preempted_run_reads_preempted_in_get_and_the_gate_refuses_to_judge_it(tmp_path, monkeypatch):
    from elastic_step.operate.record import job_from_mlflow
    from elastic_step.release.gate import evaluate_candidate
    from elastic_step.tracking.run import RunOutcome, RunTracker, connect

    for name in ("KFP_RUN_ID", "ARGO_WORKFLOW_NAME"):
        monkeypatch.delenv(name, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = RunTracker(connect(uri, str(tmp_path)), "exp", "job", str(tmp_path / "artifacts"))
    tracker.start(resume=False)
    assert tracker.finish(outcome=RunOutcome.PREEMPTED, timeout_s=30)
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "KILLED" and run.data.tags["elastic_step.state"] == "preempted"  # not FAILED
    assert job_from_mlflow("job", uri)["status"]["state"] == "preempted"
    with pytest.raises(ConfigError, match=f"training run {tracker.run_id} is preempted, not succeeded"):
        evaluate_candidate(run_id=tracker.run_id, model_uri="", data=str(tmp_path / "unused"), registered_model="m",
                           mlflow_uri=uri, model_def="elastic_step.model_zoo.digits_torch")
    assert tracker.start(resume=False, previous=tracker.run_id) is True  # the retry in its folder reopens it
    assert tracker.client.get_run(tracker.run_id).data.tags["elastic_step.state"] == "running"
