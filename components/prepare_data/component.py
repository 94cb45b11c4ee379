from kfp import dsl
from kfp.dsl import Dataset, Markdown, Output

from elastic_step.images import default_image


# The defaults below are elastic_step.defaults' (KFP runs this function's source alone in its
# container, so they cannot be imported here; tests/test_defaults.py keeps them equal).
@dsl.component(base_image=default_image(), install_kfp_package=False)
def prepare_data(
    source: str,
    dataset: Output[Dataset],
    summary: Output[Markdown],
    split: str = "0.8,0.1,0.1",
    rows_per_shard: int = 512,
    seed: int = 0,
    label: str = "label",
    features: str = "",
    categorical: str = "",
    buckets: str = "",
):
    """Turn a dataset into a manifest and Parquet shards with train, val and test splits.

    Args:
        source: A bundled dataset (`sklearn:digits`, `sklearn:iris`, ...) or a CSV, Parquet or
            JSONL URI (`file:`, `s3://`, `gs://`, or a path).
        dataset: The prepared data: `manifest.json` (schema, splits, shards with row counts,
            content hash) and Parquet shards.
        summary: Rows per split, columns and class balance, as Markdown.
        split: TRAIN,VAL,TEST fractions.
        rows_per_shard: Rows in each Parquet shard.
        seed: Seed of the shuffle before splitting.
        label: The label column.
        features: Comma-separated feature columns (default: every other column).
        categorical: String or integer columns to turn into ids, `;`-separated:
            `COLUMN=hash:BINS`, `COLUMN=vocab:oov=N:min=F`, a bare `COLUMN`, or `auto`.
            The manifest records each column's hash bins or vocabulary.
        buckets: Numeric columns to bucketize, `;`-separated: `COLUMN=B1,B2,...` or
            `COLUMN=quantiles:N`. The manifest records the boundaries.
    """
    from elastic_step.data.prepare import parse_split, prepare_data as prepare
    from elastic_step.data.summary import summary_markdown

    manifest = prepare(source, dataset.path, label=label, features=[f for f in features.split(",") if f] or None,
                       split=parse_split(split), rows_per_shard=rows_per_shard, seed=seed,
                       categorical=categorical, buckets=buckets)
    for spec in manifest.categorical.values():
        print(f"categorical {spec.describe()}")
    dataset.metadata.update({"content_hash": manifest.content_hash, "rows": {s: manifest.rows(s) for s in manifest.splits}})
    with open(summary.path, "w") as f:
        f.write(summary_markdown(manifest))
