"""Checkpoint cuts on a shard (ps/cuts.py), in process: a checkpoint of step S gets, from every
shard, the tables holding exactly the pushes of steps <= S, whether the shard cut itself at the
first push after S (a multiple of --checkpoint-steps) or cuts it from its snapshot and ledger
when asked; a relaunched shard still has its cut; a shard that cannot cut S refuses in one line;
a folder restored from a cut holds that cut's tables and keys, and nothing newer or older, and
only once the shard a killed master left there is gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from elastic_step.master.ps_checkpoints import restore_cut
from elastic_step.ps import cuts
from elastic_step.ps.api import TableSpec
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import READY_FILE
from elastic_step.ps.state import LEDGER_FILE, ROUTING_FILE, SNAPSHOT_FILE, ShardState

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

SPEC = TableSpec("emb", 2, optimizer="adagrad", lr=0.5)
IDS = np.array([1, 5, 9], np.int64)


def shard(directory, every: int = 2) -> ShardState:
    held = ShardState(str(directory), [SPEC], 0, RoutingTable.initial(1), snapshot_every=10_000, checkpoint_every=every)
    directory.mkdir(parents=True, exist_ok=True)
    held.recover()
    return held


def push(held: ShardState, step: int, seq: int | None = None) -> bool:
    """One minibatch's push, keyed by its step unless `seq` says otherwise (a re-issued minibatch)."""
    return held.push(LedgerRecord("emb", 1, step if seq is None else seq, 0, IDS, np.full((3, 2), 0.1 * step, np.float32)), step=step)


def failing_after_the_first_copy(monkeypatch, error: BaseException) -> None:
    """cuts.restore's second copy (the cut's ledger, after its snapshot) raises `error`: a crash
    (SystemExit) or a disk that refuses it (OSError)."""
    copies, real_copy = [], cuts._copy_durably

    def copy(source, target):
        if copies:
            raise error
        copies.append(target)
        real_copy(source, target)

    monkeypatch.setattr(cuts, "_copy_durably", copy)


@pytest.fixture(name="shard")
def closed_shard(closing):
    """The tests' `shard` (the helper above, which other modules import): each state it makes is
    closed at the test's end, whether the test passed or not (conftest.py's ledgers_closed)."""
    return lambda directory, every=2: closing(shard(directory, every))


