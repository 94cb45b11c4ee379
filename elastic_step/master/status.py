"""What /status says: the job, its round, its progress and every worker, as one JSON object.
A function of the master's parts, called under its lock (so it reads one consistent moment),
checked against protocol.JobStatus: what the master says is what every reader accepts."""

from __future__ import annotations

from elastic_step.protocol import JobStatus


def job_status(master) -> dict:
    """`master`: the MasterState façade (its spec, membership, rounds, dispatcher, ledger,
    throughput, stop request and backend)."""
    done, total = master.dispatcher.epoch_progress()
    current = master.round
    membership = master.membership
    rows = master.ledger.worker_rows()  # voided steps, and steps a restore went back over, count no more
    return JobStatus.model_validate({
        "job": master.spec.job_name,
        "state": master.state,
        "started_at": master.started_at,
        "stopping": master.stop_request is not None and not master.over,
        "failure": master.failure,
        "round": current.id if current else 0,
        "round_ready": bool(current and current.ready),
        "world_size": len(current.members) if current and current.ready else 0,
        "target_workers": membership.target,
        "workers_range": [membership.min_workers, membership.max_workers],
        "epoch": min(master.dispatcher.current_epoch, master.dispatcher.epochs - 1),
        "epochs": master.dispatcher.epochs,
        "rows_done": done,
        "rows_total": total,
        "step": master.ledger.applied_step,
        "loss": master.throughput.loss,
        "samples_per_s": round(master.throughput.samples_per_second(), 1),
        "spares": membership.spares,
        "workers": [_worker(w, current, master.backend, membership.is_spare(w, current), rows.get(w.id, 0))
                    for w in membership.workers.values() if w.alive or w.exit_reason],
        "ps_shards": master.ps_shards.rows() if master.ps_shards is not None else [],
    }).model_dump(mode="json")


def _worker(w, current, backend, spare: bool, rows_applied: int) -> dict:
    described = backend.describe(w.id)
    return {
        "id": w.id,
        "slot": w.slot,
        "state": w.state,
        "rank": current.members.index(w.id) if current and w.id in current.members else None,
        "spare": spare,  # warmed up and waiting to take a member's place
        "step": w.step,
        "rows_applied": rows_applied,  # rows of the steps it took part in that the ledger holds
        "exit": w.exit_reason,
        "host": w.host,
        "launched_at": w.launched_at,
        "last_seen": w.last_seen or None,
        "exited_at": w.exited_at,
        "resources": w.resources.model_dump() if w.resources is not None else None,
        **described,
        **({"pid": w.pid} if w.pid and "pid" not in described else {}),
    }
