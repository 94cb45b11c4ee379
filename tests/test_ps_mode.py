"""`train --mode ps`: the embedding tables on parameter-server shards the master starts.

Unit level: a PsEmbedding's pulled rows and merged gradients are nn.Embedding's; a frozen table
is a plain torch model (traceable, exported whole); a push's key names the rows, not the task
that carried them; bad flag combinations are refused before anything starts.

End to end: a DeepFM job with two workers and two shards, scaled to three shards mid-epoch
(`scale --ps 3`: only the virtual shards that change owner move, no worker restarts), then one
worker SIGKILLed and later one shard SIGKILLed (real signals): each embedding row's update
counter on the shards equals the count computed from the data alone (every minibatch updates
each of its distinct ids once), so no re-issued minibatch was applied twice and no acknowledged
update was lost, across the move too. `get` shows the three shards (shard 0 relaunched once,
each one's rows those its snapshot holds) and the run holds each shard's pushes. The kills follow the job's progress, not sleeps; the model and
data are small and the killed worker is not replaced (its start-up would only compete with the
survivor for the CPUs), so the job trains for about 10 s of its ~2 minutes under load: the rest
is the CLI, MLflow and worker start-ups and the final evaluation and model logging.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter

import numpy as np
import pytest
import torch
from rich.console import Console
from conftest import cli, synthetic_clicks

from elastic_step.ps.expected_updates import expected_updates, updates_on_the_shards
from elastic_step.ps.torch_embedding import PsEmbedding, freeze_tables
from elastic_step.worker.ps_step import push_key

DEEPFM_PS = "elastic_step.model_zoo.deepfm_ps_torch"


def test_pulled_rows_and_merged_gradients_are_nn_embeddings():
    torch.manual_seed(0)
    reference = torch.nn.Embedding(50, 4)
    table = PsEmbedding("t", 4)
    pulls = []

    def pull(ids):
        pulls.append(ids.copy())
        return reference.weight.detach().numpy()[ids]

    table.source = pull
    ids = torch.tensor([[3, 7, 3], [49, 7, 0]])
    weights = torch.randn(2, 3, 4)
    (table(ids) * weights).sum().backward()
    (reference(ids) * weights).sum().backward()
    assert pulls[0].tolist() == [3, 7, 49, 0]  # each distinct id pulled once, in order of appearance
    got_ids, grads = table.take_gradients()
    assert got_ids.tolist() == [3, 7, 49, 0]  # the pull's order: a shard reuses the pull's slots
    np.testing.assert_allclose(grads, reference.weight.grad.numpy()[got_ids], rtol=1e-6)
    assert table.take_gradients() is None  # taken once


def test_a_dense_weight_a_model_puts_on_the_shards_pushes_its_whole_gradient_and_is_no_parameter():
    """PsWeight: a model keeps a dense weight on the shards (not in the allreduce): every forward
    pulls all its rows, and the push carries the gradient torch gives the same weight in place."""
    from elastic_step.master.ps_tables import table_specs
    from elastic_step.ps.torch_embedding import PsWeight

    torch.manual_seed(0)
    weight = PsWeight("dense_out", 3, 5)
    net = torch.nn.ModuleDict({"out": weight, "hidden": torch.nn.Linear(5, 5)})
    reference = torch.nn.Parameter(torch.empty(3, 5).uniform_(-0.5, 0.5))
    weight.table.source = lambda ids: reference.detach().numpy()[ids]
    x = torch.randn(8, 5)
    (net["hidden"](x) @ weight().T).pow(2).sum().backward()
    (net["hidden"](x) @ reference.T).pow(2).sum().backward()
    ids, grads = weight.table.take_gradients()
    np.testing.assert_allclose(grads[np.argsort(ids)], reference.grad.numpy(), rtol=1e-5)
    assert sorted(ids.tolist()) == [0, 1, 2]
    assert [name for name, _ in net.named_parameters()] == ["hidden.weight", "hidden.bias"]  # not allreduced
    spec, = table_specs("dense_on_ps.py", net=net)
    assert (spec.name, spec.rows, spec.dim, spec.init_scale) == ("dense_out", 3, 5, pytest.approx(5 ** -0.5))


def test_a_declared_tables_range_is_checked_in_training_not_when_serving():
    """An id past `rows` fails a training step (a feed that does not match its table), while a
    served model's lookup gives it what it gives any id the table never held: a zero row."""
    from elastic_step.ps.embedding import TableRows
    from elastic_step.ps.api import TableSpec

    table = TableRows(TableSpec("ranged", 2, rows=10))
    table.source = lambda ids: np.where((ids < 10)[:, None], 1.0, 0.0).astype(np.float32) * np.ones((len(ids), 2), np.float32)
    with pytest.raises(ValueError, match="declares 10 rows .* given id 12"):
        table.distinct(np.array([3, 12]), training=True)
    unique, _, rows = table.distinct(np.array([3, 12]), training=False)
    assert unique.tolist() == [3, 12] and rows[1].tolist() == [0.0, 0.0]


