"""Starting the benchmarks' own processes: their environment, and ``mpirun`` launches that
cannot hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout the benchmark runs from; its processes import this package from there."""


def process_env() -> dict[str, str]:
    """This environment, with this checkout on ``PYTHONPATH``, this interpreter's directory
    first on ``PATH``, one OpenMP thread per process and TensorFlow's logging off."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


MPIRUN = ("mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "TF_CPP_MIN_LOG_LEVEL")
"""``mpirun`` with the variables of :func:`process_env` passed to every rank."""


def run_mpirun(args: Sequence[str], timeout: int, log: Path) -> int:
    """Run ``MPIRUN --timeout timeout --report-state-on-timeout *args`` from the checkout,
    output to ``log``; return its exit code.

    Past ``timeout`` seconds ``mpirun`` aborts the job and prints the state of its daemons
    and ranks (exit code 110). If ``mpirun`` itself has not ended 30 s later, its process
    group is killed.
    """
    cmd = [*MPIRUN, "--timeout", str(timeout), "--report-state-on-timeout", *args]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=process_env(), cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