@pytest.fixture
def restored(shard):
    """restored(source, step, digest, into): `source` copied to `into`, put back to its cut of
    `step` and started there (closed at the test's end)."""
    def restore(source, step: int, digest: str, into) -> ShardState:
        shutil.copytree(source, into)
        cuts.restore(str(into), step, digest, SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
        return shard(into)

    return restore


def test_a_cut_holds_exactly_the_pushes_through_its_step_and_a_resume_from_it_re_applies_the_rest(shard, restored, tmp_path):
    held = shard(tmp_path / "s")
    push(held, 1), push(held, 2)
    at_checkpoint = held.tables["emb"].digest()
    push(held, 3)  # the first push after step 2 (a multiple of 2): cut before it is applied
    assert held.tables["emb"].digest() != at_checkpoint
    cut = held.cut(2)
    assert (cut["step"], cut["epoch"]) == (2, 1)
    back = restored(tmp_path / "s", 2, cut["digest"], tmp_path / "r")
    assert back.tables["emb"].digest() == at_checkpoint  # not step 3's tables, and no ledger replayed
    assert not push(back, 2)  # trained before the cut: applied once already
    assert push(back, 3)  # trained after it: the dense weights train it again, and so do the tables
    assert back.tables["emb"].digest() == held.tables["emb"].digest()


def test_a_relaunched_shard_keeps_its_cut_and_multiples_crossed_at_once_share_one(shard, restored, tmp_path):
    held = shard(tmp_path / "s")
    push(held, 1)
    before = held.tables["emb"].digest()
    push(held, 7)  # steps 2..6 pushed nothing here: the cuts of 2, 4 and 6 are the same rows
    held.close()
    again = shard(tmp_path / "s")  # a relaunch: snapshot and ledger replayed
    digests = {again.cut(step)["digest"] for step in (2, 4, 6)}
    assert len(digests) == 1
    assert restored(tmp_path / "s", 4, digests.pop(), tmp_path / "r").tables["emb"].digest() == before
    after_seven = again.tables["emb"].digest()
    push(again, 9)  # where steps begin in the replayed ledger is not known: the cut of 8 is written whole
    assert restored(tmp_path / "s", 8, again.cut(8)["digest"], tmp_path / "r8").tables["emb"].digest() == after_seven


def test_another_step_is_cut_from_the_snapshot_and_ledger_unless_a_snapshot_or_a_relaunch_came_since(shard, restored, tmp_path):
    held = shard(tmp_path / "s", every=10)
    held.snapshot_every = 4
    push(held, 1), push(held, 2), push(held, 3)
    at_three = held.tables["emb"].digest()
    push(held, 4), push(held, 4, seq=40)  # a snapshot is due now, but waits for the next step's first push
    at_four = held.tables["emb"].digest()
    three = held.cut(3)  # an epoch's end, say, asked for after step 4's pushes: no multiple of 10
    push(held, 5)  # the snapshot is taken first: it holds steps <= 4
    four = held.cut(4)
    assert restored(tmp_path / "s", 3, three["digest"], tmp_path / "r3").tables["emb"].digest() == at_three
    assert restored(tmp_path / "s", 4, four["digest"], tmp_path / "r4").tables["emb"].digest() == at_four
    with pytest.raises(cuts.CutMissing, match="shard 0 took a snapshot after step 2"):
        held.cut(2)
    held.close()
    again = shard(tmp_path / "s", every=10)
    with pytest.raises(cuts.CutMissing, match="was relaunched since its last snapshot"):
        again.cut(5)
    push(again, 6)  # its first push after the relaunch: a snapshot first, so steps from 6 on can be cut
    at_six = again.tables["emb"].digest()
    push(again, 7)
    assert restored(tmp_path / "s", 6, again.cut(6)["digest"], tmp_path / "r6").tables["emb"].digest() == at_six


def test_a_cut_that_is_not_the_recorded_one_is_refused_and_only_cuts_a_resume_may_load_are_kept(shard, restored, tmp_path):
    held = shard(tmp_path / "s")
    for step in range(1, 8):
        push(held, step)
    two, four = held.cut(2), held.cut(4, keep=[2])  # 2 committed; 4 and 6 may still be uploading
    assert cuts.steps(str(tmp_path / "s")) == [2, 4, 6]
    held.cut(6, keep=[4])  # the run now keeps only 4: a resume loads 4, or 6 once committed
    assert cuts.steps(str(tmp_path / "s")) == [4, 6]
    with pytest.raises(cuts.CutMissing, match="no cut of step 2"):
        restored(tmp_path / "s", 2, two["digest"], tmp_path / "r")
    with pytest.raises(cuts.CutMissing, match="not the one the checkpoint recorded"):
        restored(tmp_path / "s", 4, "0" * 64, tmp_path / "r2")
    back = restored(tmp_path / "s", 4, four["digest"], tmp_path / "r3")
    assert cuts.steps(str(tmp_path / "r3")) == [4] and back.routing.epoch == 1


def test_a_resume_waits_for_a_killed_masters_last_shard_before_putting_its_cut_back(shard, tmp_path):
    """A SIGKILLed master's shards stop on their own with a last snapshot: it must not land over the cut."""
    held = shard(tmp_path / "ps" / "shard-0")
    push(held, 1), push(held, 2)
    at_checkpoint = held.tables["emb"].digest()
    push(held, 3)
    cut = {"step": 2, "routing": held.routing.to_json(), "digests": [held.cut(2)["digest"]]}
    held.close()
    ready = tmp_path / "ps" / "shard-0" / READY_FILE  # written by the shard process, as shard.py does
    orphan = subprocess.Popen([sys.executable, "-c", "import json, os, sys, time; open(sys.argv[1] + '.p', 'w').write("
                               "json.dumps({'pid': os.getpid()})); os.replace(sys.argv[1] + '.p', sys.argv[1]); time.sleep(0.5)",
                               str(ready), "elastic_step.ps.shard"])
    while not ready.exists():
        time.sleep(0.02)
    (tmp_path / "ps" / "shard-7").mkdir()  # a shard a later scale --ps added: not in the cut
    restore_cut(str(tmp_path / "ps"), cut)
    assert orphan.poll() is not None  # waited for it
    assert shard(tmp_path / "ps" / "shard-0").tables["emb"].digest() == at_checkpoint
    assert sorted(p.name for p in (tmp_path / "ps").iterdir()) == ["shard-0"]


def test_a_restore_a_crash_cut_short_is_finished_when_the_shard_starts(shard, tmp_path, monkeypatch):
    """A crash after the cut's snapshot is copied in, before its ledger is: the folder then holds
    the cut's snapshot under the later ledger, which a start would replay over it. The restore's
    intent file makes the next start finish the restore first."""
    held = shard(tmp_path / "s", every=10)
    held.snapshot_every = 2
    for step in (1, 2, 3):
        push(held, step)
    cut = held.cut(3)  # from the snapshot (after step 2) and the ledger's record of step 3
    assert cut["step"] == 3 and os.path.exists(cuts.path(str(tmp_path / "s"), 3, "ledger"))
    at_cut = held.tables["emb"].digest()
    push(held, 4), push(held, 5), push(held, 6)  # a later snapshot, and a ledger the cut does not hold
    held.close()
    failing_after_the_first_copy(monkeypatch, SystemExit("killed"))  # the process dies there
    with pytest.raises(SystemExit):
        cuts.restore(str(tmp_path / "s"), 3, cut["digest"], SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
    monkeypatch.undo()
    assert os.path.exists(tmp_path / "s" / cuts.RESTORING_FILE)
    again = shard(tmp_path / "s", every=10)
    assert again.tables["emb"].digest() == at_cut
    assert not os.path.exists(tmp_path / "s" / cuts.RESTORING_FILE)


def test_files_a_crash_left_of_an_unsealed_cut_are_neither_kept_by_a_restore_nor_taken_into_a_new_cut(shard, restored, tmp_path):
    """A crash while a later cut was removed (its .json first) or written leaves its .bin or
    .ledger without a .json: a restore removes them with the sealed ones, and a cut written at
    that step later holds only its own files."""
    held = shard(tmp_path / "s")
    push(held, 1), push(held, 2)
    cut = held.cut(2)
    at_cut = held.tables["emb"].digest()
    folder = tmp_path / "s" / cuts.CUTS_DIR
    (folder / "4.ledger").write_bytes(b"records of the timeline that went back")
    (folder / "6.bin").write_bytes(b"a snapshot of it")
    held.close()
    cuts.restore(str(tmp_path / "s"), 2, cut["digest"], SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
    assert sorted(os.listdir(folder)) == ["2.bin", "2.json", "2.ledger"]

    (folder / "4.ledger").write_bytes(b"left by a crash")
    again = shard(tmp_path / "s")  # a relaunch: steps' places in the ledger unknown, the cut of 4 written whole
    assert again.tables["emb"].digest() == at_cut
    push(again, 5)
    assert not os.path.exists(folder / "4.ledger")
    assert restored(tmp_path / "s", 4, again.cut(4)["digest"], tmp_path / "r").tables["emb"].digest() == at_cut
