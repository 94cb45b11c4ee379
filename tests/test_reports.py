"""TensorBoard scalar event files and the HTML training report: what they hold, read back the way
their readers read them."""

from __future__ import annotations

import glob
import json
import os
import struct

from elastic_step.tracking.report_html import render_report, write_report
from elastic_step.tracking.tensorboard import TensorBoardLog


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TFRecord event files under `folder` (the framing TensorBoard reads),
    each record's two checksums checked as TensorBoard's reader checks them (tensorboardX's
    reference CRC): a record that fails them is where TensorBoard stops reading the file."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset + 12 <= len(data):
            header, (length_crc,) = data[offset:offset + 8], struct.unpack("<I", data[offset + 8:offset + 12])
            (length,) = struct.unpack("<Q", header)
            body = data[offset + 12:offset + 12 + length]
            (body_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
            assert (length_crc, body_crc) == (masked_crc32c(header), masked_crc32c(body)), f"{path}: bad record at {offset}"
            event = Event.FromString(body)
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_scalars_are_written_and_read_back(tmp_path):
    tb = TensorBoardLog(str(tmp_path))
    for step in range(1, 6):
        tb.scalar("train/loss", 1.0 / step, step, 1000.0 + step)
    tb.scalar("membership/recovery_s", 0.25, 2)
    tb.scalar("train/samples_per_s", None, 1)  # the first step has no rate: nothing written
    tb.close()
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    assert abs(scalars["train/loss"][-1][1] - 0.2) < 1e-6
    assert scalars["membership/recovery_s"] == [(2, 0.25)]
    assert "train/samples_per_s" not in scalars


def make_job(job_dir) -> None:
    os.makedirs(job_dir, exist_ok=True)
    steps = [{"step": i, "time": 100.0 + i, "samples": 32, "loss": 2.0 / i, "samples_per_s": 30.0 + i,
              "world_size": 3 if i < 5 else 2, "round": 1 if i < 5 else 2} for i in range(1, 11)]
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    events = [
        {"time": 99.0, "event": "launched", "worker": "w0.1", "slot": 0, "attempt": 1},
        {"time": 99.0, "event": "launched", "worker": "w1.1", "slot": 1, "attempt": 1},
        {"time": 99.0, "event": "launched", "worker": "w2.1", "slot": 2, "attempt": 1},
        {"time": 100.0, "event": "regrouped", "round": 1, "world_size": 3, "members": ["w0.1", "w1.1", "w2.1"], "start_step": 0},
        {"time": 104.5, "event": "died", "worker": "w1.1", "reason": "killed by SIGKILL <9>", "returncode": -9},
        {"time": 104.5, "event": "relaunched", "worker": "w1.1", "slot": 1},
        {"time": 104.5, "event": "launched", "worker": "w1.2", "slot": 1, "attempt": 2},
        {"time": 104.6, "event": "regrouped", "round": 2, "world_size": 2, "members": ["w0.1", "w2.1"], "start_step": 4},
        {"time": 105.0, "event": "recovered", "round": 2, "seconds": 0.5, "cause": "w1.1 killed by SIGKILL"},
        {"time": 108.0, "event": "checkpoint", "step": 8, "epoch": 1},
        {"time": 110.5, "event": "job_succeeded", "worker": "w0.1", "step": 10},
    ]
    (job_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn\n')
    (job_dir / "result.json").write_text(json.dumps({"test_metrics": {"accuracy": 0.9, "rows": 10}, "rows_audited": 320, "steps": 10}))


def test_the_report_has_the_plots_the_attempts_and_the_recoveries(tmp_path):
    job = tmp_path / "job"
    make_job(job)
    page = render_report(str(job))
    assert page.startswith("<!doctype html>") and "<h1>job: succeeded</h1>" in page
    assert page.count('<path class="series"') == 3  # loss, samples/s, world size
    assert 'aria-label="world size"' in page and "relaunches</td><td>1</td>" in page
    assert 'data-worker="w1.1"' in page and "killed by SIGKILL &lt;9&gt;" in page  # escaped, never markup
    assert 'data-worker="w1.2"' in page and "<td>2</td><td>0.50</td>" in page
    assert "test accuracy</td><td>0.9000" in page and "rows audited</td><td>320" in page
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org", "")
    path = write_report(str(job))
    assert path == str(job / "plots" / "report.html") and open(path).read() == page


def test_a_job_that_never_stepped_still_gets_a_report(tmp_path):
    page = render_report(str(tmp_path))
    assert "no steps" in page and "none: no worker was lost" in page
