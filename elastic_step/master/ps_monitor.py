"""A `--mode ps` job's shards as the job sees them while it trains (ShardMonitor): each shard's
numbers for `get`, `top`, /status and the MLflow run (ps.shardI.*), and `scale --ps N`, which
adds or removes shards while the job trains, moving only the virtual shards that change owner
(ps/moves.py); the workers learn the new routing from the shards' refusals of the old epoch and
no worker restarts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elastic_step.errors import ConfigError
from elastic_step.master.events import EventLog
from elastic_step.master.ps_supervisor import ShardSupervisor
from elastic_step.protocol import EventKind, PsShardState
from elastic_step.ps.api import PsError, ShardsNotStarted, Status
from elastic_step.ps.client import PsClient

log = logging.getLogger("elastic_step.master")

Metric = Callable[[str, float, int, float], None]  # (key, value, step, time): the run's log_metric


class ShardMonitor:
    """Each shard's numbers for /status and the MLflow run: its `stats` asked every STATS_S on
    this thread (never under the master's lock; a shard that does not answer keeps its last
    numbers), its state and relaunches from the supervisor. Logged as ps.shardI.rows, .bytes
    and .pushes (their sums over the shard's tables), and .updates_per_s (the pushes it applied
    since its previous answered poll over the seconds between them), the poll's count as the
    metric's step."""

    STATS_S = 2.0
    CUT_WAIT_S = 120.0  # a scale --ps waits this long for a checkpoint's cut or a rollback to let go of the shards
    SCALE_WAIT_AT_STOP_S = 300.0  # the job's end waits this long for a scale --ps under way (each request of a move: 120 s at most)

    def __init__(self, supervisor: ShardSupervisor, token: str, metric: Metric | None = None, events: EventLog | None = None,
                 clock: Callable[[], float] = time.monotonic, fits: Callable[[int], None] | None = None):
        self.supervisor = supervisor
        self.fits = fits  # raises ConfigError when the declared tables would not fit that many shards
        self.metric = metric
        self.events = events  # the job's: each scale --ps is recorded there (get -e)
        self.addresses = [f"{shard.host}:{port}" for shard, port in zip(supervisor.shards.shards, supervisor.ports)]
        self.client = PsClient(token, lambda: None, timeout_s=5.0)  # call() only: no routing needed
        self.numbers = [{"rows": 0, "bytes": 0, "pushes": 0} for _ in self.addresses]
        self.clock = clock  # monotonic: a rate must not jump with the wall clock
        self.answered: list[tuple[int, float] | None] = [None for _ in self.addresses]  # (pushes, clock) at its last answer
        self.rates: list[float | None] = [None for _ in self.addresses]  # updates/s between its last two answers
        self.polls = 0
        self.stopping = threading.Event()
        self.polling = threading.Lock()
        self.scaling = threading.Lock()  # the shards' rows are being moved or cut: one at a time
        self.scale_asked = threading.Lock()  # a scale --ps is asked for: a second one is refused
        self.unfinished: str | None = None  # why the last scale --ps did not finish: none more until a resume
        self.rolling_back = threading.Event()  # the shards go back to a checkpoint (ps_rollback.py): no checkpoint meanwhile
        self.thread = threading.Thread(target=self._watch, name="ps-monitor", daemon=True)

    def start(self) -> ShardMonitor:
        self.poll()  # the first rows before /status is first asked
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        # A scale --ps under way is let finish (a new one is refused from now on): the job's end
        # then stops the shards, or finishes a move that failed, with no move beside it.
        if self.scale_asked.acquire(timeout=self.SCALE_WAIT_AT_STOP_S):
            self.scale_asked.release()
        else:
            log.error("parameter servers: a scale --ps still runs after %.0f s; the shards are stopped under it",
                      self.SCALE_WAIT_AT_STOP_S)
        self.thread.join()
        self.poll()  # the shards' last numbers, before they are stopped
        self.client.close()

    def scale(self, shards: int) -> dict:
        """`scale --ps`: run `shards` shard processes from now on; what moved (moves.MoveReport).
        ValueError (the API's 409) when there is nothing to do or it cannot be done now. Its
        start and finish are events of the job (get -e), the finish with the rows moved and pauses."""
        if not self.scale_asked.acquire(blocking=False):
            raise ValueError("another scale --ps of this job is under way; try again when it is done")
        try:
            # A checkpoint's cut holds the shards for a moment: the operator's scale waits for it
            # rather than failing on a timing it cannot see.
            if not self.scaling.acquire(timeout=self.CUT_WAIT_S):
                raise ValueError(f"a checkpoint's cut or a rollback has held the shards for {self.CUT_WAIT_S:.0f} s; "
                                 "try again when it is done (get -e shows it)")
            try:
                return self._scale(shards)
            finally:
                self.scaling.release()
        finally:
            self.scale_asked.release()

    def _scale(self, shards: int) -> dict:
        supervisor = self.supervisor
        before = len(supervisor.shards.shards)
        self._check_scale(before, shards)
        sizes = {"shards_from": before, "shards_to": shards}
        self._event(EventKind.PS_SCALE_STARTED, **sizes)
        client = PsClient(self.client.token, lambda: None, timeout_s=120.0)
        try:
            report = supervisor.shards.resize(shards, client.call)
        except ShardsNotStarted as exc:
            self._event(EventKind.PS_SCALE_FINISHED, f"did not start: {exc}", ok=False, **sizes)
            raise ValueError(f"the move to {shards} shards did not start ({exc}); nothing moved: the job goes on with "
                             f"{before} shard(s)") from exc
        except PsError as exc:
            self.unfinished = f"the move to {shards} shards did not finish ({exc})"  # first: no later scale starts from it
            log.error("parameter servers: the move to %d shards did not finish: %s", shards, exc)
            # A growth cut short keeps its added shards (ps/local.py): watched, relaunched and shown like the others.
            supervisor.resized()
            self._restart_numbers(len(supervisor.shards.shards))
            self._event(EventKind.PS_SCALE_FINISHED, f"did not finish: {exc}", ok=False, **sizes)
            raise ValueError(f"the move to {shards} shards did not finish ({exc}); the shards are left mid-move: stop "
                             "the job and resume it (train --resume), which finishes the move") from exc
        finally:
            client.close()
        supervisor.resized()
        self._restart_numbers(shards)
        moved = report.to_json()
        # what get -e shows (one line): the rows moved and the longest a moved virtual shard was refused
        self._event(EventKind.PS_SCALE_FINISHED, ok=True, **sizes, rows_moved=report.rows_moved, rows_total=report.rows_total,
                    pause_max_s=moved["pause_max_s"], seconds=moved["seconds"], routing_epoch=report.epoch)
        return moved

    def _restart_numbers(self, shards: int) -> None:
        """After a scale: the new shards' addresses, and every shard's count taken now, so that the
        next poll has its rate (a job may end soon after a scale). The moved rows took their
        applied pushes with them, so no count from before the move is a base for a rate. Under
        the polling lock: a poll under way would otherwise set a base from before the move."""
        with self.polling:
            self.follow()
            self.numbers = (self.numbers + [{"rows": 0, "bytes": 0, "pushes": 0} for _ in range(shards)])[:shards]
            self.answered = [None] * shards
            self.rates = [None] * shards
            try:
                self._poll()
            except Exception as exc:  # the move is done: numbers are not worth failing it for
                log.warning("parameter servers: the shards' numbers after the scale were not read: %s", exc)

    def follow(self) -> None:
        """The shards' addresses as they are now (after a scale --ps, or a shard made anew by a rollback)."""
        supervisor = self.supervisor
        self.addresses = [f"{shard.host}:{port}" for shard, port in zip(supervisor.shards.shards, supervisor.ports)]

    def _check_scale(self, before: int, shards: int) -> None:
        supervisor = self.supervisor
        if self.stopping.is_set() or supervisor.stopping.is_set():
            raise ValueError("the job is ending; there is nothing to scale")
        if self.unfinished is not None:  # a second move would start from a routing the shards have left
            raise ValueError(f"{self.unfinished}: stop the job and resume it (train --resume), which finishes that move, "
                             "then scale")
        if shards == before:
            raise ValueError(f"the job already runs {shards} parameter-server shards")
        if not 1 <= shards <= len(supervisor.shards.routing.owners):
            raise ValueError(f"{shards} shards: use between 1 and {len(supervisor.shards.routing.owners)} (the virtual shards)")
        down = [i for i, state in enumerate(supervisor.states) if state is not PsShardState.SERVING]
        if down:
            raise ValueError(f"shard {down[0]} is {supervisor.states[down[0]]}; scale once every shard serves")
        if self.fits is not None:
            try:  # fewer shards hold more each: a declared table may no longer fit their memory
                self.fits(shards)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None

    def _event(self, kind: EventKind, message: str = "", **fields) -> None:
        """Recorded and written at once (events.jsonl, the log, the run): this thread holds no
        master lock."""
        if self.events is not None:
            self.events.add(kind, message, **fields)
        else:
            log.info("%s %s %s", kind.value, message, fields)

    def rows(self) -> list[dict]:
        """One PsShardStatus each, as of the last poll."""
        rows = zip(self.addresses, self.supervisor.states, self.numbers, self.rates, self.supervisor.relaunches)  # zip: a scale may be resizing them
        return [{"shard": i, "address": address, "state": state, **numbers, "updates_per_s": rate, "relaunches": relaunches}
                for i, (address, state, numbers, rate, relaunches) in enumerate(rows)]

    def poll(self) -> None:
        with self.polling:  # this thread's and a scale --ps's (one client, one count of polls)
            self._poll()

    def _poll(self) -> None:
        self.polls += 1
        now = time.time()
        for i, address in enumerate(self.addresses):
            try:
                reply = self._stats(address)
            except (OSError, ValueError) as exc:  # down or relaunching: its last numbers stand, but not its rate
                log.debug("parameter-server shard %d did not answer its stats: %s", i, exc)
                self._unanswered(i)
                continue
            if reply.get("status") != Status.OK:
                log.debug("parameter-server shard %d refused its stats: %s", i, reply.get("detail"))
                self._unanswered(i)
                continue
            tables = reply.get("tables", {}).values()
            if i >= len(self.numbers):  # removed by a scale --ps meanwhile
                break
            self.numbers[i] = {key: sum(int(t[key]) for t in tables) for key in ("rows", "bytes", "pushes")}
            self._rate(i, self.numbers[i]["pushes"])
            if self.metric is not None:
                logged = {**self.numbers[i], "updates_per_s": self.rates[i]}
                for key, value in logged.items():
                    if value is not None:
                        self.metric(f"ps.shard{i}.{key}", value, self.polls, now)

    def _unanswered(self, i: int) -> None:
        """A shard that does not answer applies nothing we can see; its next answer's rate spans the gap."""
        if i < len(self.rates):
            self.rates[i] = None

    def _rate(self, i: int, pushes: int) -> None:
        """Shard i's updates per second since its previous answer. None after its first answer,
        and when its count went down (a shard relaunched without its rows, or put back to a
        checkpoint's cut by a rollback): no negative rate."""
        now = self.clock()
        before = self.answered[i] if i < len(self.answered) else None
        rate = None
        if before is not None and pushes >= before[0] and now > before[1]:
            rate = (pushes - before[0]) / (now - before[1])
        if i < len(self.answered):  # a scale --ps may have cut the lists meanwhile
            self.answered[i] = (pushes, now)
            self.rates[i] = rate

    def _stats(self, address: str) -> dict:
        """A shard's stats, asked again once on a new connection when the kept one fails: a shard
        relaunched since the last poll closed it (the last poll before the shards stop would
        otherwise keep the numbers it had before it died)."""
        try:
            return self.client.call(address, {"op": "stats"})[0]
        except OSError:
            return self.client.call(address, {"op": "stats"})[0]  # call() dropped the broken connection

    def _watch(self) -> None:
        while not self.stopping.wait(self.STATS_S):
            self.poll()
