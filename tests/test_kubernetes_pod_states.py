"""The pod state table, driven with the client's own models: each way a worker pod can end
(or fail to start) and what the master is told to do about it."""

from kubernetes import client as k8s

from elastic_step.backends.kubernetes.pod_states import is_stuck_waiting, judge, read_facts


def pod(phase="Running", *, terminated=None, waiting=None, conditions=None, reason=None, deleting=False, memory="1Gi"):
    state = k8s.V1ContainerState(
        terminated=k8s.V1ContainerStateTerminated(exit_code=terminated[0], reason=terminated[1]) if terminated else None,
        waiting=k8s.V1ContainerStateWaiting(reason=waiting[0], message=waiting[1]) if waiting else None,
        running=k8s.V1ContainerStateRunning() if phase == "Running" and not terminated else None,
    )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="job-abc-w1-1", deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(
            name="worker", image="registry.example/elastic-step-torch:0.1.0",
            resources=k8s.V1ResourceRequirements(limits={"memory": memory}, requests={"memory": memory}))]),
        status=k8s.V1PodStatus(
            phase=phase, reason=reason, message="The node was low on resource: memory." if reason == "Evicted" else None,
            conditions=[k8s.V1PodCondition(type=t, status=s, reason=r, message=m) for t, s, r, m in conditions or []],
            container_statuses=[k8s.V1ContainerStatus(name="worker", image="img", image_id="", ready=False, restart_count=0, state=state)],
        ),
    )


def verdict_of(p, deleted=False, we_deleted=False, pending_s=0.0, timeout=300.0):
    return judge(read_facts(p, deleted=deleted, we_deleted=we_deleted, pending_s=pending_s, pending_timeout_s=timeout))


def test_oom_killed_is_never_relaunched_and_names_the_pod_and_its_limit():
    row, v = verdict_of(pod("Failed", terminated=(137, "OOMKilled"), memory="512Mi"))
    assert row == "out of memory" and v.state == "gone" and v.relaunch == "never"
    assert "job-abc-w1-1" in v.reason and "OOMKilled" in v.reason and "512Mi" in v.reason and v.returncode == 137


def test_preempted_pod_is_relaunched_for_free_even_though_it_was_killed():
    p = pod("Failed", terminated=(137, "Error"), conditions=[("DisruptionTarget", "True", "PreemptionByScheduler", "")], deleting=True)
    row, v = verdict_of(p)
    assert (row, v.relaunch) == ("preempted", "free") and "preempted" in v.reason


def test_evicted_pod_is_relaunched_for_free_with_the_kubelets_message():
    row, v = verdict_of(pod("Failed", reason="Evicted"))
    assert (row, v.relaunch) == ("evicted", "free") and "low on resource" in v.reason
    row, v = verdict_of(pod("Failed", terminated=(143, "Error"), conditions=[("DisruptionTarget", "True", "EvictionByEvictionAPI", "")]))
    assert (row, v.relaunch) == ("evicted", "free")


def test_node_lost_is_free():
    assert verdict_of(pod("Failed", reason="NodeLost"))[1].relaunch == "free"


def test_deleted_by_someone_else_is_free_once_its_container_ended_deleted_by_the_master_counts():
    running = pod("Running")
    row, v = verdict_of(running, deleted=True)
    assert (row, v.relaunch) == ("deleted by someone else", "free")
    # A graceful delete's first event: the worker got SIGTERM and may still be leaving, so it is
    # not gone yet (and the pod is left to its grace period).
    row, v = verdict_of(pod("Running", deleting=True))
    assert (row, v.state) == ("being deleted by someone else", "stopping")
    # Its container ended: the worker left on SIGTERM, a departure relaunched for free.
    row, v = verdict_of(pod("Failed", terminated=(143, "Error"), deleting=True))
    assert (row, v.state, v.relaunch, v.left) == ("deleted by someone else", "gone", "free", True)
    row, v = verdict_of(pod("Failed", terminated=(137, "Error"), deleting=True))  # SIGKILLed at the grace's end
    assert (row, v.state, v.relaunch, v.left) == ("deleted by someone else", "gone", "free", False)
    row, v = verdict_of(running, deleted=True, we_deleted=True)
    assert (row, v.relaunch) == ("stopped by the master", "count")
    row, v = verdict_of(pod("Running", deleting=True), we_deleted=True)  # the master's own delete: gone at once
    assert (row, v.relaunch) == ("stopped by the master", "count")


