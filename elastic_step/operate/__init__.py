"""Operating a running job from outside it: `get`, `list`, `top`, `logs`, `stop`, `scale` and
`ui` read and steer a job through what its master publishes (its job folder and API locally,
its status ConfigMap and pods on Kubernetes), checked against the protocol's models as read."""
