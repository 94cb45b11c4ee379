"""What each worker pod of the train step asks for, fixed when the YAML is rendered and passed
to `elastic-step train` as its own flags. None of it is a workflow parameter: a run's parameters
reach only command-line arguments that select training behaviour, never what a pod may request,
where it may be scheduled or which service account it runs as."""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.utils.quantity import parse_quantity

from elastic_step.backends.kubernetes.options import parse_node_selector, parse_toleration
from elastic_step.errors import ConfigError

QUANTITY_EXAMPLES = "e.g. 500m, 2 or 500m:2 for CPU; 512Mi, 4Gi or 2Gi:4Gi for memory"


@dataclass(frozen=True)
class WorkerPods:
    """Worker pods' resources, scheduling and identity (train's --worker-* flags), and a PS run's
    shard pods' resources (--ps-cpu, --ps-memory; train ignores them in allreduce mode). None or empty:
    train's own default (no requests, the cluster's default scheduling and priority,
    deploy/workers' service account)."""

    cpu: str | None = None  # REQUEST or REQUEST:LIMIT
    memory: str | None = None
    gpus: int = 0  # nvidia.com/gpu per worker pod
    node_selector: tuple[str, ...] = ()  # KEY=VALUE each
    tolerations: tuple[str, ...] = ()  # KEY[=VALUE][:EFFECT] each
    service_account: str | None = None
    priority_class: str | None = None
    ps_cpu: str | None = None  # a --mode ps run's shard pods (train's --ps-cpu); None: a worker pod's
    ps_memory: str | None = None

    def validate(self, valid_name) -> None:
        """`valid_name(flag, name)` checks a Kubernetes object name; raises ConfigError naming the flag."""
        for flag, value in (("--worker-cpu", self.cpu), ("--worker-memory", self.memory),
                            ("--ps-cpu", self.ps_cpu), ("--ps-memory", self.ps_memory)):
            if value is not None:
                check_request_limit(flag, str(value))
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ConfigError(f"--worker-gpus {self.gpus!r} must be a whole number, 0 or more")
        for flag, train_flag, items, parse in (
                ("--worker-node-selector", "--node-selector", self.node_selector, lambda v: parse_node_selector([v])),
                ("--worker-toleration", "--toleration", self.tolerations, parse_toleration)):
            for item in items:
                try:
                    parse(item)
                except ConfigError as exc:  # the parser names train's flag; name the one given here
                    raise ConfigError(str(exc).replace(train_flag, flag, 1)) from None
        if self.service_account is not None:
            valid_name("--worker-service-account", self.service_account)
        if self.priority_class is not None:
            valid_name("--priority-class", self.priority_class)

    def train_args(self) -> list[str]:
        """`elastic-step train`'s flags for these settings (nothing for a default)."""
        args: list[str] = []
        for flag, value in (("--worker-cpu", self.cpu), ("--worker-memory", self.memory),
                            ("--ps-cpu", self.ps_cpu), ("--ps-memory", self.ps_memory),
                            ("--service-account", self.service_account), ("--priority-class", self.priority_class)):
            if value is not None:
                args += [flag, str(value)]
        if self.gpus:
            args += ["--worker-gpus", str(self.gpus)]
        for item in self.node_selector:
            args += ["--node-selector", item]
        for item in self.tolerations:
            args += ["--toleration", item]
        return args


def check_request_limit(flag: str, value: str) -> None:
    """REQUEST or REQUEST:LIMIT of positive Kubernetes quantities, the request not above the limit."""
    from elastic_step.argo.documents import QUANTITY  # here: documents imports this module


    request, colon, limit = value.partition(":")
    for part in (request, limit) if colon else (request,):
        if not QUANTITY.match(part) or float(parse_quantity(part)) <= 0:
            raise ConfigError(f"{flag} {value!r} is not a positive Kubernetes quantity, or REQUEST:LIMIT of two "
                              f"({QUANTITY_EXAMPLES})")
    if colon and parse_quantity(request) > parse_quantity(limit):
        raise ConfigError(f"{flag} {value!r}: the request {request} is larger than the limit {limit}")
