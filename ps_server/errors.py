"""The refusals of the parameter server: each names the gRPC status it is answered with.

The MPI transport sends the status name itself; see :mod:`ps_server.rounds` for when each
is raised.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; ``code`` is the gRPC status name it maps to."""

    code = "INVALID_ARGUMENT"


class StaleRound(RequestError):
    """A push or pull for a round before the last finished one."""

    code = "FAILED_PRECONDITION"


class FutureRound(RequestError):
    """A push or pull for a round after the open one."""

    code = "FAILED_PRECONDITION"


class RoundFailed(RequestError):
    """The round failed (a worker missed the deadline, or pushed conflicting content)."""

    code = "ABORTED"


class LateRound(RequestError):
    """A push for a round that closed without it (``--quorum``): the worker keeps those
    pairs for a later round (error feedback) and pulls the closed round's aggregate."""

    code = "OUT_OF_RANGE"


class UnknownTensor(RequestError):
    """A pull of a tensor nobody pushed to this server."""

    code = "NOT_FOUND"


class PullTimeout(RequestError):
    """The pulled round was still open when the pull's time ran out."""

    code = "DEADLINE_EXCEEDED"


class ConflictingPush(RequestError):
    """A second push with different content for the same (worker, round)."""

    code = "ALREADY_EXISTS"


class OverBudget(RequestError):
    """Accepting the push would make the open rounds' pushes exceed the memory budget."""

    code = "RESOURCE_EXHAUSTED"


class WorkerBound(RequestError):
    """A call for a worker of a session that is bound to another process (see
    :mod:`ps_server.identity`)."""

    code = "PERMISSION_DENIED"


class NotDurable(RequestError):
    """The server cannot make rounds durable (a checkpoint write keeps failing): every
    push and pull is refused with the write's error until a write succeeds."""

    code = "UNAVAILABLE"


class JobSizeMismatch(RequestError):
    """The client's job has a different number of workers than the server's --workers."""

    code = "FAILED_PRECONDITION"
