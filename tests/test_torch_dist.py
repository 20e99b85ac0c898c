"""The pipeline on ``torch.distributed`` alone (no Horovod): every scheme through
:class:`~hvd_compress.comm.torch_dist.TorchDistCommunicator`, 2 processes, Gloo on CPU
tensors and NCCL on GPUs; and ``collectives="nccl"``'s refusals, checked on the CPU.

The ranks' processes block Horovod's and TensorFlow's imports, so these tests run where
torch alone is installed (the GPU check's machine). At 2 ranks a sum has one order (``a +
b == b + a``), so the aggregates must equal an in-process :class:`~hvd_compress.comm.
threads.ThreadGroup`'s on the same device, bit for bit, and each other's."""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_compress.comm.threads import ThreadGroup
from tests.harness import rank_env, run_command
from tests.threaded import on_threads
from tests.workers.torch_dist import exchange_all

SPECS = ["none", "fp16", "bf16", "onebit:bucket_size=64", "qsgd:bucket_size=64",
         "terngrad:bucket_size=64,error_feedback=True", "powersgd:rank=2,start_iter=1",
         "topk:ratio=0.05", "topk:ratio=0.05,values=fp16", "randomk:ratio=0.05",
         "threshold:tau=2.5", "dgc:ratio=0.05", "vote", "vote:momentum=0.9"]
"""Every scheme: dense, packed (the compressed all-reduce's all-to-all and fixed-size
all-gather), low-rank, and sparse (variable-size all-gathers of frames on the group)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(backend: str, ranks: int, timeout: float = 400) -> list[Any]:
    """Run ``ranks`` processes of tests/workers/torch_dist.py; their results in rank order."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hvdc-dist-") as out:
        # A shell starts the ranks so that run_command's process group holds them all.
        cmd = " & ".join(
            f"RANK={r} WORLD_SIZE={ranks} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"{sys.executable} -m tests.workers.torch_dist {out} {backend} "
            f"'{json.dumps(SPECS)}'" for r in range(ranks))
        done = run_command(["bash", "-c", f"{cmd} & fail=0; for job in $(jobs -p); do "
                            "wait $job || fail=1; done; exit $fail"], timeout, rank_env())
        assert done.returncode == 0, done.stdout[-6000:]
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(ranks)]


def reference(ranks: int, device: str) -> list[Any]:
    """The same exchanges on a ThreadGroup in this process."""
    group = ThreadGroup(ranks, timeout=300)
    return on_threads(ranks, lambda rank: exchange_all(group.communicator(rank), SPECS,
                                                       torch.device(device)))


def check(got: list[Any], expected: list[Any]) -> None:
    for spec in SPECS:
        for step, row in enumerate(got[0][spec]):
            for name, value in row.items():
                where = f"{spec} step {step} {name}"
                assert torch.isfinite(value).all(), where
                for rank in range(len(got)):
                    mine = got[rank][spec][step][name]
                    assert torch.equal(mine.view(torch.int8), value.view(torch.int8)), \
                        f"{where}: rank {rank}'s replica differs from rank 0's"
                    ref = expected[rank][spec][step][name]
                    assert mine.dtype == ref.dtype and \
                        torch.equal(mine.view(torch.int8), ref.view(torch.int8)), \
                        f"{where}: rank {rank} differs from the ThreadGroup's result"


@pytest.mark.multiprocess
def test_every_scheme_over_gloo_without_horovod() -> None:
    check(launch("gloo", 2), reference(2, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_scheme_over_nccl_without_horovod() -> None:
    # NCCL refuses two ranks on one GPU: with one GPU, one rank (every round still runs
    # through NCCL with CUDA tensors, and must equal the ThreadGroup's result).
    ranks = min(2, torch.cuda.device_count())
    check(launch("nccl", ranks), reference(ranks, "cuda"))


def _optimizer(monkeypatch: pytest.MonkeyPatch, nccl: bool, cuda: bool) -> None:
    from hvd_compress.torch import DistributedOptimizer

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model = torch.nn.Linear(3, 2)  # on the CPU
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), collectives="nccl")


def test_nccl_is_refused_without_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"collectives='nccl' needs a torch built with NCCL.*"
                                         r"is_nccl_available\(\) is False.*collectives='gloo'"):
        _optimizer(monkeypatch, nccl=False, cuda=True)


def test_nccl_is_refused_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"collectives='nccl' sums CUDA tensors, and "
                                         r"torch.cuda.is_available\(\) is False"):
        _optimizer(monkeypatch, nccl=True, cuda=False)


def test_nccl_is_refused_for_a_model_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"parameters are on cpu: call "
                                         r"torch.cuda.set_device\(hvd.local_rank\(\)\) and "
                                         r"model.cuda\(\)"):
        _optimizer(monkeypatch, nccl=True, cuda=True)


@pytest.mark.skipif(torch.distributed.is_nccl_available() and torch.cuda.is_available(),
                    reason="NCCL and CUDA are here: nothing to refuse")
def test_nccl_is_refused_here_as_this_machine_is() -> None:
    from hvd_compress.torch import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="collectives='nccl'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), collectives="nccl")
