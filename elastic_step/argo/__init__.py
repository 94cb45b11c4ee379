"""Native Argo Workflows YAML for the training and retraining pipelines, built with Hera.

`steps` holds the container templates (one per CLI pipeline step) and where their files live;
`documents` assembles them into a WorkflowTemplate per pipeline, a Workflow that references it,
and a CronWorkflow for retraining; `render` writes them as YAML.
"""

from elastic_step.argo.documents import PIPELINES, RenderOptions, build_documents
from elastic_step.argo.render import render

__all__ = ["PIPELINES", "RenderOptions", "build_documents", "render"]
