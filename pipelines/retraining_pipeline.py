from kfp import dsl

from elastic_step.pipelines.lifecycle import lifecycle


@dsl.pipeline(name="elastic-step-retraining",
              description="Scheduled retraining: warm-start from @champion on fresh data, and promote only a better model. Never cached.")
def retraining_pipeline(
    source: str = "sklearn:digits",
    model_def: str = "elastic_step.model_zoo.digits_torch",
    registered_model: str = "digits",
    workers: str = "2:3",
    epochs: int = 3,
    minibatch_size: int = 32,
    minibatches_per_task: int = 4,
    checkpoint_steps: int = 100,
    backend: str = "local",
    mlflow_uri: str = "",
    experiment: str = "elastic-step",
    floors: dict = {"accuracy": 0.9},
    min_gains: dict = {"accuracy": 0.0},
    split: str = "0.8,0.1,0.1",
    rows_per_shard: int = 512,
    seed: int = 0,
    job_dir: str = "",
):
    # A scheduled retrain must never be served from cache: every task runs every time.
    lifecycle(source=source, split=split, rows_per_shard=rows_per_shard, seed=seed, model_def=model_def,
              workers=workers, epochs=epochs, minibatch_size=minibatch_size, minibatches_per_task=minibatches_per_task,
              checkpoint_steps=checkpoint_steps, backend=backend, mlflow_uri=mlflow_uri, experiment=experiment,
              registered_model=registered_model, floors=floors, min_gains=min_gains, job_dir=job_dir,
              warm_start_alias="champion", caching=False)
