"""The code MLflow loads as the pyfunc model of a `--mode ps` run served from its shards'
snapshots (sharded_model.py logs it as a model from code, so nothing of the model is pickled)."""

from mlflow.models import set_model

from elastic_step.release.sharded_model import ShardedTablesModel

set_model(ShardedTablesModel())
