"""The table of compression schemes: one line per scheme.

Every list of schemes is derived from :data:`TABLE` (and the schemes added with
:func:`register_scheme`): the attributes of :class:`hvd_compress.Compression`, the names
:meth:`~hvd_compress.Compression.parse` accepts, the list in ``Compression``'s docstring
and the benchmarks' scheme lists (:mod:`hvd_compress.bench`). A new scheme is its module
under :mod:`hvd_compress.schemes` plus one line here.

This module imports no framework: a target is loaded (and torch with it) only when the
scheme is first used.
"""

from __future__ import annotations

import importlib
import keyword
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemeEntry:
    """One scheme of the table.

    Args:
        name: the name in ``Compression.<name>`` and in spec strings (``"<name>:k=v"``).
        target: ``"module:attribute"`` of a scheme class (called with the scheme's
            options), a ready-made scheme object (``none``, ``fp16``: used as it is) or a
            factory function; or that object itself (:func:`register_scheme`).
        ready_made: ``target`` is a class without options whose one instance is the scheme
            (``Compression.fp16`` is an object, not a class).
        bench: the spec strings the benchmarks run for this scheme (empty: none).
        sparse: its pairs are summed by a sparse sum (the benchmarks list them apart).
    """

    name: str
    target: str | Any
    ready_made: bool = False
    bench: tuple[str, ...] = ()
    sparse: bool = False

    def load(self) -> Any:
        """The class, object or factory that ``target`` names (for ``ready_made``: an
        instance of the class)."""
        found = self.target
        if isinstance(found, str):
            module, _, attribute = found.partition(":")
            found = getattr(importlib.import_module(module), attribute)
        return found() if self.ready_made else found


TABLE: tuple[SchemeEntry, ...] = (
    SchemeEntry("none", "hvd_compress.schemes.dense:NoCompression", True, bench=("none",)),
    SchemeEntry("fp16", "hvd_compress.schemes.dense:FP16", True, bench=("fp16",)),
    SchemeEntry("bf16", "hvd_compress.schemes.dense:BF16", True, bench=("bf16",)),
    SchemeEntry("onebit", "hvd_compress.schemes.onebit:OneBit", bench=("onebit",)),
    SchemeEntry("qsgd", "hvd_compress.schemes.qsgd:QSGD", bench=("qsgd:bits=4", "qsgd:bits=8")),
    SchemeEntry("terngrad", "hvd_compress.schemes.terngrad:TernGrad", bench=("terngrad",)),
    SchemeEntry("powersgd", "hvd_compress.schemes.powersgd:PowerSGD",
                bench=("powersgd:rank=4,start_iter=0", "powersgd:rank=1,start_iter=0")),
    SchemeEntry("topk", "hvd_compress.schemes.topk:TopK", sparse=True,
                bench=("topk:ratio=0.001", "topk:ratio=0.001,values=fp16")),
    SchemeEntry("randomk", "hvd_compress.schemes.randomk:RandomK", sparse=True,
                bench=("randomk:ratio=0.01",)),
    SchemeEntry("dgc", "hvd_compress.schemes.dgc:DGC", sparse=True, bench=("dgc:ratio=0.001",)),
    SchemeEntry("vote", "hvd_compress.schemes.vote:MajorityVote"),
    SchemeEntry("threshold", "hvd_compress.schemes.threshold:Threshold", sparse=True),
    SchemeEntry("auto", "hvd_compress.compression:auto"),
)
"""The built-in schemes, in the order they are listed."""

_registered: dict[str, SchemeEntry] = {}
_loaded: dict[str, Any] = {}
RESERVED = frozenset({"parse", "register", "mro"})
"""Names a scheme cannot take: ``Compression``'s own attributes."""


def entries() -> tuple[SchemeEntry, ...]:
    """The built-in schemes, then those registered, in registration order."""
    return (*TABLE, *_registered.values())


def names() -> tuple[str, ...]:
    """Every scheme's name, in :func:`entries` order."""
    return tuple(entry.name for entry in entries())


def lookup(name: str) -> Any:
    """The class, ready-made object or factory of the scheme ``name`` (loaded once);
    ``KeyError`` if there is none."""
    if name not in _loaded:
        entry = next((e for e in entries() if e.name == name), None)
        if entry is None:
            raise KeyError(name)
        _loaded[name] = entry.load()
    return _loaded[name]


def bench_specs(sparse: bool) -> tuple[str, ...]:
    """The spec strings the benchmarks run: the dense schemes' or the sparse ones'."""
    return tuple(spec for entry in entries() if entry.sparse == sparse for spec in entry.bench)


def register_scheme(name: str, factory: type | Callable[..., Any] | Any,
                    bench: Sequence[str] = (), sparse: bool = False) -> None:
    """Add a scheme under ``name``: ``Compression.<name>`` and
    ``Compression.parse("<name>:k=v")`` then give it, as for a built-in one.

    Args:
        name: a lower-case Python identifier not taken by another scheme.
        factory: a :class:`~hvd_compress.schemes.base.Scheme` subclass (called with the
            options of a spec string, checked against its constructor's annotations), a
            ready-made scheme object, or a function returning a scheme.
        bench: spec strings the benchmarks should run for it (default none).
        sparse: whether its pairs go through a sparse sum (for the benchmarks' lists).

    Raises ``ValueError`` for a name that is taken or not an identifier, ``TypeError`` for
    a factory that is neither callable nor a scheme object.
    """
    if not name.isidentifier() or keyword.iskeyword(name) or name != name.lower() \
            or name.startswith("_") or name in RESERVED:
        raise ValueError(f"register_scheme: {name!r} is not usable as a scheme name; use a "
                         "lower-case identifier such as 'mytopk'")
    if name in names():
        raise ValueError(f"register_scheme: a scheme named {name!r} exists already; choose "
                         f"another name (taken: {', '.join(names())})")
    from hvd_compress.schemes.base import Scheme  # loads torch, as any scheme does

    if not callable(factory) and not isinstance(factory, Scheme):
        raise TypeError(f"register_scheme: {name!r} needs a Scheme subclass, a Scheme object "
                        f"or a function returning one, got {factory!r}")
    _registered[name] = SchemeEntry(name, factory, bench=tuple(bench), sparse=sparse)


def unregister_scheme(name: str) -> None:
    """Remove a scheme added with :func:`register_scheme` (a built-in one cannot be
    removed: ``ValueError``)."""
    if name not in _registered:
        raise ValueError(f"unregister_scheme: {name!r} was not added with register_scheme "
                         f"(registered: {', '.join(_registered) or 'none'})")
    del _registered[name]
    _loaded.pop(name, None)
