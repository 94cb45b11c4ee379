"""A `--mode ps` job's tables as the master checks them before anything starts: the model
definition's PsEmbedding tables (`table_specs`), whether their declared sizes fit the shards'
memory (`check_table_sizes`, also before a scale --ps), and whether the job's mode and its model
agree on keeping them on shards (`check_ps_tables`).
"""

from __future__ import annotations

from elastic_step.backends.kubernetes.options import parse_quantity, request_and_limit
from elastic_step.config import TrainConfig
from elastic_step.errors import ConfigError
from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.protocol import TrainingMode
from elastic_step.ps import sizing
from elastic_step.ps.api import TableSpec
from elastic_step.ps.embedding import ps_tables
from elastic_step.ps.index import MAX_ROWS


def table_specs(model_def_source: str, net=None) -> list[TableSpec]:
    """The tables the model definition keeps on the shards: its net's PsEmbedding modules or layers."""
    if net is None:
        net = load_model_definition(model_def_source).model()
    specs = [embedding.ps_table.spec for embedding in ps_tables(net)]  # PyTorch's or Keras'
    if not specs:
        raise ConfigError(f"--mode ps: the model definition {model_def_source} has no PsEmbedding table; declare its "
                          "embeddings with elastic_step.ps.torch_embedding's or keras_embedding's PsEmbedding, "
                          "or use --mode allreduce")
    return specs


def check_table_sizes(config: TrainConfig, specs: list[TableSpec], shards: int | None = None) -> None:
    """Tables of declared size (PsEmbedding's rows=) that their shards could not hold are refused
    before anything starts (and before a scale --ps to `shards`), rather than a shard dying of OOM
    an hour into the run."""
    shards = config.ps_shards if shards is None else shards
    too_big = sizing.too_many_rows(specs, shards)
    if too_big is not None:
        raise ConfigError(f"--mode ps: table {too_big.name!r} declares {too_big.rows:,} rows, over {MAX_ROWS:,} a shard "
                          f"across {shards} shards; run more shards (--ps-shards)")
    memory, where = _shard_memory(config, shards)
    need = sizing.shard_bytes(specs, shards)
    if memory is not None and need > memory:
        declared = ", ".join(f"{s.name!r} {s.rows:,} rows x {sizing.bytes_per_row(s):.0f} B" for s in specs if s.rows)
        raise ConfigError(f"--mode ps: the tables ({declared}) need {need / 2**30:.1f} GiB on each of {shards} shards, "
                          f"more than {where} ({memory / 2**30:.1f} GiB); run more shards (--ps-shards) or give them "
                          "more memory (--ps-memory)")


def _shard_memory(config: TrainConfig, shards: int) -> tuple[float | None, str]:
    """(bytes one of `shards` shards may use, where that figure comes from); None where nothing limits it."""
    if config.backend != "kubernetes":  # the shard processes share this machine (or the step's pod)
        return sizing.local_memory_bytes() / shards, "this machine's memory divided among them"
    for option, value in (("--ps-memory", config.ps_memory), ("--worker-memory", config.worker_memory)):
        if value:
            request, limit = request_and_limit(option, value)
            return parse_quantity(option, limit or request), f"each shard pod's {option} limit"
    return None, ""


def check_ps_tables(config: TrainConfig, trainer) -> None:
    """Before anything starts: a --mode ps job's model has tables for the shards, and another
    mode's has none (its workers would fail at their first step, PyTorch's or TensorFlow's way)."""
    model = getattr(trainer, "net", None)
    model = getattr(trainer, "model", None) if model is None else model
    if config.mode == TrainingMode.PS:
        check_table_sizes(config, table_specs(config.model_def, model))
    elif model is not None and ps_tables(model):
        raise ConfigError(f"--mode {config.mode}: the model definition {config.model_def} keeps its embedding tables on "
                          "parameter-server shards (PsEmbedding); train it with --mode ps")

