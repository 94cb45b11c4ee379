"""`elastic-step prepare-data`: a dataset into a manifest and Parquet shards."""

from __future__ import annotations

import argparse
import sys

from elastic_step import defaults


def register(sub) -> None:
    p = sub.add_parser("prepare-data", help="turn a dataset into a manifest and Parquet shards")
    p.add_argument("--source", required=True,
                   help="sklearn:digits, or a CSV/Parquet/JSONL file, optionally compressed (.gz, .bz2, .xz, .zst), "
                        "as a path or fsspec URI (s3://, gs://, ...)")
    p.add_argument("--out", required=True, help="output folder (or fsspec URI)")
    p.add_argument("--label", default=defaults.LABEL, help="the label column (default %(default)s)")
    p.add_argument("--features", help="comma-separated feature columns (default: every other column)")
    p.add_argument("--categorical", action="append", default=[], metavar="SPEC",
                   help="string or integer columns to turn into ids, `;`-separated, repeatable: COLUMN=hash:BINS[:salt=S], "
                        "COLUMN=vocab[:oov=N][:min=F] (a vocabulary of the training split, N out-of-vocabulary buckets, "
                        "values seen at least F times), a bare COLUMN (vocab), or `auto` (every other string column; "
                        "the choices are printed)")
    p.add_argument("--buckets", action="append", default=[], metavar="SPEC",
                   help="numeric columns to bucketize, `;`-separated, repeatable: COLUMN=B1,B2,... (increasing "
                        "boundaries) or COLUMN=quantiles:N (N buckets of the training split)")
    p.add_argument("--split", default=defaults.SPLIT, help="TRAIN,VAL,TEST fractions (default %(default)s)")
    p.add_argument("--rows-per-shard", type=int, default=defaults.ROWS_PER_SHARD, help="default %(default)s")
    p.add_argument("--row-group-rows", type=int, default=64,
                   help="rows per Parquet row group: a worker reads whole row groups, so keep it near a task's "
                        "rows; raise it (e.g. 4096) for large shards, where each row group costs metadata")
    p.add_argument("--seed", type=int, default=defaults.SEED, help="seed of the shuffle before splitting (default %(default)s)")
    p.add_argument("--memory-mb", type=int, default=256,
                   help="rows held in memory for the shuffle; a larger source spills to TMPDIR (default 256)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for the source's and the output's store (repeatable; never a credential: "
                        "those come from AWS_* / GOOGLE_APPLICATION_CREDENTIALS)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--outputs", help="also write summary.md (rows, columns, class balance) here")
    p.set_defaults(func=run)


def run(args) -> int:
    from elastic_step.data.prepare import parse_split, prepare_data
    from elastic_step.data.stores import is_local, parse_storage_option, set_storage_options
    from elastic_step.errors import ConfigError

    split = parse_split(args.split)
    features = [f for f in args.features.split(",") if f] if args.features else None
    if args.memory_mb < 1:
        raise ConfigError(f"--memory-mb {args.memory_mb} must be at least 1")
    if args.storage_option:
        options = dict(parse_storage_option(text) for text in args.storage_option)
        remote = [uri for uri in (args.source, args.out) if not uri.startswith("sklearn:") and not is_local(uri)]
        if not remote:
            raise ConfigError("--storage-option applies to an object store, but --source and --out are local; drop it")
        for uri in remote:
            set_storage_options(uri, options)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    manifest = prepare_data(args.source, args.out, label=args.label, features=features, split=split,
                            rows_per_shard=args.rows_per_shard, row_group_rows=args.row_group_rows, seed=args.seed, memory_bytes=args.memory_mb << 20,
                            progress=progress, categorical=args.categorical, buckets=args.buckets)
    if args.outputs:
        from elastic_step.cli.outputs import write_text
        from elastic_step.data.summary import summary_markdown

        write_text(args.outputs, "summary.md", summary_markdown(manifest))
    for spec in manifest.categorical.values():
        print(f"categorical {spec.describe()}")
    counts = ", ".join(f"{name} {manifest.rows(name)}" for name in manifest.splits)
    print(f"prepared {args.source} -> {args.out}: {counts} rows; {len(manifest.features)} features; hash {manifest.content_hash[:12]}")
    return 0
