"""benchmarks/bench_sparse.py on a small table, as a script: by default its five variants run
interleaved, all five built at once; with --one-at-a-time each is built, measured and released
before the next is built (one table held at a time), and the same figures are printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SMALL = ["--ids", "3000", "--batches", "25", "--batch", "32", "--repeats", "2"]

# The bench's main, each variant's context counted while it holds its table.
COUNTED = """
import contextlib, sys
import bench_sparse
held, most, built = [0], [0], []
def counted(make):
    @contextlib.contextmanager
    def holding(*args, **kwargs):
        with make(*args, **kwargs) as step:
            held[0] += 1
            most[0] = max(most[0], held[0])
            built.append(make.__name__)
            try:
                yield step
            finally:
                held[0] -= 1
    return holding
for name in ("ps_step", "in_process_step", "peer_step"):
    setattr(bench_sparse, name, counted(getattr(bench_sparse, name)))
sys.argv = ["bench_sparse.py", *sys.argv[1:]]
bench_sparse.main()
print(f"held at once: {most[0]} of {len(built)} variants built")
"""


def run(*flags: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", COUNTED, *SMALL, *flags], cwd=BENCHMARKS, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_the_variants_run_interleaved_or_one_at_a_time_and_print_the_same_figures():
    interleaved, alone = run(), run("--one-at-a-time")
    assert interleaved[-1] == "held at once: 5 of 10 variants built"
    assert alone[-1] == "held at once: 1 of 10 variants built"
    assert alone[1] == interleaved[1] + ", the variants one at a time (not interleaved)"
    figures = interleaved[2:-1]
    assert len(figures) == 4 and all(re.search(r"\d rows/s \(\d[\d,]*, \d[\d,]*\)", line) for line in figures), figures

    def shape(line: str) -> str:
        return re.sub(r"\d[\d,.]*", "#", line)

    assert [shape(line) for line in alone[2:-1]] == [shape(line) for line in figures]
