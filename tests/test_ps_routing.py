"""Virtual-shard routing: growing or shrinking the shard processes moves only the virtual shards
that must move (about 1/N of them), leaves every process balanced, and bumps the epoch."""

import socket
import time

import numpy as np
import pytest

from elastic_step.ps.api import ShardUnavailable
from elastic_step.ps.client import CONNECT_TIMEOUT_S, PsClient
from elastic_step.ps.routing import RoutingTable, virtual_shard_of

V = 128


@pytest.mark.parametrize("before,after", [(1, 2), (2, 3), (3, 4), (4, 8), (7, 8), (8, 7), (3, 2), (2, 1), (5, 3), (16, 17)])
def test_resizing_moves_about_one_nth_of_the_virtual_shards(before, after):
    routing = RoutingTable.initial(before, virtual_shards=V)
    resized = routing.resized(after)
    moved = int((resized.owners != routing.owners).sum())
    assert moved / V <= abs(after - before) / max(before, after) + max(before, after) / V
    counts = np.bincount(resized.owners, minlength=after)
    assert len(counts) == after and counts.max() - counts.min() <= 1
    assert resized.epoch == routing.epoch + 1


def test_a_chain_of_resizes_stays_minimal_and_rows_follow_their_virtual_shard():
    routing = RoutingTable.initial(2, virtual_shards=V)
    ids = np.random.default_rng(0).integers(0, 1 << 50, 100_000)
    for shards in (3, 4, 6, 5, 2, 3):
        resized = routing.resized(shards)
        rows_moved = float((resized.shard_of(ids) != routing.shard_of(ids)).mean())
        virtual_moved = float((resized.owners != routing.owners).mean())
        assert abs(rows_moved - virtual_moved) < 0.02  # ids spread evenly over virtual shards
        assert virtual_moved <= abs(shards - routing.shards) / max(shards, routing.shards) + 0.05
        routing = resized
    assert routing.epoch == 7


def test_ids_spread_evenly_over_virtual_shards_and_the_table_round_trips():
    counts = np.bincount(virtual_shard_of(np.arange(128_000), V), minlength=V)
    assert counts.min() > 0.85 * 1000 and counts.max() < 1.15 * 1000
    routing = RoutingTable.initial(3, ["a:1", "b:2", "c:3"]).resized(4, ["a:1", "b:2", "c:3", "d:4"])
    again = RoutingTable.from_json(routing.to_json())
    assert again.epoch == routing.epoch and again.endpoints == routing.endpoints
    np.testing.assert_array_equal(again.owners, routing.owners)


def test_shard_counts_outside_one_to_v_are_refused():
    with pytest.raises(ValueError, match="between 1 and 128"):
        RoutingTable.initial(0)
    with pytest.raises(ValueError, match="between 1 and 128"):
        RoutingTable.initial(2).resized(129)


def test_a_shard_address_that_never_answers_a_connection_is_given_up_in_seconds_not_the_read_timeout():
    """A deleted pod's address takes no connection and refuses none (its packets go nowhere): a
    listener whose accept queue is full is the same to a client on loopback. The client gives up
    on the connection within CONNECT_TIMEOUT_S (then asks the routes again, or, past its deadline,
    says the shards are unavailable) instead of waiting its 30 s read timeout: a worker's pushes
    stalled that long after a shard pod was deleted."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    endpoint = f"127.0.0.1:{full.getsockname()[1]}"
    queued = socket.create_connection(("127.0.0.1", full.getsockname()[1]))  # fills the accept queue
    client = PsClient("token", lambda: RoutingTable.initial(1, [endpoint]), deadline_s=1.0, timeout_s=30.0)
    started = time.monotonic()
    try:
        with pytest.raises(ShardUnavailable):
            client.pull("table", np.arange(4, dtype=np.int64))
        waited = time.monotonic() - started
        assert waited < CONNECT_TIMEOUT_S + 2.0, waited  # one connection given up, then past the 1 s deadline
    finally:
        client.close()
        queued.close()
        full.close()