def test_a_frozen_table_is_plain_torch_and_exported_whole():
    table = PsEmbedding("frozen_t", 2)
    freeze_tables({"frozen_t": (np.array([10, 2, 7]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))})
    later = PsEmbedding("frozen_t", 2)  # made after the freeze: adopts it too
    ids = torch.tensor([[2, 7], [10, 99]])
    expected = [[[2, 2], [3, 3]], [[1, 1], [0, 0]]]  # 99 was never trained: a zero row
    assert table(ids).tolist() == later(ids).tolist() == expected
    traced = torch.jit.trace(table.eval(), ids)
    assert traced(torch.tensor([[7, 10]])).tolist() == [[[3, 3], [1, 1]]]


def test_an_unbound_table_refuses_to_train_but_predicts_its_initial_rows():
    table = PsEmbedding("unbound_t", 3, init_scale=0.5)
    with pytest.raises(RuntimeError, match="--mode ps"):
        table(torch.tensor([1, 2]))
    with torch.no_grad():
        rows = table(torch.tensor([1, 2, 1]))
    assert rows.shape == (3, 3) and rows[0].tolist() == rows[2].tolist() and rows.abs().max() <= 0.5


def test_a_push_key_names_the_rows_whichever_task_carries_them():
    # Task 12 held rows 256..511 of data shard 3 in epoch 1; its worker died after 128 rows and
    # the master re-issued rows 384..511 as a new task: the minibatch at row 384 has one key.
    first = push_key(epoch=1, shard=3, first_row=256 + 128, minibatch_size=64)
    again = push_key(epoch=1, shard=3, first_row=384, minibatch_size=64)
    assert first == again == ((1 << 32) | 3, 6)
    assert push_key(2, 3, 384, 64) != first and push_key(1, 4, 384, 64) != first
    with pytest.raises(ValueError, match="grid"):
        push_key(1, 3, 100, 64)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = PsEmbedding("gone_t", 2)
        self.dense = torch.nn.Linear(1, 1)

    def forward(self, x):
        return self.table(x[:, 0].long()).sum(1) + self.dense(x[:, 1:]).squeeze(1)


class _Host:
    """Just enough of a worker for one PS step to run until its first pull."""

    def __init__(self, tmp_path):
        import types

        from elastic_step.frameworks.model_def import ModelDefinition
        from elastic_step.frameworks.torch_trainer import TorchTrainer
        from elastic_step.protocol import JobSpec, TrainingMode
        from elastic_step.ps.routing import RoutingTable
        from elastic_step.worker.step_api import Progress

        module = types.SimpleNamespace(model=_Net, loss=torch.nn.functional.mse_loss,
                                       optimizer=lambda net: torch.optim.SGD(net.parameters(), lr=0.1))
        self.trainer = TorchTrainer(ModelDefinition("gone.py", module), _Net())
        self.spec = JobSpec(job_name="j", model_def="gone.py", manifest="m", minibatch_size=4, seed=0, store_host="127.0.0.1",
                            store_port=1, collective_timeout_s=5, heartbeat_interval_s=1, master_timeout_s=5, features=["x"],
                            label="y", mode=TrainingMode.PS, ps_routing=RoutingTable.initial(1, ["127.0.0.1:1"]).to_json())
        self.progress, self.collective, self.failures = Progress(), None, []

    def task_taker(self, round_id):
        from elastic_step.protocol import TaskInfo, TaskStatus

        features = np.array([[1, 0.5], [2, 0.1], [1, 0.3], [5, 0.0]], np.float32)
        return lambda: (TaskStatus.TASK, TaskInfo(id=3, epoch=0, shard=0, start=0, count=4), (features, np.zeros(4, np.float32)))

    def regroup_due(self, round_id):
        return False

    def fail_job(self, reason):
        self.failures.append(reason)


