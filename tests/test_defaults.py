"""Every surface that starts a job says the same thing when nothing is set: the defaults of
`TrainConfig`, the `train` and `prepare-data` commands, the KFP components' signatures, the
compiled pipelines (what the KFP UI shows) and the rendered Argo templates are those of
elastic_step.defaults."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from elastic_step import defaults
from elastic_step.cli import build_parser
from elastic_step.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent

# Each setting a user can leave unset, by its name on each surface, and the one default.
SETTINGS = {
    "workers": defaults.WORKERS,
    "epochs": defaults.EPOCHS,
    "minibatch_size": defaults.MINIBATCH_SIZE,
    "minibatches_per_task": defaults.MINIBATCHES_PER_TASK,
    "global_batch_size": defaults.GLOBAL_BATCH_SIZE,
    "lr_scaling": defaults.LR_SCALING,
    "mode": defaults.MODE,
    "ps_shards": defaults.PS_SHARDS,
    "ps_table_limit_mb": defaults.PS_TABLE_LIMIT_MB,
    "spares": defaults.SPARES,
    "checkpoint_steps": defaults.CHECKPOINT_STEPS,
    "seed": defaults.SEED,
    "backend": defaults.BACKEND,
    "device": defaults.DEVICE,
    "precision": defaults.PRECISION,
    "experiment": defaults.EXPERIMENT,
    "model_def": defaults.MODEL_DEF,
    "source": defaults.SOURCE,
    "registered_model": defaults.REGISTERED_MODEL,
    "label": defaults.LABEL,
    "split": defaults.SPLIT,
    "rows_per_shard": defaults.ROWS_PER_SHARD,
    "floors": defaults.FLOORS,
    "min_gains": defaults.MIN_GAINS,
    "startup_grace": defaults.STARTUP_GRACE_S,
    "heartbeat_timeout": defaults.HEARTBEAT_TIMEOUT_S,
    "rendezvous_timeout": defaults.RENDEZVOUS_TIMEOUT_S,
    "collective_timeout": defaults.COLLECTIVE_TIMEOUT_S,
    "master_timeout": defaults.MASTER_TIMEOUT_S,
    "pending_timeout": defaults.PENDING_TIMEOUT_S,
    "max_relaunches": defaults.MAX_RELAUNCHES,
    "keep_checkpoints": defaults.KEEP_CHECKPOINTS,
    "host": defaults.HOST,
    "port": defaults.PORT,
}


def drift(surface: dict, unlike: tuple = ()) -> dict:
    """name → (the surface's default, the one default), for every setting where they differ
    (but for `unlike`: names that mean something else on that surface)."""
    return {name: (value, SETTINGS[name]) for name, value in surface.items()
            if name in SETTINGS and name not in unlike and value != SETTINGS[name]}


# The training step's `registered_model` is the model to warm-start from (with
# `warm_start_alias`): none unless asked, unlike the pipelines' model to register.
WARM_START_ONLY = ("registered_model",)


def subcommand(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def cli_defaults(command: str) -> dict:
    return {a.dest: a.default for a in subcommand(command)._actions if a.default is not None and a.dest != "help"}


def test_train_config_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    assert {"workers", "epochs", "startup_grace", "pending_timeout"} <= set(fields) & set(SETTINGS)
    assert drift(fields) == {}


@pytest.mark.parametrize("command, expected", [
    ("train", {"workers", "epochs", "minibatch_size", "startup_grace", "master_timeout", "pending_timeout", "experiment"}),
    ("prepare-data", {"split", "rows_per_shard", "seed", "label"}),
])
def test_cli_defaults(command, expected):
    found = cli_defaults(command)
    assert expected <= set(found)
    assert drift(found) == {}


def test_every_train_flag_reaches_the_config(monkeypatch):
    """`train_config` carries every flag of `train` that is a setting of the job into it: none
    is dropped (and none left at TrainConfig's default behind the user's back)."""
    import elastic_step.cli.train as train

    monkeypatch.setattr(train, "TrainConfig", lambda **settings: settings)
    args = build_parser().parse_args(["train", "--model-def", "m", "--data", "d", "--job-dir", "j"])
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {a.dest for a in subcommand("train")._actions} & fields
    assert {"workers", "startup_grace", "init_from", "pending_timeout", "tolerations"} <= flags
    marks = {}
    for flag in flags:
        marks[flag] = object()
        setattr(args, flag, marks[flag])
    settings = train.train_config(args)
    assert {flag for flag in flags if settings.get(flag) is not marks[flag]} == set()


def test_component_signatures():
    """A component's defaults are written in its source (KFP runs that source alone), so this is
    what keeps them equal to the one place."""
    from elastic_step.components import prepare_data, train_elastic

    for component, expected in ((train_elastic, {"workers", "epochs", "model_def", "checkpoint_steps"}),
                                (prepare_data, {"split", "rows_per_shard", "seed", "label"})):
        signature = inspect.signature(component.python_func).parameters
        found = {name: p.default for name, p in signature.items() if p.default is not inspect.Parameter.empty}
        assert expected <= set(found)
        assert drift(found, unlike=WARM_START_ONLY) == {}, component.name


def test_release_component_signatures():
    """The gate's and export's defaults are the one place's too; their model definition has no
    default at all: a pipeline passes its own (a default could silently name another network, and
    the training run's model_def parameter is not to be trusted)."""
    from elastic_step.components import evaluate_model, export_model

    for component, expected in ((evaluate_model, {"floors", "min_gains"}), (export_model, set())):
        signature = inspect.signature(component.python_func).parameters
        assert signature["model_def"].default is inspect.Parameter.empty, component.name
        assert component.component_spec.inputs["model_def"].optional is False, component.name
        found = {name: p.default for name, p in signature.items() if p.default is not inspect.Parameter.empty}
        assert expected <= set(found)
        assert drift(found) == {}, component.name


def test_prepare_data_defaults():
    from elastic_step.data.prepare import parse_split, prepare_data

    found = {name: p.default for name, p in inspect.signature(prepare_data).parameters.items()
             if p.default is not inspect.Parameter.empty}
    assert found["split"] == parse_split(defaults.SPLIT)
    del found["split"]  # fractions here, the text of them elsewhere
    assert {"label", "rows_per_shard", "seed"} <= set(found)
    assert drift(found) == {}


def test_train_step_defaults():
    from elastic_step.training_step import train_step

    found = {name: p.default for name, p in inspect.signature(train_step).parameters.items()
             if p.default is not inspect.Parameter.empty}
    assert {"workers", "epochs"} <= set(found)
    assert drift(found, unlike=WARM_START_ONLY) == {}


@pytest.mark.parametrize("name", ["training_pipeline", "retraining_pipeline"])
def test_compiled_pipeline_parameters(name):
    """What the KFP UI offers: the root parameters of the committed IR YAML."""
    spec = next(yaml.safe_load_all((ROOT / "pipelines" / "compiled" / f"{name}.yaml").read_text()))
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    found = {}
    for key, parameter in parameters.items():
        value = parameter.get("defaultValue")
        if parameter["parameterType"] == "NUMBER_INTEGER":
            value = int(value)
        found[key] = value
    assert {"workers", "epochs", "source", "floors", "split", "label", "device", "precision"} <= set(found)
    assert drift(found) == {}


@pytest.mark.parametrize("name", ["training", "retraining"])
def test_argo_template_parameters(name):
    """The committed WorkflowTemplates' parameters (strings, as Argo has them; `floor` and
    `min-gain` as METRIC=VALUE)."""
    template = yaml.safe_load((ROOT / "pipelines" / "argo" / f"{name}-workflowtemplate.yaml").read_text())
    found = {}
    for parameter in template["spec"]["arguments"]["parameters"]:
        key = parameter["name"].replace("-", "_")
        key = {"floor": "floors", "min_gain": "min_gains"}.get(key, key)
        found[key] = parameter["value"]
    expected = {name: (defaults.metric_pairs(value) if isinstance(value, dict) else str(value))
                for name, value in SETTINGS.items() if name in found}
    assert {"workers", "epochs", "source", "floors", "label"} <= set(expected)
    assert {name: value for name, value in found.items() if name in expected} == expected
