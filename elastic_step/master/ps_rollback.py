"""A `--mode ps` job that goes back to its newest checkpoint while it runs, when a shard has lost
its rows (its pod deleted: node drain, `kubectl delete pod`, its emptyDir gone with it).

Recovering only that shard from its last cut would lose the pushes it acknowledged after the
cut, which the workers do not send again. So the whole job goes back to the checkpoint, in
process, and no worker restarts:

1. The master marks a rollback pending (Rounds.begin_rollback): no round settles until step 3,
   and the newest round's id is the fence. Then every queued write runs (`flush`), so a
   checkpoint handed over before is recorded (or not) by then; the restore point is read after.
2. Under the monitor's `scaling` lock (no checkpoint's cut or scale --ps meanwhile) the shards'
   launcher puts every shard back to its cut of the point's step behind the fence: each refuses
   from then on every push of a round up to the fence (its round trained on what goes back; the
   worker takes the refusal as the end of its round and rendezvouses again), and the lost shard
   is made anew from its cut (backends/kubernetes/ps_pod_watch.py, PodSupervisor.roll_back).
3. Rounds.rollback_ready: the next round to settle goes on from the point as a restore does
   (restore.py): the rows applied after it return to the queue, rank 0 loads its dense state,
   and a RESTORED event names the checkpoint and the steps lost. Its round id is above the
   fence, so its pushes are taken.

With no checkpoint yet (nothing to go back to) the shard is DOWN and the job fails, as before;
a rollback that cannot be done fails the job in one line."""

from __future__ import annotations

import logging

from elastic_step.master.ps_checkpoints import PS_CUT

log = logging.getLogger("elastic_step.master")


class PsRollback:
    """The shards' supervisor's `lost(shard)`: the job back to its newest checkpoint (see above)."""

    def __init__(self, state, monitor):
        self.state, self.monitor = state, monitor  # MasterState, ps_monitor.ShardMonitor

    def __call__(self, lost: int) -> bool:
        """Shard `lost` lost its rows: True once the job goes back to its newest checkpoint; False
        when it has none to go back to, or could not go back (the job failed, saying why)."""
        state, monitor = self.state, self.monitor
        cause = f"parameter-server shard {lost}'s pod was deleted, its rows with it"
        with state.lock:
            point = state.rounds.restore_point
            if state.over or not _cut_of(point):
                return False
        monitor.rolling_back.set()  # a checkpoint handed over from now on is not taken (its cut would be of either side)
        try:
            with state.lock:
                fence = state.rounds.begin_rollback(cause)
            state.lock.writes.flush()  # a checkpoint handed over before is recorded (or not); no newer one comes
            with state.lock:
                point = state.rounds.restore_point
            log.warning("%s: every shard goes back to the checkpoint of step %d, then the workers (rounds up to %d fenced)",
                        cause, point.step, fence)
            with monitor.scaling:  # after a cut or scale --ps under way
                monitor.supervisor.roll_back(lost, point.ledger[PS_CUT], fence)
                monitor.follow()
        except Exception as exc:  # PsError, ConfigError, the API server's: never a rollback left pending, holding every round
            with state.lock:
                state.fail(f"{cause}, and the shards could not go back to the checkpoint of step {point.step}: {_one_line(exc)}; "
                           "rerun the job with --resume to continue from its newest checkpoint")
            return False
        finally:
            monitor.rolling_back.clear()
        with state.lock:
            state.rounds.rollback_ready(point)
        return True


def _one_line(exc: Exception) -> str:
    """An error's first line (an API server's carries its headers and body on the next ones)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


def _cut_of(point) -> dict | None:
    return (point.ledger or {}).get(PS_CUT) if point is not None and point.step > 0 else None


def roll_back_on_loss(monitor, state) -> None:
    """A mode ps job's shards go back with the group only through a rollback; one is started
    when a shard's watcher reports a shard that lost its rows (a launcher whose shards can: pods)."""
    state.rounds.restores_on_loss = False
    if monitor is not None and hasattr(monitor.supervisor, "lost"):
        monitor.supervisor.lost = PsRollback(state, monitor)