def test_a_worker_whose_shards_stay_unreachable_fails_the_job_rather_than_regrouping(tmp_path, monkeypatch):
    from elastic_step.protocol import RendezvousReply, WorkerEnv
    from elastic_step.worker import ps_step
    from elastic_step.worker.step_api import RoundOutcome

    (tmp_path / "token").write_text("t")
    for name, value in ((WorkerEnv.MASTER_URL, "http://127.0.0.1:1"), (WorkerEnv.WORKER_ID, "w0.1"),
                        (WorkerEnv.TOKEN_FILE, str(tmp_path / "token"))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ps_step, "SHARD_DEADLINE_S", 0.3)
    host = _Host(tmp_path)
    step = ps_step.PsStep(host)
    outcome = step.train_round(RendezvousReply(status="ready", round_id=1, rank=0, world_size=1))
    assert outcome == RoundOutcome.FAILED  # a RuntimeError would have been taken for a peer's death: regroup
    assert len(host.failures) == 1 and "parameter-server shards did not answer" in host.failures[0], host.failures


@pytest.mark.parametrize("settings, words", [
    ({"global_batch_size": 128}, "drop --global-batch-size"),
    ({"ps_shards": 0}, "--ps-shards must be between 1 and 128"),
])
def test_bad_ps_settings_are_refused_before_anything_starts(tmp_path, settings, words):
    from elastic_step.config import TrainConfig
    from elastic_step.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        TrainConfig(model_def=DEEPFM_PS, data=str(tmp_path / "data"), job_dir=str(tmp_path / "job"), mode="ps", **settings)
    assert not (tmp_path / "job").exists()


def test_train_takes_ps_n_as_its_number_of_shards_as_scale_does(tmp_path):
    """`train --mode ps --ps N` is `--ps-shards N`: not refused as ambiguous with --ps-cpu/--ps-memory."""
    from elastic_step.cli import build_parser
    from elastic_step.cli.train import train_config

    argv = ["train", "--model-def", DEEPFM_PS, "--data", str(tmp_path / "data"), "--job-dir", str(tmp_path / "job"),
            "--mode", "ps", "--ps", "3"]  # 3: not the default
    config = train_config(build_parser().parse_args(argv))
    assert (config.mode, config.ps_shards) == ("ps", 3)


def test_a_model_without_ps_tables_is_refused_and_the_tables_are_found():
    from elastic_step.errors import ConfigError
    from elastic_step.master.ps_tables import table_specs

    with pytest.raises(ConfigError, match="has no PsEmbedding table"):
        table_specs("plain.py", net=torch.nn.Sequential(torch.nn.Embedding(10, 2)))
    shared = PsEmbedding("shared", 4)
    net = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(shared), "c": PsEmbedding("other", 2, optimizer="adam")})
    assert [(s.name, s.dim, s.optimizer) for s in table_specs("two_tables.py", net=net)] == [("shared", 4, "adagrad"), ("other", 2, "adam")]


