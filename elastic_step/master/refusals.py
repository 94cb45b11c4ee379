"""What the master answers a request it will not act on. The API turns each into its status code
and the message as a JSON error; the master's state is unchanged."""

from __future__ import annotations


class Refused(Exception):
    """A request the master will not act on. The API answers it with `status` and the message
    as a JSON error; the master's state is unchanged."""

    status = 409


class NotAMember(Refused):
    """The caller is not a live worker of this job, or not the member the request needs (a
    stale worker of an earlier attempt holds the same token: it may change nothing)."""

    status = 403


class Conflict(Refused):
    """The request is well-formed and from a member, but does not fit the job's state now."""

    status = 409
