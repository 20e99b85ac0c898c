"""The parameter server's MPI transport under an MPMD mpirun (workers : servers).

The test launches this file itself as the worker program::

    mpirun -np 2 python tests/test_ps_mpi.py : -np 2 python -m ps_server --transport mpi ...
"""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest

from tests.harness import ROOT, rank_env, run_command

WORKERS, SERVERS, NUMEL = 2, 2, 5000


def pushes(round: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.random.default_rng([round, w]).choice(NUMEL, 200, replace=False),
             np.random.default_rng([round, w, 1]).standard_normal(200).astype(np.float32))
            for w in range(WORKERS)]


def worker_main() -> None:
    import horovod.torch as hvd
    import torch

    from hvd_compress.comm.ps_client import MPIPSClient

    client = MPIPSClient(value_dtype="fp32")
    hvd.init(comm=client.comm)
    assert hvd.size() == WORKERS and hvd.rank() == client.worker
    for round in range(3):
        mine = pushes(round)[client.worker]
        idx, val = client.push_pull("mpi.w", round, NUMEL, torch.from_numpy(mine[0]),
                                    torch.from_numpy(mine[1]))
        expected = torch.zeros(NUMEL)
        for i, v in pushes(round):
            expected[i] += torch.from_numpy(v)
        got = torch.zeros(NUMEL)
        got[idx] = val
        torch.testing.assert_close(got, expected)
        # Horovod among the workers alone, beside the server traffic.
        total = hvd.allreduce(torch.tensor([float(len(idx))]), op=hvd.Sum)
        assert total.item() == WORKERS * len(idx)
    client.close()
    print(f"worker {client.worker} OK", flush=True)


def mismatch_main() -> None:
    """A worker of a job whose server expects another worker count: constructing the
    client must fail at once with the error naming both counts."""
    from hvd_compress.comm.ps_client import MPIPSClient

    try:
        MPIPSClient(value_dtype="fp32")
    except ValueError as err:
        print(f"worker refused: {err}", flush=True)
        sys.exit(3)
    print("worker was not refused", flush=True)


MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
       "-x", "PYTHONPATH", "-x", "PATH", "-x", "OMP_NUM_THREADS",
       "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
       "--mca", "oob_tcp_if_include", "lo"]
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@needs_mpirun
def test_a_wrong_worker_count_fails_at_once_on_every_rank():
    """Two worker ranks, a server started with --workers 3: both workers and the server
    stop with the same error naming 2 and 3 (the test's timeout bounds "at once": nothing
    waits for a deadline)."""
    cmd = [*MPI, "-np", str(WORKERS), sys.executable, str(ROOT / "tests/test_ps_mpi.py"),
           "mismatch", ":", "-np", "1", sys.executable, "-m", "ps_server", "--transport",
           "mpi", "--workers", "3", "--deadline", "600"]
    done = run_command(cmd, timeout=150, env=rank_env())
    assert done.returncode != 0, done.stdout[-6000:]
    words = "the job has 2 workers but this server was started with --workers 3"
    assert done.stdout.count(f"worker refused: MPI server shard 0 (world rank 2): {words}") \
        == WORKERS, done.stdout[-6000:]
    assert f"hvd-ps-server: MPI server shard 0 (world rank 2): {words}" in done.stdout, \
        done.stdout[-6000:]
    assert "worker was not refused" not in done.stdout


@pytest.mark.multiprocess
@pytest.mark.smoke  # the fast tier's launch of the server over MPI
@pytest.mark.timeout(180)
@needs_mpirun
def test_mpi_transport_two_workers_two_shards():
    cmd = [*MPI, "-np", str(WORKERS), sys.executable, str(ROOT / "tests/test_ps_mpi.py"), ":",
           "-np", str(SERVERS), sys.executable, "-m", "ps_server", "--transport", "mpi",
           "--workers", str(WORKERS), "--deadline", "30"]
    done = run_command(cmd, timeout=150, env=rank_env())
    assert done.returncode == 0, done.stdout[-6000:]
    for w in range(WORKERS):
        assert f"worker {w} OK" in done.stdout, done.stdout[-6000:]
    assert "serving shard 1/2 over MPI" in done.stdout
    assert "all workers done; exiting" in done.stdout


if __name__ == "__main__":
    mismatch_main() if sys.argv[1:] == ["mismatch"] else worker_main()
