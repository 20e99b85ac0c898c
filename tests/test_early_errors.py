"""Mistakes in arguments fail when they are made, with a message that says what to give:
``ps=`` addresses, ``compression=`` values, the server's files. One process each."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch

from hvd_compress import Compression
from hvd_compress.binding import resolve_compression, resolve_ps
from hvd_compress.comm.parameter_server import check_spec, connect
from hvd_compress.comm.ps_client import PSClient, parse_addresses
from hvd_compress.ps_protocol import PS_ENV
from hvd_compress.torch import DistributedOptimizer
from ps_server.__main__ import parse_args
from tests.harness import ROOT, rank_env

FORMS = "accepted forms: 'grpc://host:port[,host:port...]'"


@pytest.mark.parametrize(("spec", "bad", "problem"), [
    ("http://host:7070", "http://host:7070", "'http://' is not supported"),
    ("grpc://host:notaport", "grpc://host:notaport", "the port 'notaport' is not a number"),
    ("grpc://a:7070,b:x", "b:x", "the port 'x' is not a number"),
    ("grpc://host:70700", "grpc://host:70700", "the port 70700 is not in 1..65535"),
    ("grpc://host", "grpc://host", "it has no port"),
    ("grpc://:7070", "grpc://:7070", "it has no host"),
    ("grpc://a:7070,", "", "the address is empty"),
    ("grpc://::1:7070", "grpc://::1:7070", "an IPv6 host goes in brackets, [::1]:7070"),
    ("grpc://ho st:7070", "grpc://ho st:7070", "the host 'ho st' is not a host name"),
    ("grpc://host:7070/ps", "grpc://host:7070/ps", "the port '7070/ps' is not a number"),
])
def test_bad_ps_address_names_it_and_the_accepted_forms(spec: str, bad: str,
                                                        problem: str) -> None:
    with pytest.raises(ValueError) as err:
        check_spec(spec)
    message = str(err.value)
    assert f"invalid parameter server address {bad!r} in ps={spec!r}: {problem}" in message
    assert FORMS in message and "'grpcs://host:port" in message and "'mpi'" in message


def test_ps_addresses_mixed_or_repeated_are_refused() -> None:
    with pytest.raises(ValueError, match="mixes grpc:// and grpcs://"):
        check_spec("grpc://a:1,grpcs://b:2")
    with pytest.raises(ValueError, match="'a:1' is listed twice"):
        check_spec("grpc://a:1,a:1")
    with pytest.raises(TypeError, match="ps must be a string"):
        check_spec(["grpc://a:1"])  # type: ignore[arg-type]


def test_accepted_ps_forms() -> None:
    assert check_spec(" MPI ") == "mpi"
    assert check_spec("grpc://a:7070,b.example.com:7071") == "grpc://a:7070,b.example.com:7071"
    assert parse_addresses("grpc://a:7070,b.example.com:7071") == (
        ["a:7070", "b.example.com:7071"], False)
    assert parse_addresses("grpcs://10.0.0.1:7070,grpcs://[::1]:7071") == (
        ["10.0.0.1:7070", "[::1]:7071"], True)
    assert parse_addresses(["127.0.0.1:5000", "localhost:5001"]) == (
        ["127.0.0.1:5000", "localhost:5001"], False)
    client = PSClient("grpc://127.0.0.1:7070", 0)  # channels connect lazily
    assert client.addresses == ["127.0.0.1:7070"]
    client.close()


def test_connect_and_the_client_refuse_a_bad_address() -> None:
    with pytest.raises(ValueError, match="'http://' is not supported"):
        connect("http://host:7070", 0)
    with pytest.raises(ValueError, match="the port 'p' is not a number"):
        PSClient("grpc://host:p", 0)


def _model_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)


def test_optimizer_refuses_a_bad_ps_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any collective or connection: no ``hvd.init()`` is needed to see it."""
    _model_optimizer()  # torch's first optimizer takes seconds to set up under load
    start = time.monotonic()
    with pytest.raises(ValueError, match="'grpc://host:notaport' in ps="):
        DistributedOptimizer(_model_optimizer(), ps="grpc://host:notaport")
    monkeypatch.setenv(PS_ENV, "http://host:7070")
    with pytest.raises(ValueError, match=r"'http://host:7070' in \$HVD_COMPRESS_PS="):
        DistributedOptimizer(_model_optimizer())
    assert time.monotonic() - start < 5
    assert resolve_ps("") is None  # ps="" turns the environment's servers off
    monkeypatch.setenv(PS_ENV, " mpi ")
    assert resolve_ps(None) == "mpi"
    monkeypatch.delenv(PS_ENV)
    assert resolve_ps(None) is None
    assert resolve_ps("grpcs://h:1,h:2") == "grpcs://h:1,h:2"


def test_horovods_own_compressors_mean_ours() -> None:
    for framework in ("torch", "tensorflow"):
        assert resolve_compression(None, framework) is Compression.none
        scheme = Compression.qsgd(bits=4)
        assert resolve_compression(scheme, framework) is scheme
        assert resolve_compression(Compression.fp16(), framework) is Compression.fp16
    assert resolve_compression(hvd.Compression.fp16, "torch") is Compression.fp16
    assert resolve_compression(hvd.Compression.none, "torch") is Compression.none
    assert resolve_compression(hvd.Compression.fp16(), "torch") is Compression.fp16
    assert resolve_compression(hvd.Compression.none(), "torch") is Compression.none


