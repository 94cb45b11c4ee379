"""Every default a user meets, in one place.

`TrainConfig`, the `train` and `prepare-data` commands, the KFP components, both KFP pipelines and
the Argo workflow parameters take their defaults from here, so a job started from any of them
behaves the same when nothing is set. tests/test_defaults.py fails when a surface says otherwise.

One surface cannot import this module: a KFP component's signature. KFP runs the component
function's own source, alone, in its container, so its defaults are written out there; the same
test pins them to these values.
"""

from __future__ import annotations

# -- a training job ---------------------------------------------------------------------------------
WORKERS = "2:3"  # MIN:MAX: start MAX workers, train while at least MIN are live
EPOCHS = 5
MINIBATCH_SIZE = 32  # rows per minibatch per worker
MINIBATCHES_PER_TASK = 4  # a task the master hands out is this many minibatches
# Off by default: with a fixed group it changes nothing, and with an elastic group the per-worker
# batch is what torchrun and DDP users expect. Set it when results must not depend on failures.
GLOBAL_BATCH_SIZE = 0
LR_SCALING = "none"  # the model definition's learning rate, whatever the group's size
DEVICE = "auto"  # each worker on its GPU where it sees one, else the CPU (frameworks/device.py)
PRECISION = "fp32"
MODE = "allreduce"  # every worker holds the model; "ps": embedding tables on parameter-server shards
PS_SHARDS = 2  # with --mode ps: shard processes holding the tables
# With --mode ps: the tables' ids and weights the master holds whole at the job's end (its test
# evaluation, the logged model); beyond it the model is served from the shards' snapshots.
PS_TABLE_LIMIT_MB = 2048
SPARES = 0  # warm spare workers beyond the group's MAX
SEED = 0  # the model's initialisation and the per-epoch shuffle (and prepare-data's split)
BACKEND = "local"  # local processes; "kubernetes": pods
HOST = "127.0.0.1"  # where the master's API listens
PORT = 0  # 0: a free port
CHECKPOINT_STEPS = 100  # and at each epoch end; 0: never
KEEP_CHECKPOINTS = 3
EXPERIMENT = "elastic-step"  # the MLflow experiment
MAX_RELAUNCHES = 3  # per worker slot
# Relaunches after a departure (SIGTERM: an eviction, a preemption) are not charged against
# MAX_RELAUNCHES, up to this many per slot; after that they are, so a slot whose worker is
# SIGTERMed in a loop ends like one that crashes in a loop instead of relaunching forever.
MAX_FREE_RELAUNCHES = 25
MAX_TASK_FAILURES = 3  # a task that fails this often fails the job

# -- clocks, in seconds -----------------------------------------------------------------------------
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0  # silence before a worker counts as hung
# ... before a worker that has not yet called in to a round does: it may be importing its
# framework, and TensorFlow's import holds the GIL for seconds on a busy node, so the worker's
# heartbeat thread cannot run; dropping it then only costs a relaunch and the same import again.
WARM_UP_SILENCE_S = 60.0
RENDEZVOUS_TIMEOUT_S = 60.0
STARTUP_GRACE_S = 60.0  # the first round waits this long for all MAX workers, then starts with MIN
COLLECTIVE_TIMEOUT_S = 30.0
MASTER_TIMEOUT_S = 30.0  # a worker whose master does not answer this long exits
PENDING_TIMEOUT_S = 300.0  # a pod unschedulable (or its image not pulled) this long fails
# SIGTERM to SIGKILL, one setting for both ends: every pod the project makes asks Kubernetes for this
# terminationGracePeriodSeconds (worker pods, the Argo steps), and a master that gets SIGTERM spends
# it: a checkpoint of its next step within the first half, MLflow's flush and the exit in the rest.
# Kubernetes' own default, so a pod whose spec the project cannot set (a KFP task's) gives the
# master the same. `train --termination-grace` for a master whose pod asks for more.
TERMINATION_GRACE_S = 30

# -- prepare-data -----------------------------------------------------------------------------------
LABEL = "label"
SPLIT = "0.8,0.1,0.1"  # TRAIN,VAL,TEST fractions
ROWS_PER_SHARD = 512

# -- the bundled example the ready pipelines run when nothing is set ----------------------------------
SOURCE = "sklearn:digits"
MODEL_DEF = "elastic_step.model_zoo.digits_torch"
REGISTERED_MODEL = "digits"
FLOORS = {"accuracy": 0.9}  # the gate: a candidate must reach these
MIN_GAINS = {"accuracy": 0.0}  # ... and beat the champion by these

# -- on a cluster: where deploy/ puts things --------------------------------------------------------
# Jobs and MLflow live in namespaces of their own: the rights a job's master or an operator holds
# in the jobs' namespace (pods, Secrets, ConfigMaps, NetworkPolicies) reach nothing of MLflow's
# (its auth settings, its admin Secret, its NetworkPolicy).
# Every shipped default that names a cluster address (the docs' `mlflow-credentials` Secret, the
# examples) is this one; tests/test_shipped_hosts.py holds it to deploy/ and fails on
# any other MLflow host in a shipped file.
DEPLOY_NAMESPACE = "ml"  # the jobs': deploy/kustomization.yaml's `namespace:`
MLFLOW_NAMESPACE = "mlflow"  # deploy/mlflow/kustomization.yaml's `namespace:`
MLFLOW_SERVICE_URI = f"http://mlflow.{MLFLOW_NAMESPACE}.svc.cluster.local:5000"  # deploy/mlflow's Service
# The Secret, in the jobs' namespace, that the shipped pipelines (KFP's compiled ones and the Argo
# templates) take MLflow's `uri`, `username` and `password` from (docs/kubernetes.md makes it).
MLFLOW_CREDENTIALS_SECRET = "mlflow-credentials"
# deploy/mlflow's NetworkPolicy admits pods that carry MLFLOW_CLIENT_LABEL (the pipelines' step pods,
# whose master or step code calls MLflow; never worker pods, which do not) in namespaces that carry
# JOBS_NAMESPACE_LABEL (deploy/'s own; label a KFP namespace that runs jobs yourself).
MLFLOW_CLIENT_LABEL = ("elastic-step/mlflow-client", "true")
# On the train step's pod (KFP and Argo): in a Kubeflow profile namespace Istio injects its proxy
# there, and the mesh's STRICT mTLS would refuse the worker pods, which stay out of the mesh (gloo's
# peer-to-peer ports cannot pass Envoy), at the master's API and rendezvous ports, both chosen when it
# starts. So no inbound port goes through the proxy: the master's own NetworkPolicy (its workers
# only) and its per-job token guard them, and the step's own calls (MLflow) still go out through the
# proxy. Outside a mesh the annotation means nothing.
ISTIO_MASTER_INBOUND = ("traffic.sidecar.istio.io/includeInboundPorts", "")
JOBS_NAMESPACE_LABEL = ("elastic-step/jobs", "true")


# -- logs -------------------------------------------------------------------------------------------
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # each line a job logs: its console, master.log

def metric_pairs(metrics: dict) -> str:
    """`{"accuracy": 0.9}` → `accuracy=0.9`, as `--floor` and `--min-gain` take them."""
    return ",".join(f"{name}={value}" for name, value in metrics.items())
