"""``Compression``: every scheme under one name, as Horovod names its compressors."""

from __future__ import annotations

import ast
import inspect
import typing
from typing import Any

from hvd_compress.schemes.auto import Auto
from hvd_compress.schemes.base import Scheme
from hvd_compress.schemes.dense import BF16, FP16, NoCompression
from hvd_compress.schemes.dgc import DGC
from hvd_compress.schemes.onebit import OneBit
from hvd_compress.schemes.powersgd import PowerSGD
from hvd_compress.schemes.qsgd import QSGD
from hvd_compress.schemes.randomk import RandomK
from hvd_compress.schemes.terngrad import TernGrad
from hvd_compress.schemes.threshold import Threshold
from hvd_compress.schemes.topk import TopK
from hvd_compress.schemes.vote import MajorityVote


class Compression:
    """The schemes to pass as ``compression=``.

    ``none``, ``fp16`` and ``bf16`` are ready-made objects (``none`` and ``fp16`` also work
    with Horovod's own ``hvd.DistributedOptimizer``); calling one, ``Compression.fp16()``,
    returns the object itself, so both spellings mean the same. The others are constructors
    taking the scheme's options, each documented on its class with the paper's formulas::

        Compression.onebit(bucket_size=2048, loco_beta=0.0, start_iter=0)
        Compression.qsgd(bits=4, bucket_size=512, norm='max', error_feedback=False, loco_beta=0.0)
        Compression.terngrad(bucket_size=512, clip=2.5, error_feedback=False, loco_beta=0.0)
        Compression.powersgd(rank=4, start_iter=10, min_compression_rate=2, warm_start=True,
                             loco_beta=0.0)
        Compression.topk(ratio=0.001, values='fp32', loco_beta=0.0)
        Compression.randomk(ratio=0.01, loco_beta=0.0, error_feedback=True,
                            unbiased=False, start_iter=0)
        Compression.threshold(tau=1e-3, max_ratio=0.1, values='fp32', loco_beta=0.0)
        Compression.dgc(ratio=0.001, momentum=0.9, clip_norm=None, warmup_steps=0,
                        sample_ratio=0.01, values='fp32')
        Compression.vote(momentum=0.0)   # signSGD / Signum with majority vote

    Top-k, threshold and DGC pairs are summed by the parameter server given as the optimizer's
    ``ps=`` (or by Horovod ``allgather`` without one); ``values='fp16'`` halves the
    values' bytes on the wire.

    ``Compression.auto(scheme)`` sends each tensor dense, as float16 or with ``scheme``,
    whichever a cost model measured on the job's own links predicts is fastest
    (:mod:`hvd_compress.schemes.auto`); as a string, ``"auto:powersgd:rank=4"``.
    """

    none = NoCompression()
    fp16 = FP16()
    bf16 = BF16()
    onebit = OneBit
    qsgd = QSGD
    terngrad = TernGrad
    powersgd = PowerSGD
    topk = TopK
    randomk = RandomK
    threshold = Threshold
    dgc = DGC
    vote = MajorityVote
    auto = Auto

    @classmethod
    def parse(cls, spec: str) -> Scheme:
        """A scheme from a command-line string: ``"fp16"``, ``"onebit"``,
        ``"qsgd:bits=8,bucket_size=256"``, ``"powersgd:rank=2,start_iter=0"``.

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
        if name not in SCHEME_NAMES:
            raise ValueError(f"unknown compression scheme {name!r} in {spec!r}; choose from "
                             f"{', '.join(SCHEME_NAMES)}")
        factory = getattr(cls, name)
        if factory is Auto:  # "auto:<scheme spec>": the scheme it uses where it pays
            return Auto(arg_text.strip() or "powersgd:rank=4")
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


def scheme_options(factory: type[Scheme]) -> dict[str, Any]:
    """A scheme class's constructor options and their annotated types, in order."""
    hints = typing.get_type_hints(factory.__init__)
    return {name: hints.get(name, Any)
            for name in inspect.signature(factory).parameters}


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


SCHEME_NAMES = ("none", "fp16", "bf16", "onebit", "qsgd", "terngrad", "powersgd", "topk",
                "randomk", "dgc", "vote", "threshold", "auto")
