"""The official client's CoreV1Api: in-cluster configuration (the master's service account),
else the user's kubeconfig."""

from __future__ import annotations

from elastic_step.errors import ConfigError


def load_core_api():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise ConfigError(
                "--backend kubernetes: no cluster to talk to (not in a pod with a service account, and no "
                f"usable kubeconfig: {exc}); run the master in the cluster or set KUBECONFIG"
            ) from None
    return client.CoreV1Api()
