"""The parameter-server transports, chosen by the scheme of a ``ps=`` spec.

A spec names its transport by its scheme, the part before ``://`` of its first address
(``grpc://h:p,h:p`` and ``grpcs://h:p`` reach :mod:`~hvd_compress.comm.ps_transport.grpc`),
or by being one bare word (``mpi`` reaches :mod:`~hvd_compress.comm.ps_transport.mpi`); a
bare ``host:port`` is :data:`DEFAULT_SCHEME`. Every transport implements
:class:`~hvd_compress.comm.ps_transport.base.Transport` and returns a
:class:`~hvd_compress.comm.ps_transport.base.ShardedClient`.

Adding a transport is one module with a ``Transport`` subclass and one :func:`register`
line at the end of this file (or a call from the code that brings it; a test does).
"""

from __future__ import annotations

from typing import Any

from hvd_compress.comm.ps_transport.base import (
    ShardedClient,
    SpecError,
    Transport,
    join_forms,
)
from hvd_compress.comm.ps_transport.grpc import GrpcTransport
from hvd_compress.comm.ps_transport.mpi import MPITransport

DEFAULT_SCHEME = "grpc"
"""The scheme of a spec with neither ``://`` nor a registered bare word (``host:port``)."""

_BY_SCHEME: dict[str, Transport] = {}


def register(transport: Transport) -> None:
    """Make ``transport`` serve each of its ``schemes``. Raises ``ValueError`` when one of
    them is served by another transport already (:func:`unregister` it first)."""
    if not transport.schemes or not transport.forms:
        raise ValueError(f"{type(transport).__name__} must name its schemes and forms")
    for scheme in transport.schemes:
        taken = _BY_SCHEME.get(scheme.lower())
        if taken is not None and taken is not transport:
            raise ValueError(f"the ps= scheme {scheme!r} is served by "
                             f"{type(taken).__name__} already")
    for scheme in transport.schemes:
        _BY_SCHEME[scheme.lower()] = transport


def unregister(transport: Transport) -> None:
    """Stop ``transport`` serving its schemes (what :func:`register` did)."""
    for scheme, served_by in list(_BY_SCHEME.items()):
        if served_by is transport:
            del _BY_SCHEME[scheme]


def transports() -> list[Transport]:
    """The registered transports, each once, in the order they were registered."""
    return list(dict.fromkeys(_BY_SCHEME.values()))


def accepted_forms() -> str:
    """Every registered transport's forms as one phrase, for error messages."""
    return join_forms([form for transport in transports() for form in transport.forms])


def scheme_of(spec: str) -> str:
    """The scheme that chooses ``spec``'s transport: the part before ``://`` of its first
    address (lower case), else the whole spec when it is a registered bare word, else
    :data:`DEFAULT_SCHEME`."""
    first = spec.split(",", 1)[0].strip()
    scheme, sep, _ = first.partition("://")
    if sep:
        return scheme.lower()
    word = spec.strip().lower()
    return word if word in _BY_SCHEME else DEFAULT_SCHEME


def find(spec: Any) -> Transport | None:
    """The transport of ``spec``, or ``None`` when ``spec`` is not a string or its scheme
    has none. Checks nothing else (see :func:`check_spec`)."""
    return _BY_SCHEME.get(scheme_of(spec)) if isinstance(spec, str) else None


def transport_for(spec: str, origin: str = "ps") -> Transport:
    """The transport of ``spec``; raises :class:`SpecError` naming the scheme and every
    accepted form when no transport serves it."""
    transport = find(spec)
    if transport is None:
        first = spec.split(",", 1)[0].strip()
        raise SpecError(f"invalid parameter server address {first!r} in {origin}={spec!r}: "
                        f"{scheme_of(spec) + '://'!r} is not supported", accepted_forms())
    return transport


def check_spec(spec: str, origin: str = "ps") -> str:
    """``spec`` checked for syntax only (nothing is contacted) by its transport; returned
    stripped and normalised (``"mpi"`` in lower case).

    Raises :class:`SpecError` (a ``ValueError``) naming the bad address and every accepted
    form, another ``ValueError`` for a spec that lists one server twice or mixes
    ``grpc://`` with ``grpcs://``, and ``TypeError`` when ``spec`` is not a string.
    ``origin`` names where it came from in the message (``"ps"``, ``"$HVD_COMPRESS_PS"``).
    """
    if not isinstance(spec, str):
        raise TypeError(f"{origin} must be a string, {accepted_forms()}; got "
                        f"{type(spec).__name__} {spec!r}")
    spec = spec.strip()
    try:
        return transport_for(spec, origin).check(spec, origin)
    except SpecError as err:
        raise err.with_forms(accepted_forms()) from None


def connect(spec: str, worker: int, *, workers: int | None = None,
            connect_timeout: float | None = None, retry_timeout: float | None = None
            ) -> ShardedClient:
    """The client of the servers of ``spec``, as worker ``worker`` of a job of ``workers``
    (a transport that tells servers the job size sends it; the communicator sets it from
    its size when not given here). ``connect_timeout`` and ``retry_timeout`` are the gRPC
    client's (defaults from ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT`` and
    ``$HVD_COMPRESS_PS_RETRY_TIMEOUT``); a transport without connections ignores them."""
    spec = check_spec(spec)
    return transport_for(spec).connect(spec, worker, workers=workers,
                                       connect_timeout=connect_timeout,
                                       retry_timeout=retry_timeout)


# The built-in transports: one line each.
register(GrpcTransport())
register(MPITransport())
