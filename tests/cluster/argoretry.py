"""Argo's `retryStrategy`, decided as its workflow controller decides it, for the cluster's
Workflow stand-in (workflow.py). Read from argoproj/argo-workflows v3.6 and v4
(workflow/controller/operator.go `processNodeRetries`, `buildRetryStrategyLocalScope`,
pkg/apis/workflow/v1alpha1 `RetryStrategy`, `Backoff`, `ParseStringToDuration`,
util/expr/env `GetFuncMap`, util/humanize `Duration`).

After each attempt (a child node of the retry node), in this order:
1. the attempt Succeeded: the step Succeeded, with the attempt's outputs;
2. `backoff` (if any): past `maxDuration` since the first attempt started: stop, "Max duration
   limit exceeded"; the wait is `duration * factor^(attempts-1)` (`factor` > 0; at most `cap`)
   from the end of the last attempt; a wait ending after the maxDuration deadline: stop, "Backoff
   would exceed max duration limit"; otherwise, while attempts <= `limit`, wait ("Backoff for 30
   seconds") — BEFORE the policy and the expression are looked at;
3. `retryPolicy` (default OnFailure; Always when an `expression` is given): OnFailure retries a
   Failed attempt, OnError an Errored one, Always both; otherwise stop with the attempt's phase and
   message. Failed is the main container's non-zero exit (OOMKilled and SIGKILL included) or a pod
   status message (eviction); Error is the executor's failure (`init`/`wait`: an input or output
   artifact, a missing output), a pod deleted, a pod that never started its containers;
4. `limit` (an int or a string; none: no limit): attempts > limit: stop, "No more retries left";
5. `expression` (expr-lang) over `lastRetry.exitCode` (the main container's exit code as a
   STRING, "-1" when none), `lastRetry.status` ("Failed", "Error"), `lastRetry.duration` (seconds,
   a string), `lastRetry.message`, `retries` (attempts - 1, a string): false: stop,
   "retryStrategy.expression evaluated to false"; an evaluation error is the step's Error.
The step's phase when it stops is the last attempt's.

The expression evaluator is a small one, honest for what it covers and refusing the rest: string,
number and boolean literals, those names, `asInt`/`asFloat`/`int`/`float`, `==` `!=` `<` `<=` `>`
`>=`, `&&` `||` `!` (`and` `or` `not`), parentheses. As in expr-lang, `==` of a string and a number
is false (so `lastRetry.exitCode != 2` is always true: compare with '2' or asInt), ordering them
is an error. OnTransientError (Argo's list of transient errors) and `affinity` are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum


class NodePhase(str, Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    ERROR = "Error"
    SKIPPED = "Skipped"  # a task whose `when` evaluated false (argowhen.py): no pod


class StrategyError(Exception):
    """An invalid or unsupported retryStrategy: the retry node's Error, in Argo's words."""


@dataclass
class Attempt:
    """One child node of the retry node: one pod."""

    name: str
    pod: str
    started: float
    finished: float = 0.0
    phase: NodePhase = NodePhase.PENDING
    message: str = ""
    exit_code: str | None = None
    outputs: dict = field(default_factory=dict)


@dataclass
class Decision:
    retry: bool = False
    wait_until: float | None = None  # back off until then, then decide again
    phase: NodePhase | None = None  # the step's final phase, when it stops
    message: str = ""


# -- durations ------------------------------------------------------------------------------------
GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text) -> float:
    """Seconds of a retry duration: a bare integer is seconds, else Go's time.ParseDuration."""
    text = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return float(int(text))
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    if not text or "".join(n + u for n, u in parts) != text.lstrip("+"):
        raise StrategyError(f'unable to parse {text} as a duration: time: invalid duration "{text}"')
    return sum(float(n) * GO_UNITS[u] for n, u in parts)


