"""Categorical hashing: int and string hashes per second per core, beside two peers.

elastic-step's `Hashing` (categorical.py: a documented 64-bit hash, vectorised in numpy) on what
a worker's reader hands a model definition: an int64 array, and an object array of Python str
(Criteo's categorical values are 8 hex characters; URLs are longer). Peers on the same values:
Python's hashlib (blake2b, 8-byte digest) one value at a time, as a loop in a feed would do it,
and pandas' `hash_array` (SipHash over object arrays; a vectorised mix for ints).

Everything runs on one thread (numpy, Arrow and BLAS pools set to 1), and the rate is hashes per
second of this process's CPU time, so the figure is per core even on a machine other work shares.

    ../.venv/bin/python bench_hashing.py --ints 2000000 --strings 1000000
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from common import machine  # noqa: E402

pa.set_cpu_count(1)
pa.set_io_thread_count(1)


def per_core_rate(fn, values, repeats: int) -> float:
    """Median over `repeats` of values hashed per CPU-second."""
    rates = []
    for _ in range(repeats):
        start = time.process_time()
        fn(values)
        rates.append(len(values) / max(time.process_time() - start, 1e-9))
    return statistics.median(rates)


def hashlib_per_value(values) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(), "little") for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ints", type=int, default=2_000_000)
    parser.add_argument("--strings", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import pandas as pd
    from pandas.util import hash_array

    from elastic_step.data.categorical import Hashing, Lookup

    rng = np.random.default_rng(0)
    ints = rng.integers(0, 1 << 40, args.ints)
    hexes = np.array([f"{v:08x}" for v in rng.integers(0, 1 << 32, args.strings)], dtype=object)
    urls = np.array([f"https://site-{v % 9973}.example.com/p/{v}" for v in rng.integers(0, 1 << 40, args.strings)],
                    dtype=object)
    layer = Hashing(1 << 20, salt="bench")
    vocabulary = Lookup(np.unique(hexes[: args.strings // 10]), num_oov_buckets=8)
    few = max(1, args.strings // 20)  # hashlib is slow: a slice gives its rate

    print(f"machine: {machine()}; numpy {np.__version__}, pyarrow {pa.__version__}, pandas {pd.__version__}")
    print("hashes per second per core (CPU time, one thread), median of", args.repeats)
    print(f"{'values':<34}{'elastic-step':>14}{'hashlib/value':>15}{'pandas':>14}")
    rows = [
        (f"int64 x {args.ints:,}", lambda v: layer(v), ints, hash_array),
        (f"str, 8 hex chars x {args.strings:,}", lambda v: layer(v), hexes, hash_array),
        (f"str, ~40-char URLs x {args.strings:,}", lambda v: layer(v), urls, hash_array),
    ]
    for label, ours, values, peer in rows:
        mine = per_core_rate(ours, values, args.repeats)
        slow = per_core_rate(hashlib_per_value, values[:few], max(1, args.repeats // 2))
        theirs = per_core_rate(peer, values, args.repeats)
        print(f"{label:<34}{mine:>14,.0f}{slow:>15,.0f}{theirs:>14,.0f}")
    lookup = per_core_rate(vocabulary, hexes, args.repeats)
    print(f"Lookup of 8-hex-char str in a {len(vocabulary.vocabulary):,}-value vocabulary (90% out of it): "
          f"{lookup:,.0f} /s per core")


if __name__ == "__main__":
    main()
