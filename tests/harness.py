"""Run a function on several ranks under ``horovodrun --gloo`` or ``mpirun`` and collect
what each rank returns.

``run_ranks("tests.workers.dense:aggregates", np=2, launcher="mpi")`` starts the ranks with
``python -m tests.rank_main``, which calls ``hvd_compress.torch.init()``, runs the function
with the given keyword arguments and saves its return value with ``torch.save``. The
harness returns the values in rank order, and fails with both ranks' output if a rank
fails or the launch does not finish within ``timeout`` seconds (the whole process group is
killed: a hang becomes a test failure, not a stuck CI run).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from hvd_compress.native import cpu as native_cpu

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LAUNCHERS = ("gloo", "mpi")
ATEN_KERNELS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl",
                                                    "avx512dq"}}
"""The CPU flags each of ATen's x86 kernel sets needs (``ATEN_CPU_CAPABILITY``)."""


def cpu_info() -> tuple[str, set[str]]:
    """This machine's CPU model and the feature flags every core has (``/proc/cpuinfo``,
    read by the library's one reader, :func:`hvd_compress.native.cpu.cpu_info`)."""
    info = native_cpu.cpu_info()
    return info.model, set(info.flags)


def aten_kernels() -> list[str]:
    """The values of ``ATEN_CPU_CAPABILITY`` this CPU can run: ``default`` (no vector
    code) and each x86 vector set whose flags it has. Two implementations compared bit for
    bit under each run ATen's vector kernels as an AVX2-only CPU (AMD EPYC before Zen 4)
    and an AVX-512 one would."""
    flags = cpu_info()[1]
    return ["default", *(name for name, needs in ATEN_KERNELS.items() if needs <= flags)]


LIBRARY_KERNELS = {"avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                   "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512",
                              "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
"""What MKL (torch's matrix products here) and oneDNN read to stay within a vector set: an
AVX2-only CPU runs all three libraries' AVX2 code, which ``ATEN_CPU_CAPABILITY`` alone does
not give."""


def kernel_env(kernels: str) -> dict[str, str]:
    """The environment that makes torch's libraries run ``kernels`` (one of
    :func:`aten_kernels`) as a CPU with only that vector set would."""
    return {"ATEN_CPU_CAPABILITY": kernels, **LIBRARY_KERNELS.get(kernels, {})}


def simd_flags() -> list[str]:
    """The CPU's vector-instruction flags, sorted."""
    pattern = re.compile(r"(sse4_2|avx\w*|fma|f16c|amx\w*|asimd\w*|sve\w*|neon)")
    return sorted(f for f in cpu_info()[1] if pattern.fullmatch(f))


DEFAULT_INDEX = "https://pypi.org/simple/"


@functools.cache
def package_index_unreachable(timeout: float = 3.0) -> str | None:
    """Why ``pip install`` cannot reach its package index (``PIP_INDEX_URL``, else PyPI)
    within ``timeout`` seconds, or None when it answers. A test that installs from the
    index skips with this reason (``needs the network: ...``) instead of failing offline."""
    url = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                    timeout=timeout):
            return None
    except urllib.error.HTTPError as err:
        if err.code < 500:
            return None  # the index answered
        reason: object = err  # a proxy's gateway error: the index is out of reach
    except (OSError, ValueError) as err:
        reason = err
    return f"needs the network: the package index {url} is unreachable ({reason})"


def launch_command(launcher: str, np: int) -> list[str]:
    """The launcher's command line up to (not including) the program to run."""
    if launcher == "gloo":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo"]
    if launcher == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", str(np), "-x", "PYTHONPATH", "-x", "PATH",
                "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
                "--mca", "oob_tcp_if_include", "lo"]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; kill the group on timeout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or rank_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout}s; "
                             f"output:\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_ranks(target: str, np: int = 2, launcher: str = "gloo", timeout: float = 300,
              mpi_servers: int = 0, env: dict[str, str] | None = None,
              **kwargs: Any) -> list[Any]:
    """Run ``module:function(**kwargs)`` on ``np`` ranks; return each rank's result.

    ``mpi_servers`` (``launcher="mpi"`` only) adds that many ``python -m ps_server
    --transport mpi`` ranks to the launch (MPMD) and starts the workers with
    ``HVD_COMPRESS_PS=mpi``. ``env``: variables the ranks get on top of this process's.
    """
    extra = dict(env or {})
    env = {**rank_env(), **extra}
    with tempfile.TemporaryDirectory(prefix="hvdc-ranks-") as out_dir:
        cmd = [*launch_command(launcher, np), sys.executable, "-m", "tests.rank_main",
               out_dir, target, json.dumps(kwargs)]
        if launcher == "mpi":
            for name in extra:
                cmd[cmd.index("-x"):cmd.index("-x")] = ["-x", name]
        if mpi_servers:
            if launcher != "mpi":
                raise ValueError("mpi_servers needs launcher='mpi'")
            env["HVD_COMPRESS_PS"] = "mpi"
            cmd[cmd.index("-x"):cmd.index("-x")] = ["-x", "HVD_COMPRESS_PS"]
            cmd += [":", "-np", str(mpi_servers), sys.executable, "-m", "ps_server",
                    "--transport", "mpi", "--workers", str(np), "--deadline", "60"]
        done = run_command(cmd, timeout, env)
        if done.returncode != 0:
            raise AssertionError(f"{target} on {np} ranks ({launcher}) exited with "
                                 f"{done.returncode}; output:\n{done.stdout[-6000:]}")
        results = []
        for rank in range(np):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                raise AssertionError(f"rank {rank} of {target} wrote no result; output:\n"
                                     f"{done.stdout[-6000:]}")
            results.append(torch.load(path, weights_only=False))
        return results
