import sys

from elastic_step.cli import exit_now, main

code = main()
# A job's processes (the master's `train`, its `worker`s) have saved, recorded and flushed all they
# own by the time main returns: they skip the interpreter's teardown of torch's, MLflow's and
# pyarrow's modules (seconds on a busy node, and a master waits for its workers' exits).
if next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None) in ("train", "worker"):
    exit_now(code)
sys.exit(code)
