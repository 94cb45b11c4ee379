from elastic_step.pipelines.lifecycle import lifecycle_pipeline

training_pipeline = lifecycle_pipeline(
    name="elastic-step-training",
    description="Prepare data, train elastically, evaluate against the champion, and export and promote a better model.",
    warm_start_alias="",
    caching=True,
)