def test_a_model_with_ps_tables_is_refused_in_allreduce_mode():
    from types import SimpleNamespace

    from elastic_step.errors import ConfigError
    from elastic_step.master.ps_tables import check_ps_tables

    config = SimpleNamespace(mode="allreduce", model_def="two_tables.py")
    with pytest.raises(ConfigError, match=r"^--mode allreduce: .* two_tables.py .*train it with --mode ps$"):
        check_ps_tables(config, SimpleNamespace(net=torch.nn.Sequential(PsEmbedding("in_allreduce", 2))))
    check_ps_tables(config, SimpleNamespace(net=torch.nn.Sequential(torch.nn.Embedding(10, 2))))  # a dense model passes


def test_a_bad_ps_flag_is_one_line_and_exit_2(tmp_path):
    done = cli("train", "--model-def", DEEPFM_PS, "--data", str(tmp_path / "nowhere"), "--job-dir", str(tmp_path / "job"),
               "--mode", "ps", "--global-batch-size", "128")
    assert done.returncode == 2, done.stderr
    assert "drop --global-batch-size" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "job").exists()


# -- end to end ----------------------------------------------------------------------------------
ROWS_PER_SHARD, MINIBATCH, EPOCHS = 800, 128, 2


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> str:
    return synthetic_clicks(tmp_path_factory.mktemp("ctr") / "data", rows=6000, seed=5, rows_per_shard=ROWS_PER_SHARD)


DECLARED_DEEPFM = """
from elastic_step.model_zoo.deepfm_ps_torch import DENSE, SPARSE, DeepFM, feed, loss, metrics, optimizer  # noqa: F401


def model():
    return DeepFM(len(SPARSE.columns), 2 * len(DENSE), rows={rows})
"""


@pytest.mark.parametrize("rows, words", [
    (10, "embedding table 'deepfm_ids' declares 10 rows (ids 0 to 9) but was given id "),
    (10**9, "need 49.0 GiB on each of 2 shards, more than this machine's memory divided among them"),
    (10**10, "table 'deepfm_ids' declares 10,000,000,000 rows, over 2,147,483,647 a shard across 2 shards"),
])
def test_a_declared_table_the_feed_or_the_shards_cannot_hold_is_one_line_and_exit_2(clicks, tmp_path, rows, words):
    """A table's declared size (PsEmbedding's rows=) is checked before any process starts:
    against the ids the feed makes (the master runs a batch through the model) and against the
    memory and index of the shards that would hold it."""
    (tmp_path / "declared.py").write_text(DECLARED_DEEPFM.format(rows=rows))
    done = cli("train", "--model-def", str(tmp_path / "declared.py"), "--data", clicks, "--job-dir", str(tmp_path / "job"),
               "--mode", "ps", "--ps-shards", "2")
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "job" / "ps").exists()  # no shard was started


def counters_from_the_data(data: str, epochs: int, minibatch: int) -> Counter:
    """Each id's update count in a clean run of the PyTorch DeepFM (ps.expected_updates)."""
    return expected_updates(data, DEEPFM_PS, minibatch, epochs)


def counters_on_the_shards(job_dir: str) -> Counter:
    """Each id's update count as the shards' last snapshots hold it (they take one on SIGTERM)."""
    return updates_on_the_shards(job_dir, "deepfm_ids")


