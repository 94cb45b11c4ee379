"""`elastic-step scale JOB --ps N`: change the number of a running `--mode ps` job's parameter-
server shards. The master moves only the virtual shards that change owner while the workers
train on (elastic_step/ps/moves.py), and this waits for it and says what moved."""

from __future__ import annotations

from elastic_step.errors import ConfigError
from elastic_step.ps.routing import DEFAULT_VIRTUAL_SHARDS

MOVE_TIMEOUT_S = 600.0  # moving a large table's rows takes a while; the master answers once done


def scale_ps(args) -> int:
    from elastic_step.cli.observe import job_of, operator
    from elastic_step.operate.client import JobClient
    from elastic_step.operate.local import LocalJobs

    if not 1 <= args.ps <= DEFAULT_VIRTUAL_SHARDS:
        raise ConfigError(f"--ps {args.ps}: give between 1 and {DEFAULT_VIRTUAL_SHARDS} shards (the tables' virtual shards)")
    jobs = operator(args)
    if not isinstance(jobs, LocalJobs):
        raise ConfigError("scale --ps: parameter-server shards run on the local backend only; scale a job started "
                          "with `train --mode ps` (backend local) by its folder or name")
    client = JobClient(jobs.locate(job_of(args)), timeout_s=MOVE_TIMEOUT_S)
    try:
        status = client.scale_ps(args.ps)
    finally:
        client.close()
    moved = status["ps_scale"]
    pauses = f"each moved virtual shard paused at most {moved['pause_max_s']:.2f} s"
    print(f"job {status['job']} runs {args.ps} parameter-server shards (routing epoch {moved['epoch']}): moved "
          f"{moved['moved']} of {moved['virtual_shards']} virtual shards, {moved['rows_moved']} of {moved['rows_total']} "
          f"rows, in {moved['seconds']:.2f} s; {pauses}")
    return 0
