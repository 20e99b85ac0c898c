"""The server-side residual of ``--mode topk`` across a SIGKILL between rounds: the data
directory holds it bit for bit, and a server restarted from it answers the next rounds
as one that never stopped (docs/parameter-server.md#choosing-the-mode)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_compress.comm.ps_client import PSClient
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server.service import ShardService
from ps_server.store import ShardStore
from tests.servers import ServerProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

NUMEL, PAIRS, KILLED_AFTER, ROUNDS = 4000, 150, 5, 9


def pushes(round: int, worker: int) -> tuple[np.ndarray, np.ndarray]:
    """Different supports per worker, so the union exceeds k and top-k leaves a residual."""
    rng = np.random.default_rng([round, worker, 23])
    idx = np.sort(rng.choice(NUMEL, PAIRS, replace=False))
    return idx, rng.standard_normal(PAIRS).astype(np.float32)


def reference_after(rounds: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """The aggregates of the first ``rounds`` rounds and the residual after them, from a
    server that never stopped (in-process)."""
    service = ShardService(ShardStore(2, 0, 1, "topk"))
    answers = []
    for r in range(rounds):
        for w in range(2):
            service.push(encode_frame(Kind.PUSH, "t", 0, 1, r, w, NUMEL, *pushes(r, w)), "ref")
        frame = decode_frame(service.pull(encode_frame(Kind.PULL, "t", 0, 1, r, 0, NUMEL),
                                          "ref", 5.0))
        answers.append((frame.indices, frame.values))
    return answers, service.store.tensors["t"].residual.copy()


def residual_in(directory: Path, scratch: Path) -> np.ndarray:
    """The residual a server restored from ``directory`` starts with (read from a copy:
    a restore may compact the files)."""
    shutil.copytree(directory, scratch)
    service = ShardService(ShardStore(2, 0, 1, "topk"), checkpoint_dir=str(scratch))
    service.restore()
    return service.store.tensors["t"].residual


def train(clients: list[PSClient], rounds: range
          ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Both workers push and pull ``rounds``; each worker's aggregates."""

    def worker(client: PSClient) -> list[tuple[np.ndarray, np.ndarray]]:
        got = []
        for r in rounds:
            idx, val = client.push_pull("t", r, NUMEL, *map(torch.from_numpy,
                                                            pushes(r, client.worker)))
            got.append((idx.numpy(), val.numpy()))
        return got

    with ThreadPoolExecutor(2) as pool:
        return [job.result(timeout=120) for job in [pool.submit(worker, c) for c in clients]]


def test_a_server_killed_between_rounds_resumes_its_residual_exactly(tmp_path):
    data = tmp_path / "data"
    args = ["--workers", "2", "--mode", "topk", "--deadline", "60", "--checkpoint-dir",
            str(data), "--checkpoint-every", "3"]  # a snapshot, then rounds in the journal
    expected, residual_at_kill = reference_after(KILLED_AFTER)
    everything, residual_at_end = reference_after(ROUNDS)
    assert np.count_nonzero(residual_at_kill) > PAIRS  # there is a residual to lose
    servers = [ServerProcess(["--bind", "127.0.0.1:0", *args])]
    # The same two workers throughout, as a job's ranks: they retry while it is down.
    clients = [PSClient(servers[0].address, w, timeout=60, retry_timeout=60, workers=2)
               for w in range(2)]
    try:
        before = train(clients, range(KILLED_AFTER))
        servers[0].kill()  # SIGKILL between rounds: no final snapshot
        assert servers[0].proc.returncode == -9
        restored = residual_in(data, tmp_path / "copy-at-kill")
        assert restored.dtype == residual_at_kill.dtype
        assert restored.tobytes() == residual_at_kill.tobytes()
        servers.append(ServerProcess(["--bind", servers[0].address, *args]))
        servers[1].wait_for(r"resumed from .*open rounds \{'t': 5\}")
        after = train(clients, range(KILLED_AFTER, ROUNDS))
        servers[1].kill(15)  # SIGTERM: a final snapshot
        assert servers[1].proc.returncode == 0
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.kill()
    for got, want in ((before, expected), (after, everything[KILLED_AFTER:])):
        for worker in got:
            assert len(worker) == len(want)
            for (idx, val), (want_idx, want_val) in zip(worker, want):
                np.testing.assert_array_equal(idx, want_idx)
                assert val.dtype == want_val.dtype == np.float32
                assert val.tobytes() == want_val.tobytes()  # bit for bit
    final = residual_in(data, tmp_path / "copy-at-end")
    assert final.tobytes() == residual_at_end.tobytes()
