"""MPMD launches with parameter-server ranks: the misuse (plain ``hvd.init()``) fails within
seconds instead of blocking for ever, and the documented launches work."""

from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.harness import ROOT, launch_command, rank_env, run_command, run_ranks

SERVER = ["python", "-m", "ps_server", "--transport", "mpi", "--workers", "2"]
WORKER = ["python", "-m", "tests.workers.mpmd_init"]
BINDINGS = ("torch", pytest.param("tensorflow", marks=pytest.mark.tensorflow))

pytestmark = pytest.mark.multiprocess


def mpmd(worker_args: list[str], timeout: float = 240
         ) -> tuple[subprocess.CompletedProcess[str], float]:
    """2 worker ranks and 1 server rank; the completed launch and the time it ended."""
    cmd = [*launch_command("mpi", 2), *WORKER, *worker_args, ":", "-np", "1", *SERVER]
    done = run_command(cmd, timeout)
    return done, time.time()


@pytest.mark.parametrize("binding", BINDINGS)
def test_plain_hvd_init_with_server_ranks_fails_within_seconds(binding: str) -> None:
    done, ended = mpmd(["plain", binding])
    assert done.returncode != 0, done.stdout[-4000:]
    assert "hvd.init returned" not in done.stdout
    assert f"Start Horovod with hvd_compress.{binding}.init(ps='mpi')" in done.stdout, \
        done.stdout[-4000:]
    assert "MPI.COMM_WORLD ranks [2] are parameter servers" in done.stdout
    called = [float(t) for t in re.findall(r"calling hvd.init at ([0-9.]+)", done.stdout)]
    assert len(called) == 2, done.stdout[-4000:]
    # From the first worker's call of hvd.init to the end of the whole job (the servers
    # told to exit, mpirun torn down): seconds, where the unguarded call never returns.
    assert ended - min(called) < 20, f"took {ended - min(called):.1f} s"
    assert "all workers done; exiting" in done.stdout


@pytest.mark.parametrize("binding", BINDINGS)
def test_documented_init_joins_the_servers_and_starts_horovod_on_the_workers(
        binding: str) -> None:
    done, _ = mpmd(["hvdc", binding])
    assert done.returncode == 0, done.stdout[-4000:]
    for rank in (0, 1):
        assert f"size=2 rank={rank} rank_sum=1" in done.stdout, done.stdout[-4000:]


