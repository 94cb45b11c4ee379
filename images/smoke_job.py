"""Runs inside the built image: prepare digits, train with 2 local workers, SIGKILL one of
them mid-epoch, and check the job still finishes with a good model. Exit 0 only then."""

import os
import signal
import subprocess
import sys
import time

from elastic_step.operate.client import try_status

work = "/tmp/smoke"
subprocess.run(["elastic-step", "prepare-data", "--source", "sklearn:digits", "--out", f"{work}/data", "--rows-per-shard", "256"], check=True)
job = subprocess.Popen(["elastic-step", "train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", f"{work}/data",
                        "--job-dir", f"{work}/job", "--workers", "2", "--epochs", "8", "--minibatch-size", "16",
                        "--minibatches-per-task", "2", "--heartbeat-timeout", "4", "--no-progress"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
killed = None
deadline = time.monotonic() + 300
while killed is None and job.poll() is None and time.monotonic() < deadline:
    status = try_status(f"{work}/job")
    if status and status["world_size"] == 2 and status["rows_done"] > 0.2 * status["rows_total"]:
        victim = next(w for w in status["workers"] if w["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        killed = victim["id"]
        print(f"smoke: SIGKILLed worker {killed} (pid {victim['pid']}) at {status['rows_done']}/{status['rows_total']} rows", flush=True)
    time.sleep(0.05)
output, _ = job.communicate(timeout=600)
print(output)
accuracy = next((float(line.split("accuracy")[1].split()[0]) for line in output.splitlines() if line.startswith("test:") and "accuracy" in line), 0.0)
ok = job.returncode == 0 and killed is not None and accuracy >= 0.9
print(f"smoke: exit code {job.returncode}, worker killed: {killed}, test accuracy {accuracy:.4f} -> {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
