"""Worker identity on the parameter server: each (session, worker) is bound to the first
client process that calls for it (by a secret the client draws), another process using
that worker id is refused before its push is read, the binding outlives the client's
reconnects and a server restart from its checkpoint, and it is freed when the session
expires."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from hvd_compress.comm.ps_client import PSClient, PSError
from hvd_compress.ps_protocol import (
    GRPC_PUSH,
    IDENTITY_METADATA,
    WORKER_SECRET_BYTES,
    identity_metadata,
    parse_identity,
)
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server import checkpoint
from ps_server.store import ShardStore, WorkerBound
from tests.servers import start_servers  # noqa: F401 (fixture `start`)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

NUMEL = 1000
BOUND = re.compile(r"worker 1 of session 'job' \(shard 0/1\) is bound to another process, "
                   r"first seen from ipv4:127\.0\.0\.1:\d+ at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
                   r"UTC; this call comes from another process \(ipv4:127\.0\.0\.1:\d+\): two "
                   r"ranks launched with one worker id, or another process using this "
                   r"worker's id\?")


def pairs(round: int, worker: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([round, worker, salt])
    idx = np.sort(rng.choice(NUMEL, 50, replace=False))
    return idx, rng.standard_normal(50).astype(np.float32)


def exact(round: int, workers: dict[int, int]) -> np.ndarray:
    """The dense float32 sum of the pushes of ``workers`` (worker id -> salt), added in
    worker order as the server does."""
    total = np.zeros(NUMEL, np.float32)
    for worker in sorted(workers):
        idx, val = pairs(round, worker, workers[worker])
        total[idx] += val
    return total


def dense(result: tuple[torch.Tensor, torch.Tensor]) -> np.ndarray:
    out = np.zeros(NUMEL, np.float32)
    out[result[0].numpy()] = result[1].numpy()
    return out


def run_round(clients: dict[int, PSClient], tensor: str, round: int,
              salts: dict[int, int] | None = None) -> list[np.ndarray]:
    """Every client's push_pull of ``round`` at once; each one's dense aggregate."""
    salts = salts or dict.fromkeys(clients, 0)
    with ThreadPoolExecutor(len(clients)) as pool:
        jobs = [pool.submit(c.push_pull, tensor, round, NUMEL,
                            *map(torch.from_numpy, pairs(round, w, salts[w])))
                for w, c in clients.items()]
        return [dense(job.result(timeout=90)) for job in jobs]


def assert_exact(results: list[np.ndarray], expected: np.ndarray) -> None:
    for got in results:
        np.testing.assert_array_equal(got, expected)


def impostor_refused(client: PSClient, tensor: str, round: int) -> PSError:
    with pytest.raises(PSError) as err:
        client.push_pull(tensor, round, NUMEL, *map(torch.from_numpy, pairs(round, 1, 99)))
    assert err.value.code == "PERMISSION_DENIED", err.value
    return err.value


def test_a_second_process_with_the_same_worker_id_is_refused(start):
    """Worker 1's id taken by another client in the same session: that client is refused
    with the binding's first peer and time, before its push is read (so it never reaches
    a round, even one the real worker 1 has not pushed yet), and every round of the real
    workers is the exact sum of their own pushes. Another session may use the id."""
    server = start("--workers", "2", "--deadline", "20")
    real = {w: PSClient(server.address, w, workers=2, timeout=30) for w in range(2)}
    impostor = PSClient(server.address, 1, workers=2, timeout=30)
    try:
        assert_exact(run_round(real, "job/w", 0), exact(0, {0: 0, 1: 0}))
        # Round 1: worker 0 has pushed, worker 1 has not; the impostor tries to be it.
        pending = real[0].start("job/w", 1, NUMEL, *map(torch.from_numpy, pairs(1, 0)))
        err = impostor_refused(impostor, "job/w", 1)
        assert BOUND.search(str(err)), str(err)
        assert "give each rank its own worker id" in str(err)
        line = server.wait_for(r"WARNING rejected push from (\S+) before reading it: worker 1 "
                               r"of session 'job'")
        assert BOUND.search(line.string)
        second = PSClient(server.address, 1, workers=2, timeout=30)  # its pull, too
        with pytest.raises(PSError, match="PERMISSION_DENIED"):
            second.finish(second.start("job/other", 0, NUMEL, torch.tensor([1]),
                                       torch.tensor([1.0])))
        second.close()
        one = real[1].push_pull("job/w", 1, NUMEL, *map(torch.from_numpy, pairs(1, 1)))
        expected = exact(1, {0: 0, 1: 0})
        assert_exact([dense(real[0].finish(pending)), dense(one)], expected)
        assert_exact(run_round(real, "job/w", 2), exact(2, {0: 0, 1: 0}))
        # A push without identity, as worker 1 of the session: refused after decoding.
        frame = encode_frame(Kind.PUSH, "job/w", 0, 1, 3, 1, NUMEL, *pairs(3, 1, 99))
        with grpc.insecure_channel(server.address) as channel, \
                pytest.raises(grpc.RpcError) as raw:
            channel.unary_unary(GRPC_PUSH)(frame, timeout=10)
        assert raw.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "this call carries no worker identity" in raw.value.details()
        assert_exact(run_round(real, "job/w", 3), exact(3, {0: 0, 1: 0}))
        # The same worker id in another session is another identity.
        other = {0: real[0], 1: impostor}
        assert_exact(run_round(other, "job2/w", 0, {0: 0, 1: 99}), exact(0, {0: 0, 1: 99}))
    finally:
        for c in (*real.values(), impostor):
            c.close()


def test_bindings_survive_a_restart_from_the_checkpoint(start, tmp_path: Path):
    """SIGKILL the server and restart it on the same port from its checkpoint: the real
    workers, whose clients reconnect with their secrets, go on exactly, and the impostor is
    still refused, even when its call is the first the restarted server gets."""
    args = ["--workers", "2", "--deadline", "20", "--checkpoint-dir", str(tmp_path)]
    server = start(*args)
    real = {w: PSClient(server.address, w, workers=2, timeout=30, retry_timeout=60)
            for w in range(2)}
    impostor = PSClient(server.address, 1, workers=2, timeout=30, retry_timeout=60)
    try:
        assert_exact(run_round(real, "job/w", 0), exact(0, {0: 0, 1: 0}))
        server.kill()
        restarted = start(*args, "--bind", server.address)
        restarted.wait_for(r"resumed from .*open rounds \{'job/w': 1\}")
        err = impostor_refused(impostor, "job/w", 1)
        assert BOUND.search(str(err)), str(err)
        assert_exact(run_round(real, "job/w", 1), exact(1, {0: 0, 1: 0}))
        # A round in flight across a second kill: both workers retry into the new server.
        with ThreadPoolExecutor(1) as pool:
            restarted.kill()
            job = pool.submit(run_round, real, "job/w", 2)
            time.sleep(0.5)
            start(*args, "--bind", server.address)
            assert_exact(job.result(timeout=120), exact(2, {0: 0, 1: 0}))
        impostor_refused(impostor, "job/w", 3)
    finally:
        for c in (*real.values(), impostor):
            c.close()


def test_session_expiry_frees_the_bindings(start):
    """Once a session idles past --idle-timeout, its tensors and its worker bindings go:
    a new process may then be worker 1 of that session (and the old one no longer is)."""
    server = start("--workers", "2", "--deadline", "0.4", "--idle-timeout", "1.5")
    first = {w: PSClient(server.address, w, workers=2, timeout=30) for w in range(2)}
    later = PSClient(server.address, 1, workers=2, timeout=30)
    try:
        assert_exact(run_round(first, "job/w", 0), exact(0, {0: 0, 1: 0}))
        impostor_refused(later, "job/w", 1)
        server.wait_for(r"session 'job' expired after 1\.5 s idle: freed 1 tensor \(\d+ "
                        r"bytes\) and 2 worker bindings", timeout=30)
        now = {0: first[0], 1: later}
        assert_exact(run_round(now, "job/w", 0, {0: 0, 1: 99}), exact(0, {0: 0, 1: 99}))
        with pytest.raises(PSError, match="PERMISSION_DENIED"):
            first[1].push_pull("job/w", 1, NUMEL, *map(torch.from_numpy, pairs(1, 1)))
    finally:
        for c in (*first.values(), later):
            c.close()


def test_bindings_round_trip_through_snapshot_and_journal(tmp_path: Path):
    """The journal holds a binding ahead of the round it took part in and the freeing of
    it at expiry; replayed on the snapshot, the store refuses the same processes as the
    one that wrote them."""
    clock = [0.0]
    store = ShardStore(2, 0, 1, durable=True, idle_timeout=10.0, deadline=1.0,
                       clock=lambda: clock[0])
    keys = {w: parse_identity(identity_metadata("s", w, bytes([w]) * WORKER_SECRET_BYTES)[1])[2]
            for w in range(2)}
    path = checkpoint.path_for(tmp_path, 0, 1)
    checkpoint.save(path, store.snapshot())
    config = {"workers": 2, "shard": 0, "shards": 1, "mode": "union"}
    journal = checkpoint.Journal(checkpoint.journal_path(path, 0), config)
    for w in range(2):
        store.claim("s", w, keys[w], f"peer-{w}")
        idx, val = pairs(0, w)
        store.push(decode_frame(encode_frame(Kind.PUSH, "s/w", 0, 1, 0, w, NUMEL, idx, val)))
    changes, _ = store.take_changes()
    assert [c.binding is not None for c in changes] == [True, True, False]
    journal.append(changes)
    clock[0] = 11.0
    store.claim("t", 0, keys[0], "peer-0")  # another session, still live afterwards
    clock[0] = 22.0
    store.expire()  # "s" idle: tensor and both bindings freed; "t" bound 11 s ago: freed
    journal.append(store.take_changes()[0])
    journal.close()

    def replayed(upto: int | None) -> ShardStore:
        fresh = ShardStore(2, 0, 1, durable=True, idle_timeout=10.0, deadline=1.0)
        fresh.restore(checkpoint.load(path))
        changes, torn = checkpoint.read_journal(checkpoint.journal_path(path, 0), config)
        assert torn == 0
        fresh.replay(changes[:upto])
        return fresh

    middle = replayed(3)
    assert set(middle.bindings) == {("s", 0), ("s", 1)}
    assert middle.bindings["s", 1].peer == "peer-1"
    with pytest.raises(WorkerBound, match="first seen from peer-1"):
        middle.claim("s", 1, keys[0], "elsewhere")
    middle.claim("s", 1, keys[1], "peer-1:reconnected")  # the same process
    assert not replayed(None).bindings
    # And through a snapshot: what the live store holds after the middle replay.
    checkpoint.save(path, middle.snapshot(), 1)
    again = ShardStore(2, 0, 1)
    again.restore(checkpoint.load(path))
    assert {k: (b.key, b.peer) for k, b in again.bindings.items()} == \
        {k: (b.key, b.peer) for k, b in middle.bindings.items()}


def test_a_malformed_identity_is_refused_unread(start):
    server = start("--workers", "1")
    frame = encode_frame(Kind.PUSH, "m/w", 0, 1, 0, 0, NUMEL, *pairs(0, 0))
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(GRPC_PUSH)(frame, timeout=10,
                                       metadata=((IDENTITY_METADATA, b"short"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"must hold a {WORKER_SECRET_BYTES}-byte secret" in err.value.details()
    # A frame for another worker than the identity says is refused after decoding.
    meta = (identity_metadata("m", 1, bytes(WORKER_SECRET_BYTES)),)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(GRPC_PUSH)(frame, timeout=10, metadata=meta)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "but the call's identity is worker 1 of session 'm'" in err.value.details()
