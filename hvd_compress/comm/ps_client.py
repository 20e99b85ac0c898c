"""Clients of the parameter server (``python -m ps_server``): the names workers, tests and
benchmarks use, gathered from :mod:`hvd_compress.comm.ps_transport`, where each transport
lives in its own module (:mod:`~hvd_compress.comm.ps_transport.grpc`,
:mod:`~hvd_compress.comm.ps_transport.mpi`) behind one interface
(:mod:`~hvd_compress.comm.ps_transport.base`). Pick a client by its spec with
:func:`~hvd_compress.comm.ps_transport.connect`.
"""

from __future__ import annotations

from hvd_compress.comm.ps_transport import accepted_forms
from hvd_compress.comm.ps_transport.base import (
    PendingRound,
    PSError,
    ShardedClient,
    check_timeout,
    shard_bounds,
)
from hvd_compress.comm.ps_transport.grpc import (
    CONNECT_TIMEOUT,
    RETRY_TIMEOUT,
    RETRYABLE,
    PSClient,
    address_problem,
    parse_addresses,
    timeout_setting,
)
from hvd_compress.comm.ps_transport.mpi import MPIPSClient
from hvd_compress.ps_protocol import CONNECT_TIMEOUT_ENV, GRPC_SERVICE, RETRY_TIMEOUT_ENV

ACCEPTED_FORMS = accepted_forms()
"""The forms of a ``ps=`` spec the built-in transports accept, for error messages."""

_ShardedClient = ShardedClient  # the base class's name before the transports' split

__all__ = [
    "ACCEPTED_FORMS",
    "CONNECT_TIMEOUT",
    "CONNECT_TIMEOUT_ENV",
    "GRPC_SERVICE",
    "RETRYABLE",
    "RETRY_TIMEOUT",
    "RETRY_TIMEOUT_ENV",
    "MPIPSClient",
    "PSClient",
    "PSError",
    "PendingRound",
    "ShardedClient",
    "address_problem",
    "check_timeout",
    "parse_addresses",
    "shard_bounds",
    "timeout_setting",
]
