"""Ready KFP v2 pipelines built from elastic_step.components; compiled to pipelines/compiled/ by
`make compile` (python -m elastic_step.pipelines.compile)."""
