"""State sharing at the start of a round: every member is made identical to the state source (the
member with the highest applied step). Members that applied exactly the source's steps already
are (the step made them so): only a joiner, or a rank behind or on another line of steps, is sent
the state, so a regroup after a death costs no transfer however large the model."""

from __future__ import annotations

import logging
import time

from elastic_step.protocol import RendezvousReply, Route
from elastic_step.worker.client import MasterClient
from elastic_step.worker.collective import Collective
from elastic_step.worker.step_api import Progress, initial_lineage

log = logging.getLogger("elastic_step.worker")


def share_state(rv: RendezvousReply, progress: Progress, collective: Collective, trainer, client: MasterClient) -> None:
    """Make this member identical to the round's state source; `progress.lineage` becomes the
    source's. The source of a first round loads the master's initial state first."""
    started = time.perf_counter()
    step, lineage = progress.step, progress.lineage
    if rv.rank == rv.source_rank and rv.initial_state:  # nobody holds state yet: a checkpoint or a warm start
        _load_initial_state(rv.initial_state, trainer, client)
        step, lineage = rv.start_step, initial_lineage(rv.initial_state, rv.start_step)
    identities = collective.gather_identities(step, lineage)
    source_step, source_lineage = identities[rv.source_rank]
    behind = [r for r, (s, line) in enumerate(identities)
              if r != rv.source_rank and not (s >= 0 and s == source_step and line == source_lineage)]
    size = _send_state(rv, behind, collective, trainer)
    progress.lineage = source_lineage
    log.info("round %d: state of rank %d sent to ranks %s (%d bytes) in %.3f s",
             rv.round_id, rv.source_rank, behind or "none (every member holds it)", size, time.perf_counter() - started)


def _send_state(rv: RendezvousReply, behind: list[int], collective: Collective, trainer) -> int:
    """The source's state to the ranks `behind`: one broadcast when that is everyone else,
    else point to point. Returns the state's size in bytes (0: nothing was sent)."""
    source = rv.rank == rv.source_rank
    if behind and len(behind) == rv.world_size - 1:
        data = collective.broadcast_bytes(trainer.state_bytes() if source else None, rv.source_rank)
        if not source:
            trainer.load_state_bytes(data)
    elif behind and source:
        data = trainer.state_bytes()
        collective.send_bytes(data, behind)
    elif rv.rank in behind:
        data = collective.recv_bytes(rv.source_rank)
        trainer.load_state_bytes(data)
    else:
        return 0
    return len(data)


def _load_initial_state(kind: str, trainer, client: MasterClient) -> None:
    """The first round's state source loads the master's checkpoint (resume) or model (warm start)."""
    data = client.call_bytes("GET", Route.INITIAL_STATE)
    if kind == "checkpoint":
        trainer.load_state_bytes(data)
    else:
        trainer.load_model_bytes(data)
