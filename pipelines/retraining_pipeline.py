from elastic_step.pipelines.lifecycle import lifecycle_pipeline

# A scheduled retrain must never be served from cache: every task runs every time.
retraining_pipeline = lifecycle_pipeline(
    name="elastic-step-retraining",
    description="Scheduled retraining: warm-start from @champion on fresh data, and promote only a better model. Never cached.",
    warm_start_alias="champion",
    caching=False,
)
