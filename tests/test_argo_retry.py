"""The cluster's Argo controller stand-in decides a retryStrategy as Argo's controller does
(tests/cluster/argoretry.py, from workflow/controller/operator.go processNodeRetries): the order
of backoff, policy, limit and expression, what counts as a failure or an error, the expression's
variables as strings, and an evaluator that refuses what it does not cover. Pod-level behaviour
(which pod failures are Failed and which Error) is in tests/test_cluster_argo_workflow.py."""

from __future__ import annotations

import pytest

from cluster.argoretry import (Attempt, NodePhase, StrategyError, decide, evaluate_bool, humanize_duration, parse_duration,
                               retry_scope, retry_variables)


def attempts(*ended: tuple[NodePhase, str | None], started: float = 1000.0, each: float = 10.0) -> list[Attempt]:
    """Attempts that ran one after the other, `each` seconds long, with their phase and exit code."""
    out = []
    for i, (phase, code) in enumerate(ended):
        begin = started + i * each
        out.append(Attempt(f"wf.s({i})", f"pod-{i}", begin, begin + each, phase, f"main: Error (exit code {code})", code))
    return out


FAILED = (NodePhase.FAILED, "1")
ERRORED = (NodePhase.ERROR, None)


@pytest.mark.parametrize("policy, phase, retried", [
    ("OnFailure", NodePhase.FAILED, True), ("OnFailure", NodePhase.ERROR, False),
    ("OnError", NodePhase.FAILED, False), ("OnError", NodePhase.ERROR, True),
    ("Always", NodePhase.FAILED, True), ("Always", NodePhase.ERROR, True),
    (None, NodePhase.FAILED, True), (None, NodePhase.ERROR, False),  # the default is OnFailure
])
def test_the_retry_policy_retries_failures_errors_or_both(policy, phase, retried):
    strategy = {"limit": 3, **({"retryPolicy": policy} if policy else {})}
    decision = decide(strategy, attempts((phase, "1")), now=2000)
    assert decision.retry is retried
    if not retried:  # the step ends as its attempt did, with its message
        assert decision.phase == phase and decision.message == "main: Error (exit code 1)"


def test_an_expression_makes_the_default_policy_always():
    assert decide({"limit": 1, "expression": "true"}, attempts(ERRORED), now=2000).retry


def test_the_limit_counts_retries_not_attempts_and_no_limit_is_unbounded():
    assert decide({"limit": 2}, attempts(FAILED, FAILED), now=2000).retry  # the original and one retry: one more
    stop = decide({"limit": "2"}, attempts(FAILED, FAILED, FAILED), now=2000)  # limit may be a string (IntOrString)
    assert not stop.retry and stop.phase == NodePhase.FAILED and stop.message == "No more retries left"
    assert decide({}, attempts(*[FAILED] * 50), now=5000).retry


def test_a_succeeded_attempt_ends_the_step():
    decision = decide({"limit": 3}, attempts(FAILED, (NodePhase.SUCCEEDED, "0")), now=2000)
    assert decision.phase == NodePhase.SUCCEEDED and not decision.retry


def test_the_expression_sees_the_last_attempt_as_strings():
    last = attempts(FAILED, (NodePhase.FAILED, "137"), each=12.5)
    scope = retry_scope(last)
    assert scope == {"retries": "1", "lastRetry": {"exitCode": "137", "status": "Failed", "duration": "12.5",
                                                   "message": "main: Error (exit code 137)"}}
    shipped = "lastRetry.exitCode != '2'"  # the shipped train step's
    assert evaluate_bool(shipped, scope)
    assert not evaluate_bool(shipped, retry_scope(attempts((NodePhase.FAILED, "2"))))
    # expr-lang: a string never equals a number, so this one is always true (the usual mistake)
    assert evaluate_bool("lastRetry.exitCode != 137", scope)
    assert evaluate_bool("asInt(lastRetry.exitCode) == 137 && lastRetry.status == 'Failed'", scope)
    assert evaluate_bool("asFloat(lastRetry.duration) > 10 and not (retries == '0')", scope)
    assert evaluate_bool("lastRetry.status == \"Error\" || asInt(lastRetry.exitCode) >= 128", scope)
    assert retry_scope(attempts(ERRORED))["lastRetry"]["exitCode"] == "-1"  # no exit code: "-1"


