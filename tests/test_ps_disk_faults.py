"""Failed checkpoint writes surface and lose nothing (issue 26, "Disk faults surface").

In process, a journal whose writes fail half-way with ENOSPC, and a snapshot that cannot
be written; as processes, a real full file system (a small tmpfs, needs root).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from hvd_compress.comm.ps_client import PSClient, PSError
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server import checkpoint, grpc_transport
from ps_server.service import ShardService
from ps_server.store import NotDurable, ShardStore
from tests.servers import ServerProcess, start_servers  # noqa: F401 (fixture `start`)

NUMEL = 4000


class FullDisk:
    """Stands in for :mod:`os` in :mod:`ps_server.checkpoint`: while ``full``, every
    ``write`` writes half of its data, then fails with ENOSPC (as a filling disk does)."""

    def __init__(self) -> None:
        self.full = False
        self.failures = 0

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data) -> int:
        if not self.full:
            return os.write(fd, data)
        self.failures += 1
        os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "journal")


def pairs(round: int) -> tuple[np.ndarray, np.ndarray]:
    """Round ``round``'s push: 50 indices and integer values (exact in float32)."""
    rng = np.random.default_rng(round)
    indices = np.sort(rng.choice(NUMEL, 50, replace=False)).astype(np.int64)
    return indices, rng.integers(-100, 100, 50).astype(np.float32)


def wait_until(check, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < timeout, f"not {what} within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - began


@pytest.fixture
def served(tmp_path, monkeypatch):
    """One shard for one worker with checkpoints in ``tmp_path``, over gRPC in process,
    with the journal's ``os`` replaced by a :class:`FullDisk`; and a client."""
    disk = FullDisk()
    monkeypatch.setattr(checkpoint, "os", disk)
    service = ShardService(ShardStore(1, 0, 1, deadline=30.0), str(tmp_path))
    service.restore()
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 30.0)
    client = PSClient(f"127.0.0.1:{port}", 0, timeout=20, retry_timeout=60)
    yield SimpleNamespace(disk=disk, service=service, client=client, port=port)
    client.close()
    server.stop(0)
    disk.full = False
    service.close()


def push_pull(client: PSClient, round: int) -> tuple[list[int], list[float]]:
    idx, val = client.push_pull("job/t", round, NUMEL, *map(torch.from_numpy, pairs(round)))
    return idx.tolist(), val.tolist()


def expected(round: int) -> tuple[list[int], list[float]]:
    idx, val = pairs(round)
    return idx.tolist(), val.tolist()


def test_full_journal_surfaces_and_recovers_with_every_round(served, tmp_path):
    for r in range(2):
        assert push_pull(served.client, r) == expected(r)
    served.disk.full = True
    began = time.monotonic()
    with pytest.raises(PSError) as caught:
        push_pull(served.client, 2)
    took = time.monotonic() - began
    text = str(caught.value)
    # The client fails with the server's reason within seconds, not its 60 s retry time.
    assert took < 10, f"client error after {took:.1f} s"
    assert "UNAVAILABLE" in text and "journal write failed" in text, text
    assert "No space left on device" in text and "--checkpoint-dir" in text, text
    assert served.client.health() == ["NOT_SERVING"]
    assert served.service.failing is not None and served.disk.failures >= 2
    # A pull of another session (no bound worker) is refused with the same reason.
    pull = encode_frame(Kind.PULL, "other/t", 0, 1, 0, 0, NUMEL, np.zeros(0, np.int64),
                        np.zeros(0, np.float32))
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        call = channel.unary_unary("/hvd_compress.ps.ParameterServer/Pull")
        with pytest.raises(grpc.RpcError) as refused:
            call(pull, timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "No space left on device" in refused.value.details()

    served.disk.full = False
    wait_until(lambda: served.client.health() == ["SERVING"], 10, "serving again")
    assert push_pull(served.client, 2) == expected(2)  # the round closed before the fault
    assert push_pull(served.client, 3) == expected(3)
    # Every round is in the journal once, whole, with the sum the worker got.
    config = {"workers": 1, "shard": 0, "shards": 1, "mode": "union"}
    changes, torn = checkpoint.read_journal(
        checkpoint.journal_path(checkpoint.path_for(tmp_path, 0, 1), 1), config)
    changes = [c for c in changes if c.binding is None]  # the worker's binding aside
    assert torn == 0
    assert [c.round for c in changes] == [0, 1, 2, 3]
    for c in changes:
        assert (c.indices.tolist(), c.values.tolist()) == expected(c.round)


def _push(store: ShardStore, service: ShardService, round: int) -> None:
    store.push(decode_frame(encode_frame(Kind.PUSH, "job/t", 0, 1, round, 0, NUMEL,
                                         *pairs(round))))
    service.after_requests()


def _pull(store: ShardStore, round: int) -> tuple[list[int], list[float]]:
    frame = encode_frame(Kind.PULL, "job/t", 0, 1, round, 0, NUMEL, np.zeros(0, np.int64),
                         np.zeros(0, np.float32))
    got = decode_frame(store.pull(decode_frame(frame), 10))
    return got.indices.tolist(), got.values.tolist()


def test_failed_snapshot_is_retried_and_queued_rounds_kept(tmp_path, monkeypatch):
    store = ShardStore(1, 0, 1)
    service = ShardService(store, str(tmp_path), checkpoint_every=1)
    service.restore()
    save, calls = checkpoint.save, []

    def failing_save(*args, **kw):
        calls.append(args[0])
        if len(calls) <= 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(args[0]))
        return save(*args, **kw)

    monkeypatch.setattr(checkpoint, "save", failing_save)
    _push(store, service, 0)
    assert _pull(store, 0) == expected(0)  # journaled: the journal now holds 1 round
    _push(store, service, 1)  # its write is a snapshot, which fails 3 times
    wait_until(lambda: service.failing is not None, 10, "failing")
    with pytest.raises(NotDurable, match=r"snapshot write failed: .*Input/output error"):
        _push(store, service, 2)
    assert "check the disk" in service.failing
    wait_until(lambda: service.failing is None, 10, "recovered")
    assert len(calls) == 4
    assert _pull(store, 1) == expected(1)
    _push(store, service, 2)
    assert _pull(store, 2) == expected(2)
    service.close()
    again = ShardStore(1, 0, 1)
    ShardService(again, str(tmp_path)).restore()
    assert again.rounds() == {"job/t": 3}


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs at ``tmp_path / "disk"``, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"needs root to mount tmpfs (mount said: {made.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path, keep: int) -> None:
    """Fill the file system of ``path`` (a new file) until ``keep`` bytes are left."""
    free = shutil.disk_usage(path.parent).free
    with open(path, "wb") as f:
        f.write(b"\0" * max(free - keep, 0))