def test_every_minibatch_updates_each_embedding_row_exactly_once_through_a_worker_and_a_shard_sigkill(clicks, start_job, capsys):
    from elastic_step.cli import main as cli_main

    # --max-relaunches 0: the survivor trains on alone (MIN 1); a replacement's start-up would
    # only compete with it for the CPUs (re-issued tasks are what this test is about).
    job = start_job("--model-def", DEEPFM_PS, "--data", clicks, "--mode", "ps", "--ps-shards", "2",
                    "--workers", "1:2", "--max-relaunches", "0", "--epochs", str(EPOCHS), "--minibatch-size",
                    str(MINIBATCH), "--minibatches-per-task", "2")
    status = job.wait_for(lambda s: s["world_size"] == 2 and 0.05 < s["rows_done"] / s["rows_total"] < 0.4, timeout=300)
    assert [(s["shard"], s["state"]) for s in status["ps_shards"]] == [(0, "serving"), (1, "serving")], status["ps_shards"]
    # Three shards while both workers train: about a third of the virtual shards (and rows) move.
    # The CLI's code runs in this process: the job trains for seconds, a CLI process starts slower.
    assert cli_main(["scale", job.job_dir, "--ps", "3"]) == 0
    said = capsys.readouterr().out
    moved = re.search(r"moved (\d+) of 128 virtual shards, (\d+) of (\d+) rows", said)
    assert moved and 0 < int(moved[1]) <= 128 // 3 + 7 and int(moved[2]) <= (1 / 3 + 0.05) * int(moved[3]), said
    victim = job.kill_worker(job.wait_for(lambda s: s["world_size"] == 2), rank=1)
    # Then a shard, once the survivor has trained on: the master relaunches it on its port from
    # its snapshot and ledger while the workers retry what it had not acknowledged; no worker
    # restarts for it.
    job.wait_for(lambda s: s["world_size"] == 1 and s["rows_done"] > status["rows_done"] + 2 * MINIBATCH, timeout=300)
    with open(os.path.join(job.job_dir, "ps", "shard-0", "ready.json")) as f:
        address = f"{(ready := json.load(f))['host']}:{ready['port']}"
        os.kill(ready["pid"], signal.SIGKILL)
    assert job.finish(timeout=600) == 0, job.output()
    died = [e for e in job.events() if e["event"] == "died"]
    assert [e["worker"] for e in died] == [victim["id"]], died  # none for the scale of the shards
    with open(os.path.join(job.job_dir, "logs", "master.log")) as f:
        assert "parameter-server shard 0 back in" in f.read()
    expected = counters_from_the_data(clicks, EPOCHS, MINIBATCH)
    got = counters_on_the_shards(job.job_dir)
    wrong = {i: (got[i], expected[i]) for i in set(got) | set(expected) if got[i] != expected[i]}
    assert not wrong, f"{len(wrong)} rows updated other than once per minibatch, e.g. {list(wrong.items())[:5]}"
    test = job.result()["test_metrics"]
    assert test["auc"] > 0.6, test  # the model the shards trained ranks clicks far better than chance
    shards_shown_after_the_job(job.job_dir, address, got)


def shards_shown_after_the_job(job_dir: str, address: str, counters: Counter) -> None:
    """`get` (and `get -o json`, the same view) shows each shard as the master last polled it,
    and the job's MLflow run holds each shard's numbers over time."""
    import mlflow

    from elastic_step.cli.render import job_tables
    from elastic_step.operate.folder import job_view
    from elastic_step.ps import snapshot

    view = job_view(job_dir)
    shards = view["ps_shards"]
    assert [(s["shard"], s["state"], s["relaunches"]) for s in shards] == [(0, "ended", 1), (1, "ended", 0), (2, "ended", 0)], shards
    assert shards[0]["address"] == address and all(s["bytes"] > 0 for s in shards), shards
    for s in shards:  # the rows each holds: trained ones, and those only pulled (validation's unseen ids)
        tables, _ = snapshot.load(os.path.join(job_dir, "ps", f"shard-{s['shard']}", "snapshot.bin"), ["deepfm_ids"])
        assert s["rows"] == len(tables["deepfm_ids"]["ids"]), s
    assert sum(s["rows"] for s in shards) >= len(counters), shards
    with open(os.path.join(job_dir, "mlflow_run.json")) as f:
        run_id = json.load(f)["run_id"]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{os.path.join(job_dir, 'mlflow.db')}")
    for shard in shards:
        logged = client.get_metric_history(run_id, f"ps.shard{shard['shard']}.pushes")
        assert logged and max(logged, key=lambda m: m.step).value == shard["pushes"] > 0, (shard, logged)
        rates = [m.value for m in client.get_metric_history(run_id, f"ps.shard{shard['shard']}.updates_per_s")]
        assert rates and min(rates) >= 0 and max(rates) > 0, (shard, rates)
    console = Console(width=200, record=True)
    console.print(job_tables(view))
    text = console.export_text()
    assert "PS SHARD" in text and address in text, text