def test_a_failed_worker_counts_against_the_limit_with_its_exit_code():
    row, v = verdict_of(pod("Failed", terminated=(1, "Error")))
    assert (row, v.relaunch, v.returncode) == ("failed", "count", 1) and "exited with code 1" in v.reason
    row, v = verdict_of(pod("Failed", terminated=(137, "Error")))
    assert "SIGKILL" in v.reason


def test_a_finished_worker_exits_zero():
    row, v = verdict_of(pod("Succeeded", terminated=(0, "Completed")))
    assert (row, v.state, v.returncode) == ("finished", "gone", 0)


def test_image_pull_errors_wait_for_the_timeout_then_end_the_worker_naming_pod_and_cause():
    backoff = pod("Pending", waiting=("ImagePullBackOff", 'Back-off pulling image "nope:1"'))
    assert verdict_of(backoff, pending_s=10, timeout=120)[1].state == "starting"
    row, v = verdict_of(backoff, pending_s=121, timeout=120)
    assert (row, v.state, v.relaunch) == ("image cannot be pulled", "gone", "never")
    assert "job-abc-w1-1" in v.reason and "ImagePullBackOff" in v.reason and "--image" in v.reason
    row, v = verdict_of(pod("Pending", waiting=("ErrImagePull", "not found")), pending_s=121, timeout=120)
    assert row == "image cannot be pulled"


def test_an_invalid_image_name_fails_at_once():
    row, v = verdict_of(pod("Pending", waiting=("InvalidImageName", "bad")))
    assert (row, v.relaunch) == ("invalid image", "never")


def test_a_pod_waiting_for_capacity_waits_and_one_no_node_can_take_is_refused_after_the_timeout():
    waiting = pod("Pending", conditions=[("PodScheduled", "False", "Unschedulable",
                                          "0/3 nodes are available: 3 Insufficient cpu. preemption: 0/3 nodes are available: "
                                          "3 No preemption victims found for incoming pod.")])
    waiting.status.container_statuses = None
    assert verdict_of(waiting, pending_s=100_000)[1].state == "starting"  # capacity may come back: no clock
    assert not is_stuck_waiting(read_facts(waiting, deleted=False, we_deleted=False))
    never = pod("Pending", conditions=[("PodScheduled", "False", "Unschedulable",
                                        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
                                        "available: 3 Preemption is not helpful for scheduling.")])
    never.status.container_statuses = None
    assert is_stuck_waiting(read_facts(never, deleted=False, we_deleted=False))
    assert verdict_of(never, pending_s=299)[1].state == "starting"
    row, v = verdict_of(never, pending_s=301)
    assert (row, v.relaunch) == ("cannot be scheduled", "never") and "Insufficient nvidia.com/gpu" in v.reason
    assert "\n" not in v.reason  # one line, as `get` shows it


def test_running_and_starting():
    assert verdict_of(pod("Running"))[1].state == "running"
    plain = pod("Pending", waiting=("ContainerCreating", ""))
    assert verdict_of(plain, pending_s=10_000)[1].state == "starting"  # not stuck: only slow


def test_a_worker_that_left_on_sigterm_is_relaunched_for_free_unless_the_master_deleted_it():
    row, v = verdict_of(pod("Failed", terminated=(143, "Error")))  # a kill in the pod, no other cause
    assert (row, v.relaunch, v.left) == ("left on SIGTERM", "free", True) and "SIGTERM" in v.reason
    # The master deleted it (a hung worker dropped): the worker's failure, charged to its slot.
    row, v = verdict_of(pod("Failed", terminated=(143, "Error"), deleting=True), we_deleted=True)
    assert (row, v.relaunch, v.left) == ("stopped by the master", "count", False)
    row, v = verdict_of(pod("Failed", terminated=(1, "Error")))
    assert (row, v.relaunch, v.left) == ("failed", "count", False)
