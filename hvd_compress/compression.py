"""``Compression``: every scheme under one name, as Horovod names its compressors.

The schemes are those of the table in :mod:`hvd_compress.registry` and the ones added with
:func:`~hvd_compress.registry.register_scheme` (also ``Compression.register``):
``Compression.<name>`` looks the name up there, and :data:`SCHEME_NAMES` lists them.
"""

from __future__ import annotations

import ast
import inspect
import typing
from typing import Any

from hvd_compress import registry
from hvd_compress.policy import Auto
from hvd_compress.registry import register_scheme
from hvd_compress.schemes.base import Scheme

DEFAULT_AUTO_SCHEME = "powersgd:rank=4"
"""The scheme ``Compression.auto`` uses where it pays, unless told otherwise."""


class _Schemes(type):
    """``Compression.<name>``: the scheme of that name in the registry."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return registry.lookup(name)
        except KeyError:
            raise AttributeError(f"Compression has no scheme {name!r}; the schemes are "
                                 f"{', '.join(registry.names())}") from None

    def __dir__(cls) -> list[str]:
        return sorted({*super().__dir__(), *registry.names()})


class Compression(metaclass=_Schemes):
    """The schemes to pass as ``compression=``.

    ``none``, ``fp16`` and ``bf16`` are ready-made objects (``none`` and ``fp16`` also work
    with Horovod's own ``hvd.DistributedOptimizer``); calling one, ``Compression.fp16()``,
    returns the object itself, so both spellings mean the same. The others are constructors
    taking the scheme's options, each documented on its class with the paper's formulas.

    Top-k, threshold and DGC pairs are summed by the parameter server given as the optimizer's
    ``ps=`` (or by Horovod ``allgather`` without one); ``values='fp16'`` halves the
    values' bytes on the wire.

    ``Compression.auto(scheme)`` sends each tensor dense, as float16 or with ``scheme``,
    whichever a cost model measured on the job's own links predicts is fastest
    (:mod:`hvd_compress.policy`); as a string, ``"auto:powersgd:rank=4"``.

    A scheme of your own: ``Compression.register("name", SchemeClass)``
    (:func:`~hvd_compress.registry.register_scheme`). The schemes and their defaults::
    """

    register = staticmethod(register_scheme)

    @classmethod
    def parse(cls, spec: str) -> Scheme | Auto:
        """A scheme from a command-line string: ``"fp16"``, ``"onebit"``,
        ``"qsgd:bits=8,bucket_size=256"``, ``"powersgd:rank=2,start_iter=0"``,
        ``"auto:powersgd:rank=4"`` (``auto:`` then the spec of the scheme it uses where it
        pays; ``"auto"`` alone uses :data:`DEFAULT_AUTO_SCHEME`).

        Values are Python literals (``True``, ``None``, ``2.5``, ``'max'``; ``true``/``false``
        also work, and a bare word is a string). Raises ``ValueError`` naming the problem
        for an unknown scheme (listing the known ones), an unknown option (listing the
        scheme's options), or a value of the wrong type (naming the type expected).
        """
        if not isinstance(spec, str):
            raise TypeError(f"Compression.parse takes a string such as 'qsgd:bits=4', got "
                            f"{type(spec).__name__} {spec!r}")
        name, _, arg_text = spec.partition(":")
        name = name.strip().lower()
        if name not in registry.names():
            raise ValueError(f"unknown compression scheme {name!r} in {spec!r}; choose from "
                             f"{', '.join(registry.names())}")
        if name == "auto":
            return auto(arg_text.strip() or DEFAULT_AUTO_SCHEME)
        factory = registry.lookup(name)
        options = {} if isinstance(factory, Scheme) else scheme_options(factory)
        kwargs: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in arg_text.split(","))):
            key, eq, text = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"scheme option {item!r} in {spec!r} is not key=value")
            if not options:
                raise ValueError(f"scheme {name!r} takes no options, got {item!r} in {spec!r}")
            if key not in options:
                raise ValueError(f"scheme {name!r} has no option {key!r} (in {spec!r}); its "
                                 f"options are {', '.join(options)}")
            if key in kwargs:
                raise ValueError(f"option {key!r} is given twice in {spec!r}")
            kwargs[key] = _option_value(name, key, text.strip(), options[key], spec)
        if isinstance(factory, Scheme):
            return factory
        return factory(**kwargs)


def auto(scheme: Scheme | str = DEFAULT_AUTO_SCHEME, **options: Any) -> Auto:
    """``Compression.auto``: route each tensor dense, as float16 or with ``scheme`` (a
    scheme, or a spec string for :meth:`Compression.parse`), whichever the cost model
    predicts is fastest. ``options`` are :class:`~hvd_compress.policy.Auto`'s (``fp16``,
    ``recheck_every``, ``tolerance``, ``probe_seconds``)."""
    if isinstance(scheme, str):
        scheme = Compression.parse(scheme)
    return Auto(scheme, **options)


def scheme_options(factory: Any) -> dict[str, Any]:
    """A scheme class's (or factory function's) options and their annotated types, in
    order; ``**kwargs`` and ``*args`` are left out."""
    hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)
    return {name: hints.get(name, Any)
            for name, p in inspect.signature(factory).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


_TYPE_NAMES = {int: "an integer (int)", float: "a number (float)", bool: "True or False (bool)",
               str: "a string (str)"}


def _type_name(expected: Any) -> str:
    args = [a for a in typing.get_args(expected) if a is not type(None)]
    if args:  # Optional[X]
        return " or ".join(_TYPE_NAMES.get(a, getattr(a, "__name__", str(a))) for a in args) \
            + " or None"
    return _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))


def _matches(value: Any, expected: Any) -> bool:
    if expected is Any:
        return True
    args = typing.get_args(expected)
    if args:
        return any(_matches(value, a) for a in args)
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _option_value(scheme: str, key: str, text: str, expected: Any, spec: str) -> Any:
    """The value of ``key=text``, checked against the option's annotated type."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: norm=max, values=fp16
    if isinstance(value, str) and value.lower() in ("true", "false") and _matches(True, expected):
        value = value.lower() == "true"
    if not _matches(value, expected):
        raise ValueError(f"scheme {scheme!r} option {key!r} must be {_type_name(expected)}, "
                         f"got {text!r} in {spec!r}")
    return value


def _signature(name: str, factory: Any) -> str:
    """``Compression.<name>(option=default, ...)``, or ``Compression.<name>`` for a
    ready-made scheme object."""
    if isinstance(factory, Scheme):
        return f"Compression.{name}"
    params = []
    for param in inspect.signature(factory).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            params.append(f"**{param.name}")
        elif param.default is param.empty:
            params.append(param.name)
        else:
            params.append(f"{param.name}={param.default!r}")
    return f"Compression.{name}({', '.join(params)})"


def _listing(indent: str = "    ", width: int = 92) -> str:
    """The built-in schemes and their options, one signature each (wrapped)."""
    lines = []
    for entry in registry.TABLE:
        text = _signature(entry.name, registry.lookup(entry.name))
        while len(text) > width:
            cut = text.rindex(", ", 0, width) + 1
            lines.append(indent + text[:cut])
            text = " " * (len(entry.name) + 13) + text[cut:].lstrip()
        lines.append(indent + text)
    return "\n".join(lines)


Compression.__doc__ = f"{Compression.__doc__}\n{_listing()}\n"


def __getattr__(name: str) -> Any:
    """``SCHEME_NAMES``: every scheme's name (the table's, then those registered)."""
    if name == "SCHEME_NAMES":
        return registry.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
