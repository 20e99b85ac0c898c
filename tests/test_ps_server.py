"""The parameter server as a subprocess, reached by PSClient over gRPC."""

from __future__ import annotations

import struct
import subprocess
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from hvd_compress.comm.ps_client import GRPC_SERVICE, PSClient, PSError, shard_bounds
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from tests.servers import ServerProcess, start_servers  # noqa: F401 (fixture `start`)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
TOKEN = "t0ken-for-tests"
WORKERS = 3
NUMEL = 10_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two shards for three workers: token, 3 s deadline, 1 MB messages, metrics on 0."""
    token_file = tmp_path_factory.mktemp("ps") / "token"
    token_file.write_text(TOKEN + "\n")
    servers = []
    try:
        for shard in range(2):
            extra = ["--metrics-port", "0"] if shard == 0 else []
            servers.append(ServerProcess(
                ["--bind", "127.0.0.1:0", "--workers", str(WORKERS), "--shard", f"{shard}/2",
                 "--deadline", "3", "--token-file", str(token_file), "--max-message-mb", "1",
                 *extra]))
        yield servers
    finally:
        for server in servers:
            server.kill()


def clients(servers, dtype: str = "fp32", token: str = TOKEN, **kw) -> list[PSClient]:
    spec = "grpc://" + ",".join(s.address for s in servers)
    return [PSClient(spec, w, token=token, value_dtype=dtype, timeout=20, retry_timeout=20,
                     **kw) for w in range(WORKERS)]


def run_round(workers: list[PSClient], tensor: str, round: int, pushes, numel: int = NUMEL,
              only=None):
    only = range(len(workers)) if only is None else only
    with ThreadPoolExecutor(len(workers)) as pool:
        jobs = [pool.submit(workers[w].push_pull, tensor, round, numel,
                            torch.from_numpy(pushes[w][0]), torch.from_numpy(pushes[w][1]))
                for w in only]
        return [job.result(timeout=60) for job in jobs]


def random_pushes(seed: int, k: int = 500, numel: int = NUMEL):
    rng = np.random.default_rng(seed)
    return [(rng.choice(numel // 2, k, replace=False),  # unsorted, overlapping supports
             rng.standard_normal(k).astype(np.float32)) for _ in range(WORKERS)]


def exact_sum(pushes, dtype, numel: int = NUMEL):
    total = torch.zeros(numel, dtype=torch.float32)
    support = torch.zeros(numel, dtype=torch.bool)
    for idx, val in pushes:
        total[idx] += torch.from_numpy(val).to(dtype).float()
        support[idx] = True
    return total, support


# fp32: the fast tier's smoke launch of the server over gRPC.
@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.smoke), "fp16"])
def test_aggregate_is_exact_sum_over_two_shards(cluster, dtype):
    workers = clients(cluster, dtype)
    for round in range(2):
        pushes = random_pushes(round)
        results = run_round(workers, f"w.{dtype}", round, pushes)
        total, support = exact_sum(pushes, torch.float16 if dtype == "fp16" else torch.float32)
        for idx, val in results:
            assert torch.equal(idx, support.nonzero().flatten())
            expected = total[idx].half().float() if dtype == "fp16" else total[idx]
            torch.testing.assert_close(val, expected, rtol=1e-6, atol=1e-6)
    assert [c.health() for c in workers[:1]] == [["SERVING", "SERVING"]]
    for c in workers:
        c.close()


def _raw(server, method: str, data: bytes, token: str | None = TOKEN) -> bytes:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(f"/{GRPC_SERVICE}/{method}")
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return call(data, metadata=metadata, timeout=10)


def _push(worker, round, idx, val, tensor="raw", numel=None, shard=0):
    numel = numel if numel is not None else shard_bounds(NUMEL, 2)[1]
    return encode_frame(Kind.PUSH, tensor, shard, 2, round, worker, numel, np.array(idx),
                        np.array(val, np.float32))


def test_conflicting_push_fails_the_round_for_both_senders(cluster):
    server = cluster[0]
    assert _raw(server, "Push", _push(0, 0, [1], [1.0], "conflict")) == b"accepted"
    with pytest.raises(grpc.RpcError) as second:
        _raw(server, "Push", _push(0, 0, [1], [100.0], "conflict"))
    assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "worker 0 pushed twice with different content" in second.value.details()
    pull = encode_frame(Kind.PULL, "conflict", 0, 2, 0, 0, shard_bounds(NUMEL, 2)[1])
    with pytest.raises(grpc.RpcError) as first:
        _raw(server, "Pull", pull)
    assert first.value.code() == grpc.StatusCode.ABORTED
    assert "worker 0 pushed twice" in first.value.details()
    line = server.wait_for(r"WARNING rejected push from ipv4:127\.0\.0\.1:\d+: .*conflict")
    assert "first from ipv4:127.0.0.1:" in line.string


def test_retransmission_ignored_stale_and_future_rejected(cluster):
    server = cluster[0]
    assert _raw(server, "Push", _push(0, 0, [1], [1.0], "dup")) == b"accepted"
    assert _raw(server, "Push", _push(0, 0, [1], [1.0], "dup")) == b"duplicate"
    with pytest.raises(grpc.RpcError) as future:
        _raw(server, "Push", _push(1, 1, [1], [1.0], "dup"))
    assert future.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ahead of the server, which is at round 0" in future.value.details()
    for w in (1, 2):
        _raw(server, "Push", _push(w, 0, [1], [1.0], "dup"))
    pull = encode_frame(Kind.PULL, "dup", 0, 2, 0, 0, shard_bounds(NUMEL, 2)[1])
    result = decode_frame(_raw(server, "Pull", pull))
    assert result.indices.tolist() == [1] and result.values.tolist() == [3.0]
    for w in range(3):
        _raw(server, "Push", _push(w, 1, [2], [1.0], "dup"))
    with pytest.raises(grpc.RpcError) as stale:
        _raw(server, "Push", _push(0, 0, [1], [1.0], "dup"))
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is stale: the server is at round 2" in stale.value.details()


def test_missing_worker_fails_within_deadline_naming_it(cluster):
    workers = clients(cluster)
    pushes = random_pushes(5)
    start = time.monotonic()
    with pytest.raises(PSError) as err:
        run_round(workers, "late", 0, pushes, only=[0, 1])
    assert time.monotonic() - start < 10
    assert err.value.code == "ABORTED" and err.value.round == 0
    assert "worker 2 did not push within the 3 s deadline" in str(err.value)
    cluster[0].wait_for("worker 2 did not push")
    # The server keeps serving: round 1 with every worker works.
    run_round(workers, "late", 1, random_pushes(6))
    for c in workers:
        c.close()


def test_token_is_required(cluster):
    with pytest.raises(grpc.RpcError) as missing:
        _raw(cluster[0], "Push", _push(0, 0, [1], [1.0], "auth"), token=None)
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = PSClient([s.address for s in cluster], 0, token="wrong", retry_timeout=2)
    with pytest.raises(PSError, match="UNAUTHENTICATED: missing or wrong token"):
        client.push_pull("auth", 0, NUMEL, torch.tensor([1]), torch.tensor([1.0]))
    client.close()


def _bad_frames():
    good = _push(1, 0, [1, 7], [1.0, 2.0], "bad")
    body = bytearray(good[:-4])
    yield "truncated", good[:-6], "CRC mismatch|truncated|header describes"
    yield "crc", good[:-1] + bytes([good[-1] ^ 1]), "CRC mismatch"
    yield "out-of-range", _push(1, 0, [1], [1.0], "bad", numel=10), "registered with 5000"
    struct.pack_into("<Q", body, 36, 3)  # count 3 but two pairs
    yield ("wrong-count", bytes(body) + struct.pack("<I", zlib.crc32(body)),
           "cannot hold|header describes")
    struct.pack_into("<Q", body, 28, 1 << 40)
    yield "absurd", bytes(body) + struct.pack("<I", zlib.crc32(body)), "exceeds the limit"
    yield "garbage", b"\x00" * 3, "truncated"


def test_malformed_pushes_rejected_state_unchanged_server_serving(cluster):
    server = cluster[0]
    _raw(server, "Push", _push(0, 0, [1, 7], [1.0, 1.0], "bad"))
    for name, frame, message in _bad_frames():
        with pytest.raises(grpc.RpcError) as err:
            _raw(server, "Push", frame)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert any(m in err.value.details() for m in message.split("|")), \
            (name, err.value.details())
    for w in (1, 2):
        _raw(server, "Push", _push(w, 0, [1, 7], [1.0, 1.0], "bad"))
    pull = encode_frame(Kind.PULL, "bad", 0, 2, 0, 0, shard_bounds(NUMEL, 2)[1])
    result = decode_frame(_raw(server, "Pull", pull))
    assert result.indices.tolist() == [1, 7] and result.values.tolist() == [3.0, 3.0]
    server.wait_for("rejected push from .*malformed push frame: CRC mismatch")


def test_message_size_limit(cluster):
    numel = 600_000
    big = encode_frame(Kind.PUSH, "big", 0, 2, 0, 0, numel, np.arange(numel),
                       np.ones(numel, np.float32))  # 2.4 MB of values
    with pytest.raises(grpc.RpcError) as err:
        _raw(cluster[0], "Push", big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _raw(cluster[0], "Push", _push(0, 0, [1], [1.0], "small")) == b"accepted"


def test_metrics_endpoint(cluster):
    port = int(cluster[0].wait_for(r"metrics at http://[^:]+:(\d+)/metrics").group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "# TYPE hvd_ps_requests_total counter" in text
    assert 'hvd_ps_requests_total{method="push",outcome="accepted",shard="0/2"}' in text


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_metrics_on_their_own_address_without_names(start):
    """$HVD_PS_METRICS_HOST puts the endpoint on another loopback address than gRPC's, and
    --metrics-hide-names leaves tensor and session names out of every label: the open
    rounds appear as their lowest and highest value."""
    server = start("--workers", "1", "--metrics-port", "0", "--metrics-hide-names",
                   env={"HVD_PS_METRICS_HOST": "127.0.0.2"})
    port = int(server.wait_for(r"metrics at http://127\.0\.0\.2:(\d+)/metrics \(tensor "
                               r"and session names hidden\)").group(1))
    client = PSClient(server.address, 0, timeout=20, workers=1)
    for round in range(3):
        client.push_pull("job-7f3a/secret.weight", round, 100, torch.tensor([5]),
                         torch.tensor([1.0]))
    client.push_pull("job-7f3a/other.bias", 0, 100, torch.tensor([5]), torch.tensor([1.0]))
    client.close()
    text = _scrape("127.0.0.2", port)
    assert "job-7f3a" not in text and "secret.weight" not in text and "tensor=" not in text
    assert 'hvd_ps_open_round{shard="0/1",stat="min"} 1.0' in text, text
    assert 'hvd_ps_open_round{shard="0/1",stat="max"} 3.0' in text, text
    assert 'hvd_ps_open_sessions{shard="0/1"} 1.0' in text
    with pytest.raises(OSError):  # nothing on the gRPC address's host at that port
        _scrape("127.0.0.1", port)


def test_metrics_options_need_a_metrics_port():
    from ps_server.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--workers", "1", "--metrics-hide-names"])
    args = parse_args(["--workers", "1", "--metrics-port", "9100", "--metrics-host",
                       "10.0.0.5"])
    assert (args.metrics_host, args.metrics_port, args.metrics_hide_names) == \
        ("10.0.0.5", 9100, False)



def test_topk_mode_returns_global_topk_with_residual(start):
    server = start("--workers", str(WORKERS), "--mode", "topk", "--deadline", "10")
    workers = [PSClient(server.address, w, timeout=20) for w in range(WORKERS)]
    residual = torch.zeros(NUMEL)
    for round in range(2):
        pushes = random_pushes(10 + round, k=100)
        total, _ = exact_sum(pushes, torch.float32)
        total += residual
        idx, val = run_round(workers, "topk", round, pushes)[0]
        top = total.abs().topk(100).indices.sort().values
        assert torch.equal(idx, top)
        torch.testing.assert_close(val, total[top])
        residual = total.clone()
        residual[top] = 0
    for c in workers:
        c.close()


def _self_signed(key, cert) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)


def test_tls_with_self_signed_certificate(start, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    _self_signed(key, cert)
    server = start("--workers", "1", "--tls-cert", str(cert), "--tls-key", str(key))
    assert "grpc+tls" in server.wait_for("serving shard").string
    client = PSClient(server.address, 0, root_certificates=cert.read_bytes(), timeout=20)
    idx, val = client.push_pull("tls", 0, 100, torch.tensor([3, 1]), torch.tensor([1.0, 2.0]))
    assert idx.tolist() == [1, 3] and val.tolist() == [2.0, 1.0]
    client.close()
    plain = PSClient(server.address, 0, connect_timeout=1, timeout=5)
    with pytest.raises(PSError, match="UNAVAILABLE"):
        plain.push_pull("tls", 1, 100, torch.tensor([1]), torch.tensor([1.0]))
    plain.close()
    # A certificate the client does not trust fails at once, not after the retries.
    _self_signed(tmp_path / "other.key", tmp_path / "other.pem")
    wrong = PSClient(server.address, 0, root_certificates=(tmp_path / "other.pem").read_bytes(),
                     connect_timeout=30, timeout=20)
    began = time.monotonic()
    with pytest.raises(PSError, match="TLS handshake failed"):
        wrong.push_pull("tls", 1, 100, torch.tensor([1]), torch.tensor([1.0]))
    assert time.monotonic() - began < 5
    wrong.close()


def test_kill_9_then_restart_from_checkpoint(start, tmp_path):
    args = ["--workers", "2", "--mode", "topk", "--checkpoint-dir", str(tmp_path / "ckpt")]
    server = start(*args)
    workers = [PSClient(server.address, w, timeout=20, retry_timeout=30) for w in range(2)]

    def step(round: int, pushes) -> list:
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(c.push_pull, "ck", round, 10, torch.tensor(i), torch.tensor(v))
                    for c, (i, v) in zip(workers, pushes)]
            return [job.result(timeout=60) for job in jobs]

    # k = 2 of the sums {1: 3, 2: 0.5, 3: 2, 4: 0.25}; the server keeps {2: 0.5, 4: 0.25}.
    first = step(0, [([1, 2], [3.0, 0.5]), ([3, 4], [2.0, 0.25])])
    assert first[0][0].tolist() == [1, 3]
    server.kill()  # SIGKILL: nothing more is written
    with ThreadPoolExecutor(1) as pool:
        # The clients retry with back-off while the server is down.
        second = pool.submit(step, 1, [([4], [1.0]), ([5], [0.1])])
        time.sleep(0.5)
        restarted = start(*args, "--bind", server.address)
        idx, val = second.result(timeout=90)[1]
    restarted.wait_for(r"resumed from .*open rounds \{'ck': 1\}")
    # k = 1: index 4 holds 1.0 pushed plus 0.25 of restored residual.
    assert idx.tolist() == [4] and val.tolist() == [1.25]
    for c in workers:
        c.close()