@pytest.mark.multiprocess
def test_full_tmpfs_surfaces_and_recovers_every_round(start, small_disk):
    ckpt = small_disk / "ckpt"
    args = ["--workers", "1", "--checkpoint-dir", str(ckpt), "--deadline", "30"]
    server = start(*args)
    filler = small_disk / "filler"
    fill(filler, 128 << 10)  # 128 KB left: a journal record of a round is about 700 bytes
    client = PSClient(server.address, 0, timeout=20, retry_timeout=60)
    rounds, error, took = 0, None, 0.0
    try:
        while error is None:
            began = time.monotonic()
            try:
                assert push_pull(client, rounds) == expected(rounds)
                rounds += 1
            except PSError as err:
                error, took = str(err), time.monotonic() - began
            assert rounds < 2000, "the disk never filled"
        assert took < 10, f"client error after {took:.1f} s"
        assert "UNAVAILABLE" in error and "No space left on device" in error, error
        assert client.health() == ["NOT_SERVING"]
        server.wait_for("journal write failed: .*No space left on device")
        filler.unlink()
        wait_until(lambda: client.health() == ["SERVING"], 10, "serving again")
        server.wait_for("work again after")
        for r in range(rounds, rounds + 3):  # the failed round first: it had closed
            assert push_pull(client, r) == expected(r)
    finally:
        client.close()
    config = {"workers": 1, "shard": 0, "shards": 1, "mode": "union"}
    changes, torn = checkpoint.read_journal(
        checkpoint.journal_path(checkpoint.path_for(ckpt, 0, 1), 1), config)
    changes = [c for c in changes if c.binding is None]
    assert torn == 0
    assert [c.round for c in changes] == list(range(rounds + 3))
    for c in changes:
        assert (c.indices.tolist(), c.values.tolist()) == expected(c.round)
    server.kill(signal.SIGTERM)
    restarted = start(*args)
    restarted.wait_for(rf"resumed from .*open rounds \{{'job/t': {rounds + 3}\}}")


def test_no_round_fails_its_deadline_while_pushes_are_refused():
    now = [0.0]
    store = ShardStore(2, 0, 1, deadline=1.0, clock=lambda: now[0])

    def push(worker: int, round: int) -> None:
        idx, val = pairs(round)
        store.push(decode_frame(encode_frame(Kind.PUSH, "job/t", 0, 1, round, worker, NUMEL,
                                             idx, val)))

    push(0, 0)
    store.set_unavailable("journal write failed: disk full")
    with pytest.raises(NotDurable, match="disk full"):
        push(1, 0)
    now[0] = 5.0  # far past the deadline, but worker 1 could not push
    store.expire()
    store.set_unavailable(None)
    now[0] = 5.5  # the deadline counts again from here, less what had passed before
    store.expire()
    assert store.failed_rounds == 0
    push(1, 0)
    assert store.closed_rounds == 1 and store.failed_rounds == 0
    push(0, 1)
    now[0] = 7.0
    store.expire()
    assert store.failed_rounds == 1  # once serving, a late worker still fails the round
