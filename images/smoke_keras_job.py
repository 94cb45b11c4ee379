"""Runs inside the built tensorflow image: prepare 400 rows of digits, train the model zoo's Keras
digits model for 1 epoch with 2 local workers, and check that the job ends 0, trained with Keras
on TensorFlow, with an exact audit (every training row applied exactly once). Exit 0 only then.
Small on purpose: it proves the image's TensorFlow imports and runs a job end to end; the torch
smoke job (smoke_job.py) covers a killed worker."""

import csv
import json
import subprocess
import sys

import tensorflow
from sklearn.datasets import load_digits

from elastic_step.audit import audit_report

ROWS = 400
work = "/tmp/smoke-keras"
digits = load_digits()
subprocess.run(["mkdir", "-p", work], check=True)
with open(f"{work}/digits.csv", "w", newline="") as f:
    out = csv.writer(f)
    out.writerow([f"pixel_{i}" for i in range(64)] + ["label"])
    for row, label in zip(digits.data[:ROWS], digits.target[:ROWS]):
        out.writerow([int(v) for v in row] + [int(label)])
subprocess.run(["elastic-step", "prepare-data", "--source", f"{work}/digits.csv", "--out", f"{work}/data",
                "--rows-per-shard", "64", "--no-progress"], check=True)
job = subprocess.run(["elastic-step", "train", "--model-def", "elastic_step.model_zoo.digits_keras", "--data", f"{work}/data",
                      "--job-dir", f"{work}/job", "--workers", "2", "--epochs", "1", "--minibatch-size", "16",
                      "--minibatches-per-task", "2", "--backend", "local", "--audit", f"{work}/audit.jsonl",
                      "--outputs", f"{work}/outputs", "--no-progress"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
print(job.stdout)
report = audit_report(f"{work}/audit.jsonl", f"{work}/data", 1) if job.returncode == 0 else {}
metrics = json.load(open(f"{work}/outputs/metrics.json")) if job.returncode == 0 else {}
ok = job.returncode == 0 and bool(report.get("exact")) and report.get("rows_applied") == report.get("rows_expected") > 0
print(f"smoke: keras on tensorflow {tensorflow.__version__}: exit code {job.returncode}, "
      f"audit {json.dumps({k: report.get(k) for k in ('exact', 'rows_applied', 'rows_expected', 'missing', 'repeated')})}, "
      f"test accuracy {metrics.get('accuracy', 0.0):.4f} -> {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
