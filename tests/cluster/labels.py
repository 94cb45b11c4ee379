"""Label selectors as the API server parses them (k8s.io/apimachinery/pkg/labels/selector.go).

Terms are comma-separated and ANDed; a comma inside `( )` belongs to a value set:
- `k`, `!k`                      the key exists / does not;
- `k=v`, `k==v`, `k!=v`          equality (`!=` also matches an object without `k`);
- `k in (a,b)`, `k notin (a,b)`  set-based (`notin` also matches an object without `k`);
- `k>N`, `k<N`                   integer comparison, the key required.
An empty selector matches everything. A selector that does not parse is a 400 BadRequest, as the
real server answers `unable to parse requirement`, never an empty match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A qualified key: an optional DNS-subdomain prefix and a name of at most 63 characters.
_KEY = r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_CMP = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|!=|=|>|<)\s*(?P<value>\S*)$")
_EXISTS = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_KEY})$")


class SelectorError(ValueError):
    """The selector does not parse: the server's 400."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, >, <
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present, value = self.key in labels, labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        try:  # > and <: both sides integers, as the real server compares them
            number = int(value) if present else None
        except ValueError:
            return False
        return number is not None and (number > int(self.values[0]) if self.op == ">" else number < int(self.values[0]))


def split_terms(selector: str) -> list[str]:
    """Top-level comma-separated terms (a value set's commas kept inside it)."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    if depth != 0:
        raise SelectorError(f"unable to parse requirement: unbalanced parentheses in {selector!r}")
    terms.append(current.strip())
    return [t for t in terms if t] if selector.strip() else []


def parse_term(term: str) -> Requirement:
    if match := _SET.match(term):
        values = tuple(v.strip() for v in match["values"].split(","))
        if not all(re.fullmatch(_VALUE, v) for v in values) or values == ("",):
            raise SelectorError(f"unable to parse requirement: invalid value set in {term!r}")
        return Requirement(match["key"], match["op"], values)
    if match := _CMP.match(term):
        op, value = match["op"].replace("==", "="), match["value"]
        if op in (">", "<") and not re.fullmatch(r"-?[0-9]+", value):
            raise SelectorError(f"unable to parse requirement: for '{op}', the value must be an integer, not {value!r}")
        if op not in (">", "<") and not re.fullmatch(_VALUE, value):
            raise SelectorError(f"unable to parse requirement: invalid label value {value!r}")
        return Requirement(match["key"], op, (value,))
    if match := _EXISTS.match(term):
        return Requirement(match["key"], "!" if match["neg"] else "exists")
    raise SelectorError(f"unable to parse requirement: {term!r} is not a label selector term")


def parse(selector: str | None) -> list[Requirement]:
    return [parse_term(term) for term in split_terms(selector or "")]


def selector_matches(labels: dict | None, selector: str | None) -> bool:
    """Whether `labels` satisfy `selector` (SelectorError if it does not parse)."""
    labels = labels or {}
    return all(requirement.matches(labels) for requirement in parse(selector))
