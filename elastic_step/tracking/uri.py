"""Tracking URIs without their secrets: `http://user:pass@host` may be how a user reaches MLflow,
but the password belongs in no parameter, log line, error message, result file or metadata."""

from __future__ import annotations

import os
import re

# A URI in any text: its scheme, then everything up to whitespace, a quote or an angle bracket.
_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>]+)")
# A query parameter, and the names of those that hold a secret (password=, token=, X-Amz-Signature=).
_PARAM = re.compile(r"(?P<lead>[?&;])(?P<key>[^=&;#]+)=(?P<value>[^&;#]*)")
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key|sig|credential|auth", re.IGNORECASE)


def redact(text: str | None) -> str:
    """The URI (or any text holding URIs) with every password replaced by `***`. The user name
    stays when a password follows it (a reader still sees which account was used); alone, it may
    be a token, and goes too. A password may hold '/', '@', '?' or '#' unescaped (database URIs
    are written so: SQLAlchemy takes everything to the last '@' as the user's part), so the
    user's part runs to the last '@' before the query; query parameters named like a secret
    (password=, token=, X-Amz-Signature=) lose their values as well."""
    if not text:
        return text or ""
    return _URI.sub(lambda m: m["scheme"] + _redact_rest(m["rest"]), str(text))


def _redact_rest(rest: str) -> str:
    """What follows `scheme://`, its user's part and secret query values hidden."""
    query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, query_at)
    first_at = rest.find("@")
    if at < 0 and first_at >= 0 and "/" not in rest[:first_at]:
        at = rest.rfind("@")  # the password holds '?' or '#': nothing before its '@' is a path
    user_part, remainder = "", rest
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        user_part, remainder = (f"{user}:***" if colon and user else "***"), rest[at:]
    query_at = min((i for i in (remainder.find("?"), remainder.find("#")) if i >= 0), default=len(remainder))
    return user_part + remainder[:query_at] + _PARAM.sub(_hide_value, remainder[query_at:])


def _hide_value(m: re.Match) -> str:
    return f"{m['lead']}{m['key']}=***" if _SECRET_KEY.search(m["key"]) and m["value"] else m.group()


def use_tracking_uri(uri: str) -> None:
    """Point this process's MLflow calls at `uri`, and only this process's: mlflow's own
    set_tracking_uri also exports MLFLOW_TRACKING_URI, so every process started afterwards (a
    job's workers, a pipeline's next step, a test's next job) would log there too, and would hold
    the URI's password in its environment."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
