"""A Gloo group's one-hop collectives (``hvd_compress/comm/torch_dist.py``): fixed-size
all-gathers and small all-reduces travel as all-to-alls. At 3 ranks (uneven chunks of the
compressed all-reduce, sums whose order matters) every rank's aggregates equal an
in-process :class:`~hvd_compress.comm.threads.ThreadGroup`'s bit for bit: the small
all-reduce sums in rank order as the ThreadGroup does, and the all-gather moves bytes. The
ranks raise the small all-reduce's limit above the worker's 40 kB buckets, so that every
dense sum takes that path (Gloo's ring adds in another order at 3 ranks)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_compress.comm.threads import ThreadGroup
from tests.harness import rank_env, run_command
from tests.test_torch_dist import _free_port
from tests.threaded import on_threads
from tests.workers.torch_dist import exchange_all

SPECS = ["none", "bf16", "onebit:bucket_size=64", "qsgd:bucket_size=64"]
RANKS = 3


def launch(specs: list[str], ranks: int, timeout: float = 400) -> list[Any]:
    """``ranks`` processes of tests/workers/gloo_one_hop.py; their results in rank order."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hvdc-gloo-") as out:
        cmd = " & ".join(
            f"RANK={r} WORLD_SIZE={ranks} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"{sys.executable} -m tests.workers.gloo_one_hop {out} gloo '{json.dumps(specs)}' "
            f"{1 << 20}"
            for r in range(ranks))
        done = run_command(["bash", "-c", f"{cmd} & fail=0; for job in $(jobs -p); do "
                            "wait $job || fail=1; done; exit $fail"], timeout, rank_env())
        assert done.returncode == 0, done.stdout[-6000:]
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(ranks)]


@pytest.mark.multiprocess
def test_three_ranks_on_gloo_equal_a_thread_group_bit_for_bit() -> None:
    got = launch(SPECS, RANKS)
    group = ThreadGroup(RANKS, timeout=300)
    expected = on_threads(RANKS, lambda rank: exchange_all(group.communicator(rank), SPECS,
                                                           torch.device("cpu")))
    for spec in SPECS:
        for step, row in enumerate(expected[0][spec]):
            for name in row:
                for rank in range(RANKS):
                    mine, ref = got[rank][spec][step][name], expected[rank][spec][step][name]
                    assert mine.dtype == ref.dtype and \
                        torch.equal(mine.view(torch.int8), ref.view(torch.int8)), \
                        f"{spec} step {step} {name}: rank {rank} differs from the ThreadGroup"