def test_mpmd_world_of_workers_only_still_starts_with_plain_init() -> None:
    cmd = [*launch_command("mpi", 1), *WORKER, "plain", "torch",
           ":", "-np", "1", *WORKER, "plain", "torch"]
    done = run_command(cmd, 120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count("hvd.init returned") == 2


def test_ps_mpi_without_server_ranks_says_which_launch_it_needs() -> None:
    done = run_command([*launch_command("mpi", 2), *WORKER, "hvdc", "torch"], 120)
    assert done.returncode != 0
    assert ("hvd_compress.torch.init(ps='mpi') needs parameter-server ranks in the same "
            "MPMD mpirun, but this mpirun has one app context") in done.stdout, \
        done.stdout[-4000:]


def readme_mpmd_command() -> str:
    """The README's MPMD launch, as written (its backslash-continued lines)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^mpirun [^\n]*\\\n(?:[^\n]*\\\n)*[^\n]*--transport mpi[^\n]*$", text,
                      re.MULTILINE)
    assert match, "no MPMD mpirun command in the README"
    return match.group(0)


def test_readme_mpmd_command_works_as_written() -> None:
    command = readme_mpmd_command()
    assert " : " in command.replace("\\\n", " ")
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=rank_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    final = re.search(r"^topk:ratio=0.01\s+([0-9.]+)%\s+([0-9,]+)\s+([0-9,]+)\s+([0-9.]+)x",
                      proc.stdout, re.MULTILINE)
    assert final, proc.stdout[-4000:]
    assert float(final.group(1)) > 80.0  # 20 epochs of digits
    assert float(final.group(4)) > 10.0  # top-k 1% through the server
    assert "all workers done; exiting" in proc.stdout


@pytest.mark.parametrize("servers", [0, 1])
def test_init_makes_idle_mpi_ranks_yield_their_core(servers: int) -> None:
    """Under ``mpirun``, ranks started by ``hvd_compress.torch.init()`` (with and without
    MPI parameter-server ranks) have Open MPI yield the core while idle, and Horovod's
    10 ms cycle: what Open MPI itself reports through ``MPI_T``."""
    for rank in run_ranks("tests.workers.mpi_settings:open_mpi_settings", launcher="mpi",
                          mpi_servers=servers):
        assert rank == {"yield_when_idle": 1, "cycle_time": "10"}, rank


def test_init_keeps_the_users_open_mpi_settings() -> None:
    ranks = run_ranks("tests.workers.mpi_settings:open_mpi_settings", launcher="mpi",
                      env={"OMPI_MCA_mpi_yield_when_idle": "0", "HOROVOD_CYCLE_TIME": "3"})
    assert ranks == [{"yield_when_idle": 0, "cycle_time": "3"}] * 2, ranks


CONTROLLER_SPECS = ["none", "powersgd:rank=2,start_iter=1", "onebit", "topk:ratio=0.1"]


def test_init_gives_mpirun_ranks_horovods_gloo_controller_by_default() -> None:
    """Under ``mpirun``, ``init()`` starts Horovod's Gloo controller with the MPI ranks
    (two such jobs at once on one host: each rendezvous on a port of its own); a setting
    that needs MPI, or ``controller="horovod"``, keeps the MPI controller; training on the
    default gives the same parameters, bit for bit, as on the MPI controller (2 ranks:
    every sum is one addition)."""
    target = "tests.workers.mpi_settings:horovod_controller"
    envs = [{}, {}, {"HVD_COMPRESS_CONTROLLER": "horovod"},
            {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}]
    with ThreadPoolExecutor(len(envs)) as pool:
        jobs = list(pool.map(lambda env: run_ranks(target, launcher="mpi", env=env), envs))
    for ranks in jobs[:2]:
        for mpi_rank, rank in enumerate(ranks):
            assert rank["chosen"][0] == "gloo", rank
            del rank["chosen"]
            assert rank == {"gloo": True, "mpi": False, "rank": mpi_rank,
                            "mpi_rank": mpi_rank, "size": 2, "local": (mpi_rank, 2),
                            "cross": (0, 1)}, rank
    for ranks, why in zip(jobs[2:], ["controller='horovod'",
                                     "HOROVOD_HIERARCHICAL_ALLGATHER is set"]):
        for rank in ranks:
            assert (rank["gloo"], rank["mpi"]) == (False, True), rank
            assert rank["chosen"][0] == "mpi" and why in rank["chosen"][1], rank
    training = "tests.workers.dense:training"
    with ThreadPoolExecutor(2) as pool:
        on_gloo, on_mpi = pool.map(
            lambda env: run_ranks(training, launcher="mpi", env=env, specs=CONTROLLER_SPECS),
            [{}, {"HVD_COMPRESS_CONTROLLER": "horovod"}])
    for spec in CONTROLLER_SPECS:
        assert torch.equal(on_gloo[0][spec]["params"], on_gloo[1][spec]["params"]), spec
        assert torch.equal(on_gloo[0][spec]["params"], on_mpi[0][spec]["params"]), spec


@pytest.mark.parametrize("binding", BINDINGS)
def test_both_bindings_take_the_gloo_controller_under_mpirun_by_default(binding: str) -> None:
    done = run_command([*launch_command("mpi", 2), *WORKER, "default", binding], 300)
    assert done.returncode == 0, done.stdout[-4000:]
    for rank in (0, 1):
        assert f"size=2 rank={rank} rank_sum=1 controller=gloo" in done.stdout, \
            done.stdout[-4000:]
    assert done.stdout.count("hvd_compress: Horovod runs its Gloo controller") == 1  # rank 0


def test_init_with_mpi_server_ranks_keeps_the_mpi_controller() -> None:
    ranks = run_ranks("tests.workers.mpi_settings:horovod_controller", launcher="mpi",
                      mpi_servers=1)
    for rank in ranks:
        assert (rank["gloo"], rank["mpi"]) == (False, True), rank
        assert rank["chosen"] == ("mpi", "ps='mpi': its servers are MPI ranks"), rank


def test_init_refuses_an_unknown_controller_before_changing_anything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import horovod.torch as hvd

    from hvd_compress.torch import init

    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    started = hvd.is_initialized()  # (another test of this process may have started it)
    with pytest.raises(ValueError,
                       match=r"controller must be one of \('auto', 'horovod', 'gloo'\)"):
        init(controller="nccl")
    assert hvd.is_initialized() == started
    assert "OMPI_MCA_mpi_yield_when_idle" not in os.environ
