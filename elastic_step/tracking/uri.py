"""Tracking URIs without their secrets: `http://user:pass@host` may be how a user reaches MLflow,
but the password belongs in no parameter, log line, error message, result file or metadata."""

from __future__ import annotations

import os
import re

# scheme://userinfo@ — userinfo is everything up to the last '@' before the host part ends
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/\s:@]*)(?P<password>:[^/\s@]*)?@")


def redact(text: str | None) -> str:
    """The URI (or any text holding URIs) with every password replaced by `***`. The user name
    stays when a password follows it (a reader still sees which account was used); alone, it may
    be a token, and goes too."""
    if not text:
        return text or ""

    def hide(m: re.Match) -> str:
        return f"{m['scheme']}{m['user']}:***@" if m["password"] is not None and m["user"] else f"{m['scheme']}***@"

    return _USERINFO.sub(hide, str(text))


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
