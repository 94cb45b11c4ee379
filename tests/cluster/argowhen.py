"""A DAG task's or step's `when`, decided as Argo's workflow controller decides it (v3.6:
workflow/controller/dag.go and steps.go `shouldExecute`, over govaluate v3). The expression is
evaluated AFTER every `{{...}}` in it is substituted (the run's parameters, earlier tasks'
outputs), as text: a task's output `false` is the boolean literal `false`, and the template has to
quote what may be empty or hold spaces (`'{{workflow.parameters.x}}' != ''`).

govaluate as Argo calls it, for what is modelled here:
- literals: numbers (float64), `true` and `false`, strings in single or double quotes; a bare word
  (govaluate's variable) is turned into the string it spells, so `Succeeded == Succeeded` is true;
- `==` and `!=` compare value and type alike (Go's reflect.DeepEqual): `true == 'true'` is false,
  `1 == 1.0` is true;
- `<` `<=` `>` `>=` take two numbers or two strings; `&&` `||` `!` take booleans only; parentheses;
  precedence `!`, then the comparisons, then `&&`, then `||`;
- a result that is not a boolean, a value of the wrong type for its operator, or a token that is
  none of these: an error, which makes the node Error (`Invalid 'when' expression ...`).
Not modelled (refused as an error, never guessed): arithmetic, `=~`, `in`, `?:`, `??`, dates.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"""\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<string>'[^']*'|"[^"]*")|(?P<op>==|!=|<=|>=|&&|\|\||[<>!()])"""
                   r"""|(?P<word>[A-Za-z_][\w.]*))""")
COMPARISONS = {"==", "!=", "<", "<=", ">", ">="}


def shown(value) -> str:
    """A value as Go's %v prints it (a whole float64 without its `.0`, booleans in lower case)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class WhenError(Exception):
    """The `when` cannot be evaluated: Argo makes the task's node Error with this message."""


def tokens(when: str) -> list[tuple[str, object]]:
    found, at = [], 0
    while at < len(when.rstrip()):
        match = TOKEN.match(when, at)
        if not match:
            raise WhenError(f"Invalid 'when' expression '{when}': Invalid token: '{when[at:].strip()}' "
                            '(hint: try wrapping the affected expression in quotes ("))')
        at = match.end()
        kind = match.lastgroup
        text = match.group(kind)
        if kind == "number":
            found.append(("value", float(text)))
        elif kind == "string":
            found.append(("value", text[1:-1]))
        elif kind == "word":  # govaluate's VARIABLE, which Argo turns into a STRING
            found.append(("value", {"true": True, "false": False}.get(text, text)))
        else:
            found.append(("op", text))
    return found


class Parser:
    def __init__(self, when: str):
        self.when, self.tokens, self.at = when, tokens(when), 0

    def peek(self) -> tuple[str, object] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, object]:
        token = self.peek()
        if token is None:
            raise WhenError(f"Invalid 'when' expression '{self.when}': Unexpected end of expression")
        self.at += 1
        return token

    def logical(self, operator: str, lower) -> object:
        value = lower()
        while self.peek() == ("op", operator):
            self.take()
            right = lower()
            for side in (value, right):
                if not isinstance(side, bool):
                    raise WhenError(f"Failed to evaluate 'when' expression '{self.when}': Value '{shown(side)}' cannot be used "
                                    f"with the logical operator '{operator}', it is not a bool")
            value = (value and right) if operator == "&&" else (value or right)
        return value

    def disjunction(self) -> object:
        return self.logical("||", self.conjunction)

    def conjunction(self) -> object:
        return self.logical("&&", self.comparison)

    def comparison(self) -> object:
        left = self.unary()
        while self.peek() is not None and self.peek()[0] == "op" and self.peek()[1] in COMPARISONS:
            operator = self.take()[1]
            left = compare(operator, left, self.unary(), self.when)
        return left

    def unary(self) -> object:
        kind, value = self.take()
        if (kind, value) == ("op", "!"):
            operand = self.unary()
            if not isinstance(operand, bool):
                raise WhenError(f"Failed to evaluate 'when' expression '{self.when}': Value '{shown(operand)}' cannot be used "
                                "with the prefix '!', it is not a bool")
            return not operand
        if (kind, value) == ("op", "("):
            inner = self.disjunction()
            if self.take() != ("op", ")"):
                raise WhenError(f"Invalid 'when' expression '{self.when}': Unbalanced parenthesis")
            return inner
        if kind == "op":
            raise WhenError(f"Invalid 'when' expression '{self.when}': Cannot transition token types from "
                            f"operator [{value}] here")
        return value


def compare(operator: str, left, right, when: str) -> bool:
    if operator in ("==", "!="):
        same = type(left) is type(right) and left == right  # reflect.DeepEqual: no conversion
        return same if operator == "==" else not same
    numbers = all(isinstance(v, float) for v in (left, right))
    if not numbers and not all(isinstance(v, str) for v in (left, right)):
        raise WhenError(f"Failed to evaluate 'when' expression '{when}': '{shown(left)}' {operator} '{shown(right)}' "
                        "compares neither two numbers nor two strings")
    return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right}[operator]


def should_execute(when: str) -> bool:
    """Whether a task whose `when` (substituted) is `when` runs; '' always runs."""
    if not when.strip():
        return True
    parser = Parser(when)
    result = parser.disjunction()
    if parser.peek() is not None:
        raise WhenError(f"Invalid 'when' expression '{when}': Cannot transition token types at "
                        f"'{parser.peek()[1]}'")
    if not isinstance(result, bool):
        raise WhenError(f"Expected boolean evaluation for '{when}'. Got {shown(result)}")
    return result
