"""The master's API fuzzed from its own OpenAPI document (schemathesis): with the job's token,
against a live job whose workers are real processes, no request gets a 5xx, an undeclared status
code or a reply its schema does not allow, no schema-violating request is accepted, and the job
still completes with an exact audit. Without the token, every request gets 401 and nothing
changes."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from elastic_step.audit import audit_report
from elastic_step.master.api import create_app

from conftest import SLOW_MODEL
from test_master_hardening import AUTH, TOKEN, Job

pytestmark = pytest.mark.e2e

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, positive_data_acceptance]
EXAMPLES = 20  # per operation and mode: the whole fuzz stays well under two minutes
EPOCHS = 6


def fuzz(schema, headers: dict | None, checks: list, examples: int = EXAMPLES, **call) -> int:
    """Run every operation of `schema` with generated requests; returns how many were sent."""
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        has_input = operation.body or operation.query
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):

            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal sent
                response = case.call(headers=headers, **call)
                sent += 1
                case.validate_response(response, checks=checks)

            run()
    return sent


def test_fuzzing_a_live_job_with_its_token_breaks_nothing_and_the_audit_stays_exact(digits, start_job):
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", str(EPOCHS), "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2",
                    # the workers are paused while the master is fuzzed: that is no hang
                    "--heartbeat-timeout", "600", "--rendezvous-timeout", "600")
    status = job.wait_for(lambda s: s["world_size"] == 3 and s["rows_done"] > 0, timeout=300)
    # The workers pause mid-epoch (SIGSTOP) at once, so however fast this machine trains, the
    # fuzz meets a job with a ready round, tasks in flight and steps not yet final, and the job
    # cannot end first.
    workers = [w["pid"] for w in status["workers"] if w["state"] == "live"]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        with open(os.path.join(job.job_dir, "master.json")) as f:
            url = json.load(f)["url"]
        with open(os.path.join(job.job_dir, "token")) as f:
            headers = {"Authorization": f"Bearer {f.read().strip()}"}
        # the data plane too: every port the master listens on (API, store) is on the API's host
        host = url.split("//")[1].rsplit(":", 1)[0]
        listening = [c.laddr for c in psutil.Process(job.proc.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 2 and all(addr.ip == host for addr in listening), listening
        # /stop is left out: it does what it says (the job stops after a checkpoint, so the job
        # could not finish); test_watch_e2e stops a live job, and the unauthenticated fuzz covers it.
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers).exclude(path="/v1/stop")
        paused = job.status()
        assert paused["state"] == "running" and paused["rows_done"] < paused["rows_total"], paused
        started = time.monotonic()
        sent = fuzz(schema, headers, CHECKS, timeout=10)
        assert time.monotonic() - started < 120
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert sent > 100
    status = job.status()
    assert status is not None and status["state"] == "running", status
    assert job.finish(timeout=600) == 0, job.output()
    report = audit_report(job.audit, digits, epochs=EPOCHS)
    assert report["exact"], report
    assert not [e for e in job.events() if e["event"] in ("job_failed", "died", "dropped")]


def test_fuzzing_without_the_token_gets_401_everywhere_and_changes_nothing():
    job = Job()
    before = job.state.status()
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(job.state, TOKEN), headers=AUTH)

    def refused(ctx, response, case):
        assert response.status_code == 401, (case.operation.label, response.status_code)

    # No headers of ours: the document declares the bearer scheme, so schemathesis sends no
    # Authorization header or made-up ones (never the job's token).
    sent = fuzz(schema, None, [refused], examples=10)
    assert sent > 50
    assert job.state.status() == before
