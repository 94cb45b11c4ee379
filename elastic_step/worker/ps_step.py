"""The parameter-server training mode: embedding tables on the shards, dense weights by allreduce.

Each minibatch pulls the rows of its distinct ids from the shards (the model's PsEmbedding
modules or layers, PyTorch's or Keras', do that in their forward pass), computes, and pushes the
gradient merged per id, then sums the dense gradients with the other ranks exactly as the
allreduce mode does (this class is that mode with a pull and a push around each minibatch's
gradients).

Why the dense part stays on the allreduce: it is small (DeepFM's MLP is ~0.1M values), and the
allreduce already gives it the step lineage, state sharing after a regroup, checkpoints and the
final model; on the shards it would need all of that again, and a push per step to every shard.

Exactly once. A push is keyed by the rows it trained on, not by who trained them: task =
(epoch << 32) | data shard, batch_seq = the minibatch's first row in that data shard divided by
--minibatch-size. The master cuts tasks at multiples of --minibatch-size and a worker trains a
task minibatch by minibatch from its first row, and a task handed back is re-issued from its
applied prefix, so a re-issued minibatch has the same key as the first try's, whichever worker
and task id it comes with. A shard applies a key once (ps/state.py), so the push of a worker
SIGKILLed after pushing, whose rows the master re-issues, is not applied twice.

The push is acknowledged (on the shards' ledgers, fsync'd) before this rank joins the step's
allreduce: once a step is applied and recorded, every rank's sparse update in it is durable.
It names its step, so every push of a step reaches the shards before any push of the next:
that is the cut a checkpoint of the step takes on every shard (ps/cuts.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from functools import partial

from elastic_step.errors import ConfigError
from elastic_step.protocol import RendezvousReply
from elastic_step.ps.api import PsError
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import embeddings
from elastic_step.ps.routing import RoutingTable
from elastic_step.worker.allreduce_step import AllreduceStep
from elastic_step.worker.client import worker_identity
from elastic_step.worker.rows import Piece
from elastic_step.worker.step_api import RoundOutcome, StepHost
from elastic_step.worker.step_buffer import StepBuffer

log = logging.getLogger("elastic_step.worker")

# How long a pull or push retries a shard that does not answer: longer than the master takes to
# relaunch one on a busy node (it loads its snapshot and replays its ledger first).
SHARD_DEADLINE_S = 180.0
REMEMBERED_TASKS = 16  # a rank trains one task and has the next fetched: a few is plenty


def push_key(epoch: int, shard: int, first_row: int, minibatch_size: int) -> tuple[int, int]:
    """(task, batch_seq) of the minibatch starting at `first_row` of data shard `shard`."""
    if first_row % minibatch_size:
        raise ValueError(f"a minibatch at row {first_row} of shard {shard} is not on the --minibatch-size grid")
    return (epoch << 32) | shard, first_row // minibatch_size


class _TaskNotingHost:
    """The worker, with the TaskInfo of every task it takes noted (a Piece has only its id)."""

    def __init__(self, host: StepHost, noted: OrderedDict):
        self._host, self._noted = host, noted

    def __getattr__(self, name):
        return getattr(self._host, name)

    def task_taker(self, round_id: int):
        take = self._host.task_taker(round_id)

        def noting():
            status, task, rows = take()
            if task is not None:
                self._noted[task.id] = task
                while len(self._noted) > REMEMBERED_TASKS:
                    self._noted.popitem(last=False)
            return status, task, rows

        return noting


class PsStep(AllreduceStep):
    def __init__(self, host: StepHost):
        self.tasks: OrderedDict = OrderedDict()
        super().__init__(_TaskNotingHost(host, self.tasks))
        spec = host.spec
        if spec.global_batch_size or not spec.ps_routing:
            raise ConfigError("mode ps needs the shards' routing and no --global-batch-size")
        model = getattr(host.trainer, "net", None)  # PyTorch's
        model = getattr(host.trainer, "model", None) if model is None else model  # Keras'
        self.tables = [embedding.ps_table for embedding in embeddings(model)] if model is not None else []
        if not self.tables:
            raise ConfigError("mode ps: the model has no PsEmbedding (elastic_step.ps.torch_embedding's or "
                              "keras_embedding's declares a table)")
        routing = RoutingTable.from_json(spec.ps_routing)
        self.client = PsClient(worker_identity()[1], lambda: routing, deadline_s=SHARD_DEADLINE_S)
        for table in self.tables:
            table.source = partial(self.client.pull, table.spec.name)
        self.round_id = 0
        self.duplicates = 0  # pushes the shards had applied already (re-issued rows)

    def buffer_device(self):
        """Host memory: the sparse tables' gradients are pushed from the host beside the dense ones."""
        return None

    def train_round(self, rv: RendezvousReply) -> RoundOutcome:
        self.round_id = rv.round_id
        try:
            return super().train_round(rv)
        except PsError as exc:  # not a peer's death (a RuntimeError the worker regroups after): the shards are gone
            log.error("round %d: parameter servers: %s", rv.round_id, exc)
            self.host.fail_job(f"the parameter-server shards did not answer worker {rv.rank}'s requests: {exc}")
            return RoundOutcome.FAILED

    def _gradients(self, pieces: list[Piece], buffer: StepBuffer) -> None:
        """The dense gradients into the buffer (the allreduce mode's), and the sparse ones pushed."""
        for table in self.tables:
            table.forget()
        size = self.host.spec.minibatch_size
        if len(pieces) != 1 or pieces[0].count > size:
            raise ValueError(f"mode ps trains one piece of at most {size} rows per step, got {[p.count for p in pieces]}")
        super()._gradients(pieces, buffer)
        piece = pieces[0]
        task = self.tasks[piece.task_id]
        key = push_key(task.epoch, task.shard, task.start + piece.offset, size)
        for table in self.tables:
            merged = table.take_gradients()
            if merged is None:
                continue
            ids, grads = merged
            reply = self.client.push(table.spec.name, *key, self.round_id, ids, grads / piece.count,
                                     step=self.host.progress.step + 1)  # the step this rank is training
            if reply.duplicate:
                self.duplicates += 1
                log.info("rows %d-%d of shard %d (epoch %d) were pushed before (re-issued rows): the shards kept the "
                         "first update (%d duplicate pushes so far)", task.start + piece.offset,
                         task.start + piece.offset + piece.count - 1, task.shard, task.epoch, self.duplicates)
