"""`elastic-step submit`: a training job sent to a cluster from a laptop, as `elasticdl train` and
`arena submit` do. The job is one pod, its master (the same `elastic-step train --backend
kubernetes` the pipelines run), which then creates its worker pods itself.

- `spec.py`   the objects a submission makes (the master pod, the model definition's ConfigMap)
- `checks.py` what must hold before anything is created (each a one-line refusal, exit 2)
- `apply.py`  creating them, and `delete`: everything carrying the job's label
"""
