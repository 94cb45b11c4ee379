"""`make bench`: every benchmark in one run, each figure printed beside its peer."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = [
    ["bench_throughput.py", "--workers", "2", "3"],
    ["bench_throughput.py", "--workers", "2", "3", "--model", "wide", "--copies", "4", "--epochs", "2"],
    ["bench_recovery.py", "--workers", "3", "--kills", "3"],
    ["bench_recovery.py", "--workers", "3", "--kills", "3", "--model", "wide", "--no-peer"],
    ["bench_recovery.py", "--workers", "3", "--kills", "3", "--spares", "1"],
    ["bench_equivalence.py", "--seeds", "0", "1", "2", "3", "4", "5", "--disturbed", "4"],
    ["bench_dispatcher.py"],
    ["bench_hashing.py"],
    ["bench_checkpoint.py"],
    ["bench_keras.py", "--workers", "2"],
    ["bench_remote_data.py"],
    ["bench_cluster.py"],
    ["bench_prepare.py", "--size-gb", "5", "--rows-per-shard", "500000"],
    ["bench_ps.py", "--rows", "10000000", "--kill-rows", "2500000", "--kills", "5"],
    ["bench_sparse.py", "--ids", "1000000", "--batches", "200", "--batch", "512", "--scale"],
    ["bench_ctr_kills.py", "--rows", "240000", "--epochs", "2", "--kills", "20"],
]

if __name__ == "__main__":
    failed = 0
    for bench in BENCHMARKS:
        failed |= subprocess.run([sys.executable, os.path.join(HERE, bench[0]), *bench[1:]], cwd=HERE).returncode
    sys.exit(1 if failed else 0)
