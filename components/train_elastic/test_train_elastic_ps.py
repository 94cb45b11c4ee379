"""train_elastic with `mode=ps`: the step's pod runs the local backend, so the embedding tables of a
`PsEmbedding` model live on `ps_shards` shard processes beside its workers, and the model it
outputs holds the tables as the shards last acknowledged them.

The model is the Keras DeepFM (ps/keras_embedding.py) on two workers and two shards: each
embedding row's update counter on the shards equals the count computed from the data with the
PyTorch DeepFM's feed, so both front ends give the same ids and every minibatch updated each of
its distinct ids exactly once. (The PyTorch DeepFM's job, with kills and a scale of the shards,
is tests/test_ps_mode.py's.)"""

from __future__ import annotations

import json
import os
from collections import Counter

from kfp.dsl import HTML, Dataset, Markdown, Metrics, Model
from mlflow.tracking import MlflowClient

from elastic_step.ps import snapshot
from elastic_step.ps.expected_updates import expected_updates

DEEPFM_PS_KERAS = "elastic_step.model_zoo.deepfm_ps_keras"
MINIBATCH = 128


def test_train_elastic_in_ps_mode_keeps_the_tables_on_shards_and_outputs_them_in_the_model(tmp_path, mlflow_uri):
    from elastic_step.components import prepare_data, train_elastic

    data = Dataset(uri=str(tmp_path / "dataset"))
    prepare_data.python_func(source="synthetic:criteo?rows=2000&seed=3", dataset=data,
                             summary=Markdown(uri=str(tmp_path / "summary.md")), categorical="auto", rows_per_shard=500)
    model, metrics = Model(uri=str(tmp_path / "model")), Metrics(uri=str(tmp_path / "metrics"))
    job_dir, report = tmp_path / "job", HTML(uri=str(tmp_path / "report.html"))
    train_elastic.python_func(dataset=data, model=model, metrics=metrics, report=report,
                              model_def=DEEPFM_PS_KERAS, mode="ps", ps_shards=2, workers="2", epochs=1,
                              minibatch_size=MINIBATCH, checkpoint_steps=0, mlflow_uri=mlflow_uri, job_dir=str(job_dir))

    run = MlflowClient(mlflow_uri).get_run(model.metadata["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert (run.data.params["mode"], run.data.params["ps_shards"]) == ("ps", "2")
    # each shard held part of the table, and the run recorded what each held
    counters = Counter()
    for i in range(2):
        tables, _ = snapshot.load(str(job_dir / "ps" / f"shard-{i}" / "snapshot.bin"), ["deepfm_ids"])
        held = tables["deepfm_ids"]
        assert len(held["ids"]) > 0 and run.data.metrics[f"ps.shard{i}.rows"] == len(held["ids"])
        counters.update({i: u for i, u in zip(held["ids"].tolist(), held["updates"].tolist()) if u})
    # each minibatch updated each of its distinct ids once, whoever trained it; the PyTorch DeepFM's ids
    expected = expected_updates(data.path, "elastic_step.model_zoo.deepfm_ps_torch", MINIBATCH)
    wrong = {i: (counters[i], expected[i]) for i in set(counters) | set(expected) if counters[i] != expected[i]}
    assert not wrong, f"{len(wrong)} rows updated other than once per minibatch, e.g. {list(wrong.items())[:5]}"
    assert json.load(open(os.path.join(model.path, "model.json")))["framework"] == "tensorflow"
    assert model.metadata["model_uri"].startswith("models:/") and dict(metrics.metadata)
