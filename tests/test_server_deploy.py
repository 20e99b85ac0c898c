"""The server as deployed: without torch, configured from the environment, stopped by
SIGTERM, observed through Prometheus, described by ``--help`` and ``--version``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hvd_compress import __version__
from hvd_compress.ps_protocol import GRPC_PUSH, token_metadata
from ps_server import checkpoint
from tests import torch_free_client as client
from tests.harness import ROOT
from tests.servers import ServerProcess

BLOCKED = [sys.executable, str(ROOT / "tests" / "frameworks_blocked.py")]

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def start():
    """Start servers that are killed at teardown, whatever happens."""
    started: list[ServerProcess] = []

    def run(*args: str, **kw: object) -> ServerProcess:
        server = ServerProcess(list(args), **kw)
        started.append(server)
        return server

    yield run
    for server in started:
        server.kill()


def _run_blocked(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([*BLOCKED, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def test_blocker_really_blocks_torch():
    result = _run_blocked("hvd_compress.compression")
    assert result.returncode != 0 and "torch is blocked" in result.stderr


def test_server_serves_a_round_without_torch_tensorflow_or_horovod(start):
    server = start("--workers", "2", "--bind", "127.0.0.1:0", "--metrics-port", "0",
                   launcher=[*BLOCKED, "ps_server"])
    result = _run_blocked("tests.torch_free_client", server.address, "2")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["frameworks"] == [] and reply["health"] == "SERVING"
    want = client.expected(2)
    assert reply["indices"] == sorted(want)
    assert reply["values"] == [want[i] for i in sorted(want)]
    assert server.proc.poll() is None  # still serving
    server.wait_for(r"metrics at http://")


def test_metrics_scraped(start, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    server = start("--workers", "2", "--bind", "127.0.0.1:0", "--metrics-port", "0",
                   "--token-file", str(tmp_path / "token"))
    port = int(server.wait_for(r"metrics at http://[^:]+:(\d+)/metrics").group(1))
    sizes = []
    for r in range(3):
        indices, values, sent = client.run_round(server.address, 2, token="s3cret", round=r)
        sizes += sent
        want = client.expected(2)
        assert indices.tolist() == sorted(want)
        assert values.tolist() == [want[i] for i in sorted(want)]
    stale = client.encode_frame(client.Kind.PUSH, "t", 0, 1, 0, 0, client.NUMEL,
                                *client.pairs(0))
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError, match="stale"):  # rounds 0..2 are closed
            channel.unary_unary(GRPC_PUSH)(stale, timeout=30,
                                           metadata=token_metadata("s3cret"))
        with pytest.raises(grpc.RpcError) as refused:  # refused before the body is read
            channel.unary_unary(GRPC_PUSH)(stale, timeout=30)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "shard"))):
               s.value for family in text_string_to_metric_families(text)
               for s in family.samples}
    assert all('shard="0/1"' in line for line in text.splitlines()
               if line and not line.startswith("#"))
    assert samples[("hvd_ps_rounds_closed_total", ())] == 3
    assert samples[("hvd_ps_pushes_total", (("outcome", "accepted"),))] == 6
    assert samples[("hvd_ps_rejected_requests_total",
                    (("method", "push"), ("reason", "stale_round")))] == 1
    assert samples[("hvd_ps_rejected_requests_total",
                    (("method", "any"), ("reason", "unauthenticated")))] == 1
    # bytes in: the 12 frames above plus the stale push that was refused
    assert samples[("hvd_ps_received_bytes_total", ())] == sum(sizes) + len(stale)
    assert samples[("hvd_ps_sent_bytes_total", ())] > 0
    assert samples[("hvd_ps_round_latency_seconds_count", ())] == 3
    assert samples[("hvd_ps_push_to_close_seconds_count", ())] == 6
    # every push waits at least until the round's last push, at most the whole test
    assert 0 < samples[("hvd_ps_push_to_close_seconds_sum", ())] < 60
    assert samples[("hvd_ps_round_latency_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("hvd_ps_open_round", (("tensor", "t"),))] == 3
    assert samples[("hvd_ps_open_sessions", ())] == 1
    # the last aggregate of 5 pairs is held: int64 indices, float32 values at least
    assert samples[("hvd_ps_held_bytes", ())] >= 5 * (8 + 4)


def test_flags_from_environment_and_sigterm_writes_a_final_checkpoint(start, tmp_path):
    env = {"HVD_PS_WORKERS": "2", "HVD_PS_BIND": "127.0.0.1:0", "HVD_PS_MODE": "union",
           "HVD_PS_CHECKPOINT_DIR": str(tmp_path), "HVD_PS_DEADLINE": "30",
           "HVD_PS_LOG_LEVEL": "INFO"}
    server = start(env=env)
    server.wait_for(r"2 workers, mode union, deadline 30 s, checkpoints " + str(tmp_path))
    client.run_round(server.address, 2, tensor="w", round=0)
    indices, values, _ = client.run_round(server.address, 2, tensor="w", round=1)
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()
    server.wait_for(r"received SIGTERM: stopping")
    server.wait_for(r"stopped: 2 rounds closed")
    snapshot = checkpoint.load(checkpoint.path_for(tmp_path, 0, 1))
    assert snapshot is not None and snapshot["tensors"]["w"]["round"] == 2
    last = snapshot["tensors"]["w"]["last"]
    assert last["round"] == 1
    np.testing.assert_array_equal(last["indices"], indices)
    np.testing.assert_array_equal(last["values"], values)
    # the command line wins over the environment
    override = start("--workers", "3", "--checkpoint-dir", str(tmp_path / "other"), env=env)
    override.wait_for(r"3 workers, mode union")


def test_bad_environment_value_names_the_variable():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HVD_PS_WORKERS="two")
    result = subprocess.run([sys.executable, "-m", "ps_server"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "$HVD_PS_WORKERS='two'" in result.stderr


def test_version_and_help_show_defaults_and_environment():
    run = [sys.executable, "-m", "ps_server"]
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"hvd-ps-server {__version__}"
    text = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, COLUMNS="400")).stdout
    for flag, default in (("--deadline", "120.0"), ("--bind", "127.0.0.1:7070"),
                          ("--max-message-mb", "256"), ("--threads", "64"),
                          ("--mode", "union"), ("--transport", "grpc")):
        env = "HVD_PS_" + flag[2:].upper().replace("-", "_")
        pattern = rf"\n  {flag}\b[^\[]*\[env {env}; default {re.escape(default)}\]"
        assert re.search(pattern, text), (flag, text)


@pytest.mark.usefixtures("package_index")
def test_pip_install_into_a_fresh_venv_gives_a_working_server(tmp_path):
    """``pip install .[server]`` into a new environment (no torch): the wheel carries the
    compiled kernels, and its ``hvd-ps-server`` serves a round."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{ROOT}[server]"],
                             capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], env=env, cwd=tmp_path,
                          capture_output=True).returncode != 0  # torch is not installed
    native = subprocess.run([python, "-W", "error::RuntimeWarning", "-m",
                             "hvd_compress.native"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert native.returncode == 0, native.stderr
    assert native.stdout.startswith(str(venv)) and "_kernels" in native.stdout
    proc = subprocess.Popen([str(venv / "bin" / "hvd-ps-server"), "--workers", "2", "--bind",
                             "127.0.0.1:0"], env=env, cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stderr:
            if match := re.search(r"serving shard 0/1 on 127\.0\.0\.1:(\d+)", line):
                break
        else:
            raise AssertionError(f"the installed server exited with {proc.wait()}")
        indices, values, _ = client.run_round(f"127.0.0.1:{match.group(1)}", 2)
        want = client.expected(2)
        assert indices.tolist() == sorted(want)
        assert values.tolist() == [want[i] for i in sorted(want)]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
