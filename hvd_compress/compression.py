"""``Compression``: every scheme under one name, as Horovod names its compressors."""

from __future__ import annotations

import ast

from hvd_compress.schemes.base import Scheme
from hvd_compress.schemes.dense import BF16, FP16, NoCompression
from hvd_compress.schemes.dgc import DGC
from hvd_compress.schemes.onebit import OneBit
from hvd_compress.schemes.powersgd import PowerSGD
from hvd_compress.schemes.qsgd import QSGD
from hvd_compress.schemes.randomk import RandomK
from hvd_compress.schemes.terngrad import TernGrad
from hvd_compress.schemes.topk import TopK


class Compression:
    """The schemes to pass as ``compression=``.

    ``none``, ``fp16`` and ``bf16`` are ready-made objects (``none`` and ``fp16`` also work
    with Horovod's own ``hvd.DistributedOptimizer``); the others are constructors taking the
    scheme's options, each documented on its class with the paper's formulas::

        Compression.onebit(bucket_size=2048)
        Compression.qsgd(bits=4, bucket_size=512, norm='max', error_feedback=False)
        Compression.terngrad(bucket_size=512, clip=None, error_feedback=False)
        Compression.powersgd(rank=4, start_iter=10, min_compression_rate=2, warm_start=True)
        Compression.topk(ratio=0.001, values='fp32')
        Compression.randomk(ratio=0.01)
        Compression.dgc(ratio=0.001, momentum=0.9, clip_norm=None, warmup_steps=0,
                        sample_ratio=0.01, values='fp32')

    Top-k and DGC pairs are summed by the parameter server given as the optimizer's
    ``ps=`` (or by Horovod ``allgather`` without one); ``values='fp16'`` halves the
    values' bytes on the wire.
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
    dgc = DGC

    @classmethod
    def parse(cls, spec: str) -> Scheme:
        """A scheme from a command-line string: ``"fp16"``, ``"onebit"``,
        ``"qsgd:bits=8,bucket_size=256"``, ``"powersgd:rank=2,start_iter=0"``."""
        name, _, arg_text = spec.partition(":")
        name = name.strip()
        if name not in SCHEME_NAMES:
            raise ValueError(f"unknown compression scheme {name!r}; choose from "
                             f"{', '.join(SCHEME_NAMES)}")
        factory = getattr(cls, name)
        kwargs = {}
        for item in filter(None, (part.strip() for part in arg_text.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"scheme option {item!r} in {spec!r} is not key=value")
            try:
                kwargs[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                kwargs[key.strip()] = value.strip()
        if isinstance(factory, Scheme):
            if kwargs:
                raise ValueError(f"scheme {name!r} takes no options, got {kwargs}")
            return factory
        return factory(**kwargs)


SCHEME_NAMES = ("none", "fp16", "bf16", "onebit", "qsgd", "terngrad", "powersgd", "topk",
                "randomk", "dgc")