def humanize_duration(seconds: float) -> str:
    """util/humanize.Duration: "30 seconds", "1 minute 0 seconds", "2 hours 5 minutes"."""
    def truncated(s: float) -> str:
        for limit, one, many, unit in ((60, "1 second", "{} seconds", 1), (3600, "1 minute", "{} minutes", 60),
                                       (86400, "1 hour", "{} hours", 3600)):
            if s < limit:
                return "0 seconds" if s < 1 else one if s < 2 * unit else many.format(int(s // unit))
        return f"{int(s // 86400)} days"
    if seconds < 60:
        return truncated(seconds)
    if seconds < 3600:
        return f"{truncated(seconds)} {int(seconds % 60)} seconds"
    return f"{truncated(seconds)} {int(seconds // 60 % 60)} minutes"


def go_float(value: float) -> str:
    """fmt.Sprint of a float64, for the usual values: 12.5 -> "12.5", 30.0 -> "30"."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


# -- the decision ---------------------------------------------------------------------------------
def _int_or_string(value, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise StrategyError(f"{what} {value!r} is not an integer") from None


def policy_retries(strategy: dict, phase: NodePhase) -> bool:
    policy = strategy.get("retryPolicy") or ("Always" if strategy.get("expression") else "OnFailure")
    table = {"Always": (True, True), "OnFailure": (True, False), "OnError": (False, True)}
    if policy == "OnTransientError":
        raise StrategyError("retryPolicy OnTransientError is not modelled by this stand-in")
    if policy not in table:
        raise StrategyError(f"{policy} is not a valid RetryPolicy")
    on_failed, on_error = table[policy]
    return on_failed if phase == NodePhase.FAILED else on_error


def _backoff(strategy: dict, attempts: list[Attempt], now: float) -> Decision | None:
    backoff = strategy.get("backoff")
    if not backoff:
        return None
    last, deadline = attempts[-1], None
    if backoff.get("maxDuration"):
        deadline = attempts[0].started + parse_duration(backoff["maxDuration"])
        if now > deadline:
            return Decision(phase=last.phase, message="Max duration limit exceeded")
    if not backoff.get("duration"):
        raise StrategyError("no base duration specified for retryStrategy")
    wait = parse_duration(backoff["duration"])
    factor = _int_or_string(backoff.get("factor"), "backoff.factor")
    if factor is not None and factor > 0:
        wait *= factor ** (len(attempts) - 1)
    if backoff.get("cap"):
        wait = min(wait, parse_duration(backoff["cap"]))
    until = last.finished + wait
    if deadline is not None and until > deadline:
        return Decision(phase=last.phase, message="Backoff would exceed max duration limit")
    limit = _int_or_string(strategy.get("limit"), "limit")
    if now < until and limit is not None and len(attempts) <= limit:
        return Decision(wait_until=until, message=f"Backoff for {humanize_duration(wait)}")
    return None


def decide(strategy: dict, attempts: list[Attempt], now: float) -> Decision:
    """What the controller does after the last attempt ended (processNodeRetries)."""
    last = attempts[-1]
    if last.phase == NodePhase.SUCCEEDED:
        return Decision(phase=NodePhase.SUCCEEDED)
    if strategy.get("affinity"):
        raise StrategyError("retryStrategy.affinity is not modelled by this stand-in (one node)")
    waiting = _backoff(strategy, attempts, now)
    if waiting is not None:
        return waiting
    if not policy_retries(strategy, last.phase):
        return Decision(phase=last.phase, message=last.message)
    limit = _int_or_string(strategy.get("limit"), "limit")
    if limit is not None and len(attempts) > limit:
        return Decision(phase=last.phase, message="No more retries left")
    if strategy.get("expression"):
        if not evaluate_bool(strategy["expression"], retry_scope(attempts)):
            return Decision(phase=last.phase, message="retryStrategy.expression evaluated to false")
    return Decision(retry=True)


def retry_scope(attempts: list[Attempt]) -> dict:
    last = attempts[-1]
    return {"retries": str(len(attempts) - 1),
            "lastRetry": {"exitCode": last.exit_code if last.exit_code is not None else "-1", "status": last.phase.value,
                          "duration": go_float(max(0.0, last.finished - last.started)), "message": last.message}}


def retry_variables(attempts: list[Attempt]) -> dict[str, str]:
    """What a retry's template may use (`{{retries}}`, `{{lastRetry.exitCode}}`...): zeros and
    empty strings before the first attempt, as executeTemplate sets them."""
    variables = {"retries": str(len(attempts)), "lastRetry.exitCode": "0", "lastRetry.duration": "0",
                 "lastRetry.status": "", "lastRetry.message": ""}
    if attempts:
        last = retry_scope(attempts)["lastRetry"]
        variables.update({f"lastRetry.{k}": v for k, v in last.items()})
    return variables


# -- a small expr-lang evaluator ------------------------------------------------------------------
TOKEN = re.compile(r"\s*(?:(?P<number>\d+\.\d*|\.\d+|\d+)|(?P<string>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
                   r"|(?P<op>==|!=|<=|>=|&&|\|\||[<>!().,])|(?P<name>[A-Za-z_][A-Za-z_0-9]*))")
FUNCTIONS = {"asInt": "int", "int": "int", "asFloat": "float", "float": "float"}


class _Parser:
    def __init__(self, text: str, scope: dict):
        self.text, self.scope, self.tokens, position = text, scope, [], 0
        while position < len(text.rstrip()):
            match = TOKEN.match(text, position)
            if not match or match.end() == position:
                raise StrategyError(f"unable to evaluate expression '{text}': unsupported syntax at {text[position:].strip()!r}")
            self.tokens.append((match.lastgroup, match.group(match.lastgroup)))
            position = match.end()
        self.i = 0

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None)

    def take(self, *values):
        kind, value = self.peek()
        if value in values or (kind == "name" and value in values):
            self.i += 1
            return value
        return None

    def fail(self, why: str):
        raise StrategyError(f"unable to evaluate expression '{self.text}': {why}")

    def parse(self):
        value = self.disjunction()
        if self.i != len(self.tokens):
            self.fail(f"unexpected {self.peek()[1]!r}")
        return value

    def disjunction(self):
        value = self.conjunction()
        while self.take("||", "or"):
            right = self.conjunction()
            value = self._bool(value, "||") or self._bool(right, "||")
        return value

    def conjunction(self):
        value = self.negation()
        while self.take("&&", "and"):
            right = self.negation()
            value = self._bool(value, "&&") and self._bool(right, "&&")
        return value

    def negation(self):
        if self.take("!", "not"):
            return not self._bool(self.negation(), "!")
        return self.comparison()

    def comparison(self):
        left = self.primary()
        op = self.take("==", "!=", "<", "<=", ">", ">=")
        if op is None:
            return left
        right = self.primary()
        if op in ("==", "!="):
            same = _equal(left, right)
            return same if op == "==" else not same
        if not (_number(left) and _number(right)) and not (isinstance(left, str) and isinstance(right, str)):
            self.fail(f"invalid operation: {op} (mismatched types {_type(left)} and {_type(right)})")
        return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right}[op]

    def primary(self):
        kind, value = self.peek()
        self.i += 1
        if kind == "number":
            return float(value) if "." in value else int(value)
        if kind == "string":
            return bytes(value[1:-1], "utf-8").decode("unicode_escape")
        if value == "(":
            inner = self.disjunction()
            if not self.take(")"):
                self.fail("missing )")
            return inner
        if kind == "name" and value in ("true", "false"):
            return value == "true"
        if kind == "name" and value in FUNCTIONS and self.take("("):
            argument = self.disjunction()
            if not self.take(")"):
                self.fail(f"{value} takes one argument")
            return _convert(argument, FUNCTIONS[value], self)
        if kind == "name" and value in self.scope:
            current = self.scope[value]
            while self.take("."):
                field_kind, field_name = self.peek()
                self.i += 1
                if field_kind != "name" or not isinstance(current, dict) or field_name not in current:
                    self.fail(f"unknown name {value}.{field_name} (this stand-in knows {sorted(self.scope)})")
                current = current[field_name]
            return current
        self.fail(f"unsupported {value!r} (this stand-in knows {sorted(self.scope)}, {sorted(FUNCTIONS)} and the operators)")

    def _bool(self, value, op: str) -> bool:
        if not isinstance(value, bool):
            self.fail(f"invalid operation: {op} (mismatched types {_type(value)})")
        return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type(value) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float64" if isinstance(value, float) else "string"


def _equal(left, right) -> bool:
    if _number(left) and _number(right):
        return left == right
    return type(left) is type(right) and left == right


def _convert(value, to: str, parser: _Parser):
    try:
        if to == "int":
            return int(value) if _number(value) else int(str(value), 10)
        result = float(value)
        return result if math.isfinite(result) else parser.fail(f"invalid operation: float({value})")
    except (TypeError, ValueError):
        parser.fail(f"invalid operation: {to}({value!r})")


def evaluate_bool(expression: str, scope: dict) -> bool:
    result = _Parser(expression, scope).parse()
    if not isinstance(result, bool):
        raise StrategyError(f"unable to cast expression result '{result}' to bool")
    return result