def test_the_other_frameworks_horovod_compressor_is_refused_saying_which_to_pass() -> None:
    """horovod.torch's compressor on the TensorFlow binding (its class compared by module
    and name, so TensorFlow is not imported here)."""
    with pytest.raises(TypeError) as err:
        resolve_compression(hvd.Compression.fp16, "tensorflow")
    assert str(err.value).endswith(
        "(hvd = horovod.tensorflow); got horovod.torch.Compression.fp16, the compressor of "
        "Horovod's torch library: pass horovod.tensorflow.Compression.fp16 or "
        "Compression.fp16"), err.value


@pytest.mark.parametrize(("value", "detail"), [
    ("fp16", "got the string 'fp16': use Compression.parse('fp16')"),
    (Compression.qsgd, "got the class QSGD itself: call it with its options, e.g. "
                       "Compression.qsgd()"),
    (hvd.Compression, "got the class horovod.torch.compression.Compression"),
    (3, "got an instance of builtins.int"),
])
def test_anything_else_as_compression_says_what_is_accepted(value: object, detail: str) -> None:
    with pytest.raises(TypeError) as err:
        DistributedOptimizer(_model_optimizer(), compression=value)
    message = str(err.value)
    assert message.startswith("compression must be a scheme of hvd_compress.Compression")
    assert ("or Horovod's own hvd.Compression.none or hvd.Compression.fp16 (hvd = "
            "horovod.torch)") in message
    assert detail in message, message


SIZE_ONE = """
import horovod.torch as hvd, torch
from hvd_compress import Compression
from hvd_compress.binding import resolve_compression, resolve_ps
from hvd_compress.torch import DistributedOptimizer
hvd.init()
for given, meant in ((hvd.Compression.fp16, Compression.fp16),
                     (hvd.Compression.none, Compression.none),
                     (Compression.fp16(), Compression.fp16)):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), compression=given)
    assert opt._pipeline.scheme is meant, opt._pipeline.scheme
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    grad = model.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.5 * grad, rtol=1e-3, atol=1e-3)
for ps in ("grpc://127.0.0.1:7070,127.0.0.1:7071", "grpcs://localhost:7070"):
    model = torch.nn.Linear(4, 2)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), ps=ps)
print("OK")
"""


@pytest.mark.multiprocess
def test_horovods_compressors_and_valid_ps_construct_and_step_on_one_process() -> None:
    """``hvd.init()`` at size 1 in a fresh interpreter (not this one)."""
    env = rank_env()
    env.pop(PS_ENV, None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SIZE_ONE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("option", ["--token-file", "--tls-cert"])
def test_server_missing_file_is_a_usage_error(option: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    extra = ["--tls-key", str(tmp_path / "nope.key")] if option == "--tls-cert" else []
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--workers", "2", option, str(missing), *extra])
    assert exit_.value.code == 2
    assert f"hvd-ps-server: error: {option} {missing}: no such file" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_server_token_file_problems_exit_2_without_traceback(tmp_path: Path) -> None:
    empty, directory = tmp_path / "empty", tmp_path / "dir"
    empty.write_text("\n")
    directory.mkdir()
    cases = [(tmp_path / "missing", "no such file"), (empty, "is empty"),
             (directory, "not a regular file")]
    for path, problem in cases:
        done = subprocess.run([sys.executable, "-m", "ps_server", "--workers", "1",
                               "--bind", "127.0.0.1:0", "--token-file", str(path)],
                              cwd=ROOT, env=rank_env(), capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, (path, done.stderr)
        assert "Traceback" not in done.stderr
        assert f"error: --token-file {path}" in done.stderr and problem in done.stderr, \
            done.stderr


@pytest.mark.parametrize("which", ["--tls-cert", "--tls-key"])
def test_server_refuses_empty_or_non_pem_tls_files(which: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pem = tmp_path / "good.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    for content, problem in (("", "is empty"), ("\n \n", "is empty"),
                             ("not a certificate", "is not PEM")):
        bad = tmp_path / "bad.pem"
        bad.write_text(content)
        files = {"--tls-cert": pem, "--tls-key": pem, which: bad}
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--workers", "2", *(f"{k}={v}" for k, v in files.items())])
        assert exit_.value.code == 2
        assert f"error: {which} {bad}: {problem}" in capsys.readouterr().err


UNREACHED = """
import socket, time
import horovod.torch as hvd, torch
from hvd_compress import Compression
from hvd_compress.binding import resolve_compression, resolve_ps
from hvd_compress.torch import DistributedOptimizer
hvd.init()
with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
model = torch.nn.Linear(64, 64)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                           named_parameters=model.named_parameters(),
                           compression=Compression.topk(ratio=0.01),
                           ps=f"grpc://127.0.0.1:{port}", connect_timeout=0.5)
model(torch.ones(2, 64)).sum().backward()
started = time.monotonic()
try:
    opt.step()
except Exception as exc:
    print(f"FAILED {time.monotonic() - started:.2f} {port} {type(exc).__name__}: {exc}")
"""


@pytest.mark.multiprocess
def test_connect_timeout_of_the_optimizer_fails_a_server_never_reached_within_it() -> None:
    """``connect_timeout=0.5``: the first step against a port nothing listens on fails
    within seconds (not the 60 s of retries), naming the address."""
    env = rank_env()
    env.pop(PS_ENV, None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(UNREACHED)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("FAILED")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    _, elapsed, port, message = line.split(" ", 3)
    assert float(elapsed) < 5, line
    assert f"127.0.0.1:{port}" in message, line


@pytest.mark.parametrize("value", [0, -1.0])
def test_connect_timeout_must_be_positive(value: float) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="connect_timeout must be > 0"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ps="grpc://h:1",
                             connect_timeout=value)
