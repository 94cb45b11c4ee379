"""The official client's CoreV1Api: in-cluster configuration (the master's service account),
else the user's kubeconfig. Every call gets a request timeout unless it sets its own."""

from __future__ import annotations

import os

from elastic_step.errors import ConfigError

# Where Kubernetes mounts a pod's service account (token, ca.crt, namespace). The variable below
# points elsewhere for a runtime that mounts it at another path.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_ACCOUNT_DIR_ENV = "ELASTIC_STEP_SERVICEACCOUNT_DIR"
# (connect, read) seconds for a plain call; a watch may stay silent for its whole timeoutSeconds.
REQUEST_TIMEOUT = (5.0, 30.0)
WATCH_READ_MARGIN_S = 10.0


def service_account_dir() -> str:
    return os.environ.get(SERVICE_ACCOUNT_DIR_ENV) or SERVICE_ACCOUNT_DIR


def _api_client_class():
    from kubernetes import client

    class TimeoutApiClient(client.ApiClient):
        """An ApiClient whose requests never wait forever: an API server that stalls (or a
        network cut under an open watch) ends the call with an error instead of hanging it."""

        def request(self, method, url, query_params=None, headers=None, post_params=None, body=None,
                    _preload_content=True, _request_timeout=None):
            if _request_timeout is None:
                params = dict(query_params or [])
                if str(params.get("watch")).lower() in ("true", "1"):
                    seconds = float(params.get("timeoutSeconds") or 1800)
                    _request_timeout = (REQUEST_TIMEOUT[0], seconds + WATCH_READ_MARGIN_S)
                else:
                    _request_timeout = REQUEST_TIMEOUT
            elif isinstance(_request_timeout, (int, float)):
                # The client's REST layer applies a number only if it is an int: a float (30.0)
                # would silently mean no timeout at all, and a watch on a cut connection would
                # then hang forever. A (connect, read) pair it takes as it is.
                _request_timeout = (min(REQUEST_TIMEOUT[0], _request_timeout), _request_timeout)
            return super().request(method, url, query_params=query_params, headers=headers, post_params=post_params,
                                   body=body, _preload_content=_preload_content, _request_timeout=_request_timeout)

    return TimeoutApiClient


def load_configuration():
    """The in-cluster configuration (service host/port from the environment, the service
    account's token and CA from its folder), else the kubeconfig's."""
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    folder = service_account_dir()
    try:
        InClusterConfigLoader(token_filename=os.path.join(folder, "token"),
                              cert_filename=os.path.join(folder, "ca.crt")).load_and_set(configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            raise ConfigError(
                "--backend kubernetes: no cluster to talk to (not in a pod with a service account, and no "
                f"usable kubeconfig: {exc}); run the master in the cluster or set KUBECONFIG"
            ) from None
    return configuration


def load_core_api():
    from kubernetes import client

    return client.CoreV1Api(_api_client_class()(load_configuration()))

