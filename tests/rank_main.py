"""Entry point of one rank in a multi-process test: ``python -m tests.rank_main OUT
module:function JSON_KWARGS``. Initialises Horovod (splitting off parameter-server ranks
when ``HVD_COMPRESS_PS=mpi``), runs the function, saves its result to
``OUT/rank<r>.pt``."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import horovod.torch as hvd
import torch

from hvd_compress.torch import init


def main() -> None:
    out_dir, target, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    init()
    torch.manual_seed(1234 + hvd.rank())
    result = function(**kwargs)
    torch.save(result, Path(out_dir) / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
