"""The coordination cost of the Keras path, beside PyTorch's: steady-state samples/s of
`elastic-step train` with N local workers ÷ (N × the same model definition trained in one
plain process of the same framework: a GradientTape / autograd loop, same data and minibatch).

A ratio of 1.0 would mean N workers cost nothing over N independent single processes; on a
machine with fewer cores than N workers plus the master, the ratio also includes that sharing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import elastic_step, machine, prepared_digits, read_steps, steady_rate

MODELS = {"tensorflow": "elastic_step.model_zoo.digits_keras", "pytorch": "elastic_step.model_zoo.digits_torch"}


def single_process(framework: str, data: str, epochs: int, batch: int, log: str) -> None:
    """One process, no engine: the plain training loop a user of the framework would write."""
    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import ShardReader
    from elastic_step.frameworks.model_def import batch_arrays, load_model_definition

    model_def = load_model_definition(MODELS[framework])
    manifest = load_manifest(data)
    features, labels = batch_arrays(model_def, ShardReader(manifest).read_split("train"), manifest.features, manifest.label)
    if framework == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)  # as the engine sets a worker's
        tf.config.threading.set_inter_op_parallelism_threads(1)
        model = model_def.model()
        optimizer = model_def.optimizer(model)

        @tf.function(input_signature=[tf.TensorSpec([None, features.shape[1]], tf.float32), tf.TensorSpec([None], tf.int64)])
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model_def.loss(model(x, training=True), y)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    else:
        import torch

        torch.set_num_threads(1)
        net = model_def.model()
        optimizer = model_def.optimizer(net)
        features, labels = torch.from_numpy(features), torch.from_numpy(labels)

        def step(x, y):
            optimizer.zero_grad()
            model_def.loss(net(x), y).backward()
            optimizer.step()

    with open(log, "w") as out:
        for _ in range(epochs):
            for start in range(0, len(labels), batch):
                x, y = features[start:start + batch], labels[start:start + batch]
                step(x, y)
                out.write(json.dumps({"time": time.time(), "samples": int(len(y))}) + "\n")


def run(framework: str, workers: int, epochs: int, batch: int, root: str) -> dict:
    data = prepared_digits(root)
    job_dir = os.path.join(root, f"{framework}-{workers}")
    ours = elastic_step("train", "--model-def", MODELS[framework], "--data", data, "--job-dir", job_dir,
                        "--workers", str(workers), "--epochs", str(epochs), "--minibatch-size", str(batch),
                        "--minibatches-per-task", "16", "--checkpoint-steps", "0", "--no-progress",
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert ours.wait() == 0, f"elastic-step training ({framework}) failed; see {job_dir}"
    engine = steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))
    log = os.path.join(root, f"single-{framework}.jsonl")
    single = subprocess.run([sys.executable, __file__, "--single", framework, "--data", data, "--epochs", str(epochs),
                             "--minibatch-size", str(batch), "--step-log", log],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-2000:]
    alone = steady_rate(read_steps(log))
    return {"framework": framework, "workers": workers, "engine": engine, "single": alone, "ratio": engine / (workers * alone)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--single", choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--step-log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        single_process(args.single, args.data, args.epochs, args.minibatch_size, args.step_log)
        return
    print(f"keras coordination cost: digits MLP, minibatch {args.minibatch_size} per worker, {args.epochs} epochs; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            kr, pt = (run(framework, n, args.epochs, args.minibatch_size, root) for framework in ("tensorflow", "pytorch"))
            print(f"  N={n}: keras {kr['engine']:7.0f} samples/s ÷ ({n} × {kr['single']:6.0f} single-process) = {kr['ratio']:.3f}"
                  f"   |   pytorch {pt['engine']:7.0f} ÷ ({n} × {pt['single']:6.0f}) = {pt['ratio']:.3f}")


if __name__ == "__main__":
    main()
