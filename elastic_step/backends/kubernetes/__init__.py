"""Workers as Kubernetes pods, created and supervised by the master through the official client.

options.py    the backend's settings (from TrainConfig) and who the master pod is
manifests.py  the worker V1Pod, the token V1Secret and the job's V1NetworkPolicies
pod_states.py the declarative table: what a pod's status means for its worker
watch.py      list + watch with resourceVersion resume, re-list on 410 Gone
backend.py    KubernetesBackend: launch, poll, stop, shutdown
calls.py      the backend's own thread for pod create/delete (never under the master's lock)
client.py     in-cluster config, else kubeconfig
rights.py     every call the backend makes and the RBAC right it needs: one table
preflight.py  before anything is created: those rights asked of the API server, KFP's launcher's Secret
"""
