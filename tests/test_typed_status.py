"""A job's status and events are protocol models, checked where they are read.

The master's /status is a protocol.JobStatus (its workers WorkerStatus, its events EventRecord),
so every reader, `get` on a job folder or on a published ConfigMap, accepts exactly what a master
writes and refuses in one line, naming where it read it, a status of another shape, rather than
failing later inside a table. The event kinds people are shown come from one place
(protocol.SHOWN_EVENTS), which `get -e`, the KFP report and the live page all take."""

from __future__ import annotations

import json
import re
import time

import pytest

from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.operate.folder import job_view
from elastic_step.operate.statusmap import kubernetes_view
from elastic_step.operate.documents import UnreadableStatus
from elastic_step.protocol import SHOWN_EVENTS, EventKind, JobStatus

from kube_fake import FakeCoreV1Api
from test_kubernetes_backend import unit_backend
from test_master_state import join_all, make_state


def test_the_masters_status_is_a_job_status_with_its_workers_typed():
    state, _ = make_state()
    join_all(state)
    status = state.status()
    typed = JobStatus.model_validate(status)
    assert typed.state == "running" and typed.round_ready and typed.world_size == 3
    assert [w.state for w in typed.workers] == ["live"] * 3 and all(w.host == "h" for w in typed.workers)
    assert json.loads(json.dumps(status)) == status  # plain JSON: what status.json and the ConfigMap hold


def test_a_published_status_of_another_shape_is_refused_in_one_line_naming_its_configmap(tmp_path):
    api = FakeCoreV1Api(str(tmp_path / "cluster"))
    try:
        pod = api.add_master_pod("train-step-1", "es:1")
        backend = unit_backend(tmp_path, api, PodSettings(namespace="ml", image="es:1"),
                               master=MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml"))
        info = {"job": "unit", "backend": "kubernetes"}
        backend.publish({"info": info, "status": {"job": "unit", "state": "running", "epoch": "three", "workers": []}})
        with pytest.raises(UnreadableStatus) as refused:
            kubernetes_view("unit", "ml", api=api)
        message = str(refused.value)
        assert f"ConfigMap ml/{backend.names.status_map}" in message and "epoch" in message and "\n" not in message
        # An event of a kind this release does not know (a newer master's) is left out, the rest shown.
        events = [{"time": 1.0, "event": "died", "worker": "w0.1", "reason": "killed"},
                  {"time": 2.0, "event": "worker_teleported", "worker": "w0.1"}]
        backend.publish({"info": info, "status": {"job": "unit", "state": "running", "workers": []}, "events": events})
        view = kubernetes_view("unit", "ml", with_events=True, api=api)
        assert [e["event"] for e in view["events"]] == ["died"]
        backend.shutdown(grace_s=0)
    finally:
        api.close()


def test_a_final_status_of_another_shape_in_a_job_folder_is_refused_naming_the_file(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "master.json").write_text(json.dumps({"job": "job", "backend": "local"}))
    (job / "status.json").write_text(json.dumps({"job": "job", "state": "exploded", "workers": []}))
    with pytest.raises(UnreadableStatus, match=f"{job / 'status.json'} holds no job status.*state"):
        job_view(str(job))


def test_the_kinds_people_are_shown_come_from_one_place(tmp_path):
    from elastic_step.master.ui_page import PAGE
    from elastic_step.tracking.report_html import render_report

    job = tmp_path / "job"
    job.mkdir()
    now = time.time()
    events = [{"time": now, "event": kind, "worker": "w0.1", "step": 1, "round": 1, "seconds": 0.5, "world_size": 1, "workers": 1}
              for kind in EventKind]
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (job / "status.json").write_text(json.dumps({"job": "job", "state": "succeeded", "started_at": now, "workers": []}))
    (job / "master.json").write_text(json.dumps({"job": "job", "backend": "local"}))

    shown = [str(kind) for kind in SHOWN_EVENTS]
    got = [e["event"] for e in job_view(str(job), with_events=True)["events"]]
    assert got == [str(k) for k in EventKind if k in SHOWN_EVENTS or k == EventKind.LAUNCHED]  # and relaunched attempts
    report = render_report(str(job))
    listed = re.findall(r"<td>\d\d:\d\d:\d\d</td><td>([a-z_]+)</td>", report)
    assert set(listed) == set(shown), set(listed) ^ set(shown)
    assert json.loads(re.search(r"const SHOWN = (\[.*?\]);", PAGE).group(1)) == shown
