"""`elastic-step scale JOB --ps N`: change the number of a running `--mode ps` job's parameter-
server shards, on the local backend or Kubernetes (the job's operator, operate/). The master
moves only the virtual shards that change owner while the workers train on
(elastic_step/ps/moves.py), and this waits for it and says what moved."""

from __future__ import annotations

from elastic_step.errors import ConfigError
from elastic_step.ps.routing import DEFAULT_VIRTUAL_SHARDS


def scale_ps(args) -> int:
    from elastic_step.cli.observe import job_of, operator

    if not 1 <= args.ps <= DEFAULT_VIRTUAL_SHARDS:
        raise ConfigError(f"--ps {args.ps}: give between 1 and {DEFAULT_VIRTUAL_SHARDS} shards (the tables' virtual shards)")
    answer = operator(args).scale_ps(job_of(args), args.ps)
    moved = answer["ps_scale"]
    pauses = f"each moved virtual shard paused at most {moved['pause_max_s']:.2f} s"
    print(f"job {answer['job']} runs {args.ps} parameter-server shards (routing epoch {moved['epoch']}): moved "
          f"{moved['moved']} of {moved['virtual_shards']} virtual shards, {moved['rows_moved']} of {moved['rows_total']} "
          f"rows, in {moved['seconds']:.2f} s; {pauses}")
    return 0
