"""Where the train task's own pod runs, for a pipeline that puts its workers on special nodes.

train_elastic's `node_selector` and `tolerations` place its worker pods, which the task creates
itself. The task's own pod (the elastic master) is KFP's to create: KFP takes its node selector
and tolerations from the task's kfp-kubernetes settings, fixed when the pipeline is compiled.
`place_task` sets those from the same values, for clusters where the master must run on those
nodes too (most need not: it computes nothing)."""

from __future__ import annotations

from kfp import kubernetes

from elastic_step.backends.kubernetes.options import parse_toleration
from elastic_step.placement import node_selector_items, toleration_items


def place_task(task, node_selector: dict | str | None = None, tolerations: list | str | None = None):
    """Give `task`'s pod a node selector and tolerations (the forms train_elastic takes); returns the task."""
    for item in node_selector_items(node_selector):
        key, _, value = item.partition("=")
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for item in toleration_items(tolerations):
        toleration = parse_toleration(item)  # the fields of a V1Toleration
        kubernetes.add_toleration(task, key=toleration["key"], operator=toleration["operator"],
                                  value=toleration.get("value"), effect=toleration.get("effect"))
    return task
