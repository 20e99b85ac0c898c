"""Parameter-server processes for tests: ``python -m ps_server`` with its log collected."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.harness import ROOT

READY = re.compile(r"serving shard (\d+)/(\d+) on [^:]+:(\d+)")


class ServerProcess:
    """``python -m ps_server ...`` whose log lines are collected in ``self.lines``."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 60.0, launcher: list[str] | None = None) -> None:
        self.args = args
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
        launcher = launcher or [sys.executable, "-m", "ps_server"]  # or a wrapper of it
        self.proc = subprocess.Popen([*launcher, *args], cwd=ROOT,
                                     env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_for(READY, timeout).group(3))
        self.address = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float = 20.0) -> re.Match[str]:
        """The first log line (from now or already seen) matching ``pattern``."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        for line in self.lines:
            if match := pattern.search(line):
                return match
        give_up = time.monotonic() + timeout
        while (left := give_up - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"server exited ({self.proc.wait()}) before logging "
                                     f"{pattern.pattern!r}:\n" + self.log())
            self.lines.append(line)
            if match := pattern.search(line):
                return match
        raise AssertionError(f"no log line matching {pattern.pattern!r} within {timeout} s:\n"
                             + self.log())

    def log(self) -> str:
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return "\n".join(self.lines)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=20)


@pytest.fixture(name="start")
def start_servers() -> Iterator[Callable[..., ServerProcess]]:
    """Start servers (``start(*args, env=...)``, on a free port) that are killed at
    teardown, whatever happens. Test modules import it to use it as a fixture."""
    started: list[ServerProcess] = []

    def run(*args: str, **kw: object) -> ServerProcess:
        server = ServerProcess(["--bind", "127.0.0.1:0", *args], **kw)
        started.append(server)
        return server

    yield run
    for server in started:
        server.kill()
