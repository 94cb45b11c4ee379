"""`prepare-data` on a large generated CSV: peak RSS and rows/s, beside the floor.

The floor is pyarrow's own streaming conversion of the same file (`csv.open_csv` ->
`parquet.ParquetWriter`, one output file): no shuffle, no split, no shards. elastic-step does
all three in two passes through bounded memory. Each command runs in its own process; its peak
RSS is that process's VmHWM. The CSV is written to a temporary folder and removed afterwards.

    ../.venv/bin/python bench_prepare.py --size-gb 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import machine

FLOOR = """
import sys
import pyarrow.csv as pacsv, pyarrow.parquet as pq
reader = pacsv.open_csv(sys.argv[1])
rows = 0
with pq.ParquetWriter(sys.argv[2], reader.schema) as writer:
    for batch in reader:
        writer.write_batch(batch)
        rows += batch.num_rows
print("rows", rows)
"""

ELASTIC_STEP = """
import sys
from elastic_step.cli import main
if main(sys.argv[1:]):
    sys.exit(1)
"""

PEAK = "\nprint('peak_mb', [int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"


def write_csv(path: str, size_bytes: int) -> int:
    """Twenty feature columns of small integers and a label: the kind of file that grows most
    from text to memory (2-3 bytes of text per 8-byte value)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(0)
    rows, chunk = 0, 500_000
    with pa.OSFile(path, "wb") as sink:
        header = True
        while sink.tell() < size_bytes:
            columns = {f"f{i}": rng.integers(0, 100, chunk) for i in range(20)}
            columns["label"] = rng.integers(0, 10, chunk)
            pacsv.write_csv(pa.table(columns), sink, pacsv.WriteOptions(include_header=header))
            header = False
            rows += chunk
    return rows


def run(code: str, *args: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + PEAK, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{done.stderr[-2000:]}")
    peak = int(done.stdout.rsplit("peak_mb", 1)[1])
    return seconds, peak, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=5.0)
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--rows-per-shard", type=int, default=1_000_000)
    parser.add_argument("--row-group-rows", type=int, default=8192)
    parser.add_argument("--dir", default=None, help="where the CSV and outputs go (default: a temporary folder)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="bench-prepare-", dir=args.dir)
    try:
        source = os.path.join(root, "big.csv")
        t = time.perf_counter()
        rows = write_csv(source, int(args.size_gb * 1e9))
        size_gb = os.path.getsize(source) / 1e9
        print(f"machine: {machine()}")
        print(f"source: {size_gb:.2f} GB CSV, {rows:,} rows x 21 int columns (written in {time.perf_counter() - t:.0f} s)")

        floor_s, floor_peak, _ = run(FLOOR, source, os.path.join(root, "floor.parquet"))
        os.remove(os.path.join(root, "floor.parquet"))
        ours_s, ours_peak, _ = run(ELASTIC_STEP, "prepare-data", "--source", source, "--out", os.path.join(root, "out"),
                                   "--rows-per-shard", str(args.rows_per_shard), "--row-group-rows",
                                   str(args.row_group_rows), "--memory-mb", str(args.memory_mb), "--no-progress")
        print(f"{'':34} {'rows/s':>12} {'seconds':>9} {'peak RSS':>10}")
        print(f"{'pyarrow open_csv -> parquet (floor)':34} {rows / floor_s:>12,.0f} {floor_s:>9.1f} {floor_peak:>7} MB")
        print(f"{'elastic-step prepare-data':34} {rows / ours_s:>12,.0f} {ours_s:>9.1f} {ours_peak:>7} MB")
        print(f"ratio of rows/s: {floor_s / ours_s:.2f} (target >= 0.5); peak RSS {ours_peak} MB (target <= 1024 MB) "
              f"with --memory-mb {args.memory_mb}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