def test_an_expression_that_is_false_or_fails_stops_the_step():
    stop = decide({"limit": 3, "expression": "lastRetry.exitCode != '2'"}, attempts((NodePhase.FAILED, "2")), now=2000)
    assert stop.phase == NodePhase.FAILED and stop.message == "retryStrategy.expression evaluated to false"
    for bad, why in [("lastRetry.exitCode > 2", "mismatched types string and int"),
                     ("asInt(lastRetry.message) == 1", "invalid operation: int"),
                     ("lastRetry.exitcode == '1'", "unknown name lastRetry.exitcode"),
                     ("lastRetry.exitCode in ['1', '2']", "unsupported"),
                     ("sprig.trim(lastRetry.message) == ''", "unsupported"),
                     ("lastRetry.exitCode", "to bool")]:
        with pytest.raises(StrategyError, match=why):
            decide({"limit": 3, "expression": bad}, attempts(FAILED), now=2000)


def test_backoff_waits_duration_times_factor_to_the_attempts_before_policy_and_expression():
    strategy = {"limit": 5, "expression": "false", "backoff": {"duration": "30s", "factor": 2, "maxDuration": "1h"}}
    one, two = attempts(FAILED), attempts(FAILED, FAILED)
    first = decide(strategy, one, now=one[-1].finished + 1)
    assert first.wait_until == one[-1].finished + 30 and first.message == "Backoff for 30 seconds"
    assert decide(strategy, two, now=two[-1].finished).wait_until == two[-1].finished + 60  # 30 s x 2^1
    # only once the wait is over do the policy and the expression have their say
    after = decide(strategy, one, now=one[-1].finished + 30)
    assert after.message == "retryStrategy.expression evaluated to false"


def test_backoff_bounds_cap_and_max_duration():
    capped = {"limit": 9, "backoff": {"duration": "10", "factor": "3", "cap": "1m"}}
    four = attempts(FAILED, FAILED, FAILED, FAILED)
    assert decide(capped, four, now=four[-1].finished).wait_until == four[-1].finished + 60  # 10 x 27, capped
    late = {"limit": 9, "backoff": {"duration": "1m", "factor": 2, "maxDuration": "2m"}}
    run = attempts(FAILED, FAILED, each=50)  # the next wait (2 min) would end past the first start + 2 min
    assert decide(late, run, now=run[-1].finished).message == "Backoff would exceed max duration limit"
    assert decide(late, run, now=run[0].started + 121).message == "Max duration limit exceeded"
    with pytest.raises(StrategyError, match="no base duration"):
        decide({"limit": 1, "backoff": {"factor": 2}}, attempts(FAILED), now=2000)


def test_durations_and_messages_as_argo_writes_them():
    assert [parse_duration(t) for t in ("30", "30s", "1m30s", "1.5h", "250ms")] == [30, 30, 90, 5400, 0.25]
    with pytest.raises(StrategyError, match="unable to parse 30 sec"):
        parse_duration("30 sec")
    assert [humanize_duration(s) for s in (0.5, 1, 30, 60, 90, 3600, 3725)] == [
        "0 seconds", "1 second", "30 seconds", "1 minute 0 seconds", "1 minute 30 seconds", "1 hour 0 minutes", "1 hour 2 minutes"]


def test_what_is_not_modelled_is_refused():
    with pytest.raises(StrategyError, match="OnTransientError is not modelled"):
        decide({"retryPolicy": "OnTransientError"}, attempts(FAILED), now=2000)
    with pytest.raises(StrategyError, match="Sometimes is not a valid RetryPolicy"):
        decide({"retryPolicy": "Sometimes"}, attempts(FAILED), now=2000)


def test_a_retry_template_gets_its_attempt_number_and_the_last_attempt():
    assert retry_variables([]) == {"retries": "0", "lastRetry.exitCode": "0", "lastRetry.duration": "0",
                                   "lastRetry.status": "", "lastRetry.message": ""}
    assert retry_variables(attempts(FAILED))["retries"] == "1" and retry_variables(attempts(FAILED))["lastRetry.exitCode"] == "1"
