"""Server-side apply as the cluster stand-in merges it (cluster/patches.py), on a Pod's spec: the
containers list is a list-map keyed by name, its elements merged field by field; the fields each
manager applied are its own, in FieldsV1."""

from __future__ import annotations

import pytest

from cluster.objects import ApiError
from cluster.patches import server_side_apply


def pod(*containers: dict, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml", **({"labels": labels} if labels else {})},
            "spec": {"containers": list(containers)}}


def test_a_manager_owns_what_it_applies_and_what_it_stops_applying_is_removed():
    first = server_side_apply(None, pod({"name": "main", "image": "a:1"}, {"name": "side", "image": "s:1"}, labels={"app": "x"}),
                              "Pod", "ci", False)
    [entry] = first["metadata"]["managedFields"]
    assert entry["manager"] == "ci" and entry["operation"] == "Apply" and entry["fieldsType"] == "FieldsV1"
    containers = entry["fieldsV1"]["f:spec"]["f:containers"]
    assert set(containers) == {'k:{"name":"main"}', 'k:{"name":"side"}'}
    assert containers['k:{"name":"main"}'] == {".": {}, "f:name": {}, "f:image": {}}
    assert entry["fieldsV1"]["f:metadata"] == {"f:labels": {"f:app": {}}}  # name and namespace are the server's

    # The same manager again without the sidecar and the label: both go; a container's field merges.
    again = server_side_apply(first, pod({"name": "main", "image": "a:2"}), "Pod", "ci", False)
    assert again["spec"]["containers"] == [{"name": "main", "image": "a:2"}]
    assert "labels" not in again["metadata"]


def test_another_managers_field_is_a_conflict_until_forced_and_a_shared_field_stays():
    live = server_side_apply(None, pod({"name": "main", "image": "a:1", "workingDir": "/w"}), "Pod", "ci", False)
    with pytest.raises(ApiError) as clash:
        server_side_apply(live, pod({"name": "main", "image": "b:1"}), "Pod", "hand", False)
    assert clash.value.body["code"] == 409
    assert 'conflict with "ci": .spec.containers[{"name":"main"}].image' in clash.value.body["message"]
    # The same value is no conflict: both own it, and it stays when one stops applying it.
    shared = server_side_apply(live, pod({"name": "main", "workingDir": "/w"}), "Pod", "hand", False)
    shared = server_side_apply(shared, pod({"name": "main", "image": "a:1"}), "Pod", "ci", False)
    assert shared["spec"]["containers"] == [{"name": "main", "image": "a:1", "workingDir": "/w"}]
    # Forced: the field changes hands; the loser no longer owns it.
    forced = server_side_apply(shared, pod({"name": "main", "image": "b:1"}), "Pod", "hand", True)
    assert forced["spec"]["containers"][0]["image"] == "b:1"
    owners = {e["manager"]: e["fieldsV1"] for e in forced["metadata"]["managedFields"]}
    assert "f:image" not in owners["ci"]["f:spec"]["f:containers"]['k:{"name":"main"}']
    assert "f:image" in owners["hand"]["f:spec"]["f:containers"]['k:{"name":"main"}']


def test_an_apply_without_a_field_manager_is_refused():
    with pytest.raises(ApiError) as refused:
        server_side_apply(None, pod({"name": "main", "image": "a:1"}), "Pod", None, False)
    assert refused.value.body["code"] == 400 and "fieldManager" in refused.value.body["message"]
