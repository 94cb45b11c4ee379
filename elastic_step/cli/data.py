"""`elastic-step prepare-data`: a dataset into a manifest and Parquet shards."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("prepare-data", help="turn a dataset into a manifest and Parquet shards")
    p.add_argument("--source", required=True, help="sklearn:digits, or a CSV/Parquet/JSONL URI (file:, s3://, gs://, path)")
    p.add_argument("--out", required=True, help="output folder (or fsspec URI)")
    p.add_argument("--label", default="label")
    p.add_argument("--features", help="comma-separated feature columns (default: every other column)")
    p.add_argument("--split", default="0.8,0.1,0.1", help="TRAIN,VAL,TEST fractions")
    p.add_argument("--rows-per-shard", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outputs", help="also write summary.md (rows, columns, class balance) here")
    p.set_defaults(func=run)


def run(args) -> int:
    from elastic_step.data.prepare import parse_split, prepare_data

    split = parse_split(args.split)
    features = [f for f in args.features.split(",") if f] if args.features else None
    manifest = prepare_data(args.source, args.out, label=args.label, features=features, split=split,
                            rows_per_shard=args.rows_per_shard, seed=args.seed)
    if args.outputs:
        from elastic_step.cli.outputs import write_text
        from elastic_step.data.summary import summary_markdown

        write_text(args.outputs, "summary.md", summary_markdown(manifest))
    counts = ", ".join(f"{name} {manifest.rows(name)}" for name in manifest.splits)
    print(f"prepared {args.source} -> {args.out}: {counts} rows; {len(manifest.features)} features; hash {manifest.content_hash[:12]}")
    return 0


