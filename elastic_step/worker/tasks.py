"""Where a worker's rows come from: the master's next task, read and fed, one task ahead.

The next task is asked for and read on a thread while the current one trains, so the HTTP round
trip and the Parquet read never stall the step (and so every other rank). Any training mode
takes its rows this way: the task is the unit of the ledger whatever a step does with its rows.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from elastic_step.frameworks.model_def import batch_arrays
from elastic_step.protocol import JobSpec, Route, TaskFailedRequest, TaskInfo, TaskReply, TaskRequest, TaskStatus
from elastic_step.worker.client import MasterClient

log = logging.getLogger("elastic_step.worker")

Fetched = tuple[TaskStatus, TaskInfo | None, tuple | None]  # the master's answer, the task, its (features, labels)


class TaskFeed:
    def __init__(self, client: MasterClient, worker_id: str, reader, model_def, spec: JobSpec):
        self.client = client
        self.worker_id = worker_id
        self.reader = reader
        self.model_def = model_def
        self.spec = spec
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")

    def fetch(self, round_id: int) -> Fetched:
        """The next task and its rows. A task that cannot be read is handed back and the next one
        asked for at once, so WAIT always means the master has nothing to give now (it fails the
        job once a task has failed too often)."""
        while True:
            reply = TaskReply(**self.client.call("POST", Route.TASK, TaskRequest(worker_id=self.worker_id, round_id=round_id)))
            if reply.status != TaskStatus.TASK or reply.task is None:
                return reply.status, None, None
            task = reply.task
            try:
                rows = self.reader.read("train", task.shard, task.start, task.count)
                # feed() is row-wise: apply it to the whole task here, off the training thread,
                # and let each step take a slice.
                rows = batch_arrays(self.model_def, rows, self.spec.features, self.spec.label)
            except Exception as exc:
                log.error("task %d: %s", task.id, exc)
                self.client.call("POST", Route.TASK_FAILED, TaskFailedRequest(
                    worker_id=self.worker_id, task_id=task.id, error=f"{type(exc).__name__}: {exc}"))
                continue
            return TaskStatus.TASK, task, rows

    def taker(self, round_id: int) -> Callable[[], Fetched]:
        """For one round: a function that returns the next task (blocking until the master
        answers) and has the one after it fetched in the background."""
        pending: Future | None = None

        def take_task() -> Fetched:
            nonlocal pending
            future = pending or self._prefetch.submit(self.fetch, round_id)
            pending = None
            result = future.result()
            if result[0] == TaskStatus.TASK:
                pending = self._prefetch.submit(self.fetch, round_id)
            return result

        return take_task
