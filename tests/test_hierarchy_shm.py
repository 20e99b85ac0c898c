"""The shared-memory in-host communicator of two-level compression (hvd_compress.comm.shm):
the same results as the in-host route it replaces, its errors, and no leftovers."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.comm import shm
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.hierarchy import two_level_pipeline
from tests.test_hierarchy import HOSTS, LOCAL, POLICY, SHAPES, WORLD, steps
from tests.threaded import on_threads

ROOT = Path(__file__).resolve().parent.parent


def leftovers(tag: str) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if tag in n]


def shm_group(size: int, capacity: int, timeout: float = 30.0
              ) -> list[shm.ShmHostCommunicator]:
    """The communicators of one host's ``size`` ranks in this process, each rank mapping
    its peers' segments itself (as ranks in their own processes do)."""
    tag = f"hvdc-test-{uuid.uuid4().hex[:8]}"
    names = [f"{tag}-{r}" for r in range(size)]
    own = [shm.create(n, capacity) for n in names]
    comms = [shm.ShmHostCommunicator(
        r, size, [own[r] if s == r else shm.attach(names[s], capacity) for s in range(size)],
        capacity, timeout) for r in range(size)]
    for n in names:
        shm.unlink(n)
    assert not leftovers(tag)
    return comms


def test_collectives_move_and_sum_in_windows_smaller_than_the_payloads() -> None:
    size, capacity = 3, 4096
    comms = shm_group(size, capacity)
    x = [torch.randn(5000, dtype=torch.float64) * (r + 1) for r in range(size)]
    splits = (1000, 2000, 2000)  # 8000-16000 bytes each: several windows

    def run(r: int) -> Any:
        c = comms[r]
        return (c.wait(c.start("a", AllToAll("h", x[r], splits))),
                c.wait(c.start("g", AllGather("h", x[r][:10 * (r + 1)], (10, 20, 30)))),
                c.wait(c.start("u", AllGather("h", x[r][:700 * (r + 1)]))),
                c.wait(c.start("s", AllReduce("h", x[r].clone(), inplace=True))),
                c.wait(c.start("b", AllGather("h", x[r][:8].to(torch.bfloat16), (8,) * 3))))

    for r, (a, g, u, s, b) in enumerate(on_threads(size, run)):
        lo = sum(splits[:r])
        assert all(torch.equal(a[q], x[q][lo:lo + splits[r]]) for q in range(size))
        assert all(torch.equal(g[q], x[q][:10 * (q + 1)]) for q in range(size))
        assert torch.equal(u[0], torch.cat([x[q][:700 * (q + 1)] for q in range(size)]))
        assert torch.equal(s, (x[0] + x[1]) + x[2])
        assert all(b[q].dtype == torch.bfloat16 and torch.equal(b[q], x[q][:8].bfloat16())
                   for q in range(size))


def _two_level(spec: str, shared: bool) -> list[Any]:
    """One pipeline per global rank, the in-host route over shared memory (windows of 4
    KiB, so a 64 x 48 gradient takes several) or over a ThreadGroup."""
    def host() -> list[Any]:
        if shared:
            return shm_group(LOCAL, 4096)
        group = ThreadGroup(LOCAL, timeout=30)
        return [group.communicator(r) for r in range(LOCAL)]

    hosts = [host() for _ in range(HOSTS)]
    cross = [ThreadGroup(HOSTS, timeout=30) for _ in range(LOCAL)]
    pipes = [two_level_pipeline(Compression.parse(spec), hosts[r // LOCAL][r % LOCAL],
                                cross[r % LOCAL].communicator(r // LOCAL), POLICY,
                                bucket_bytes=4096) for r in range(WORLD)]
    for p in pipes:
        p.plan(list(SHAPES), list(SHAPES.values()))
    return pipes


@pytest.mark.parametrize("spec", ["none", "onebit:bucket_size=64", "topk:ratio=0.05",
                                  "powersgd:rank=2,start_iter=1"])
def test_the_shared_memory_route_gives_the_in_host_routes_bits(spec: str) -> None:
    """Bit-identical to the route it replaces, replicas identical, exact resume."""
    loopback, shared = _two_level(spec, False), _two_level(spec, True)
    want, got = steps(loopback, 0, 3), steps(shared, 0, 2)
    saved = [p.state_dict() for p in shared]
    got += steps(shared, 2, 1)
    resumed = _two_level(spec, True)
    for p, state in zip(resumed, saved, strict=True):
        p.load_state_dict(state)
    again = steps(resumed, 2, 1)
    for step in range(3):
        for r in range(WORLD):
            for name in SHAPES:
                assert torch.equal(got[step][r][name], want[step][0][name]), (step, r, name)
    for r in range(WORLD):
        assert all(torch.equal(again[0][r][n], got[2][0][n]) for n in SHAPES)
    assert shared[0].last_step.collective_bytes["host"] > 0
    if not spec.startswith("powersgd"):  # its rounds run in HostTwoLevelCommunicator
        assert "peers host" in shared[0].last_step.seconds


def test_a_full_dev_shm_names_the_size_and_the_opt_out(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    tag = f"hvdc-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(OSError, match=r"8\.0 MiB.*HVD_COMPRESS_HOST_SHM=0"):
        shm.create(tag, 4 * 2**20)
    assert not leftovers(tag)
    # Every rank of the job raises, not only the one that could not create its segment.
    with pytest.raises(OSError, match=r"rank 0: .*no space"):
        shm.open_host(0, 2, 0, lambda obj: [obj, (0, 1, "peer", None)], capacity=4096)


def test_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm.SHM_ENV, "maybe")
    with pytest.raises(ValueError, match="HVD_COMPRESS_HOST_SHM must be"):
        shm.mode()
    monkeypatch.setenv(shm.SHM_ENV, "0")
    assert shm.mode() == "off"
    monkeypatch.setenv(shm.SHM_MB_ENV, "0.5")
    assert shm.capacity_from_env() == 2**19
    monkeypatch.setenv(shm.SHM_MB_ENV, "-1")
    with pytest.raises(ValueError, match="HVD_COMPRESS_HOST_SHM_MB"):
        shm.capacity_from_env()


def test_a_peer_that_never_arrives_times_out() -> None:
    comms = shm_group(2, 4096, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"local ranks \[1\] .*did not reach 'x'"):
        comms[0].wait(comms[0].start("x", AllGather("h", torch.ones(4))))
    assert time.monotonic() - started < 10


@pytest.mark.multiprocess
def test_a_killed_rank_leaves_nothing_in_dev_shm_and_fails_its_peer(tmp_path: Path) -> None:
    before = set(leftovers("hvdc-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.workers.shm_peer", str(tmp_path),
                               str(r), "2"], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT) for r in range(2)]
    try:
        assert all(p.stdout is not None and p.stdout.readline().strip() == "ready"
                   for p in procs)
        assert set(leftovers("hvdc-")) == before  # unlinked once both had attached
        procs[0].kill()
        procs[0].wait()  # reaped: a zombie would still answer kill(pid, 0)
        out, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert f"local rank 0 of this host (pid {procs[0].pid}) exited" in out
    assert set(leftovers("hvdc-")) == before
