"""The parameter server under faults: SIGKILL at every step of the close and checkpoint
sequence, more workers than handler threads, a wrong --workers, nothing listening, and
unauthenticated requests (refused before their body is read)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from hvd_compress.comm.ps_client import PSClient, PSError
from hvd_compress.ps_protocol import GRPC_PUSH
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server.checkpoint import FAULT_ENV, FAULT_STEPS
from ps_server.service import ShardService
from ps_server.store import ShardStore
from tests.servers import ServerProcess, start_servers  # noqa: F401 (fixture `start`)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

NUMEL, ROUNDS, TENSORS = 3000, 12, ("a", "b")
# Which occurrence of each step the server dies at: past the first snapshot (at start-up)
# and a few rounds in, so rounds before and after the kill are checked.
OCCURRENCE = {"closed": 5, "journal-write": 5, "journal-written": 5, "snapshot-write": 3,
              "snapshot-renamed": 3, "answered": 9}


def pushes(tensor: str, round: int, worker: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([round, worker, ord(tensor)])
    idx = np.sort(rng.choice(NUMEL, 200, replace=False))
    return idx, rng.standard_normal(200).astype(np.float32)


def reference(mode: str) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """Every round's aggregate from a server that never crashed (in-process)."""
    service = ShardService(ShardStore(2, 0, 1, mode))
    out = {}
    for r in range(ROUNDS):
        for t in TENSORS:
            for w in range(2):
                idx, val = pushes(t, r, w)
                service.push(encode_frame(Kind.PUSH, t, 0, 1, r, w, NUMEL, idx, val), "ref")
            frame = decode_frame(service.pull(encode_frame(Kind.PULL, t, 0, 1, r, 0, NUMEL),
                                              "ref", 1.0))
            out[t, r] = (frame.indices, frame.values)
    return out


def train(address: str, worker: int) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """Both tensors started, then finished, every round (as the optimizer does)."""
    client = PSClient(address, worker, timeout=60, retry_timeout=90, connect_timeout=90,
                      workers=2)
    got = {}
    try:
        for r in range(ROUNDS):
            pending = [client.start(t, r, NUMEL, *map(torch.from_numpy, pushes(t, r, worker)))
                       for t in TENSORS]
            for t, p in zip(TENSORS, pending):
                idx, val = client.finish(p)
                got[t, r] = (idx.numpy(), val.numpy())
    finally:
        client.close()
    return got


@pytest.mark.parametrize("mode", ["union", "topk"])
@pytest.mark.parametrize("step", FAULT_STEPS)
def test_a_kill_at_any_step_of_the_close_leaves_workers_in_agreement(tmp_path, step, mode):
    """The server kills itself (SIGKILL) at ``step``, is restarted on the same port from
    its checkpoint, and both workers end with the aggregates of a server that never
    crashed, round for round (so their replicas cannot differ)."""
    args = ["--workers", "2", "--mode", mode, "--deadline", "60", "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    server = ServerProcess(["--bind", "127.0.0.1:0", *args],
                           env={FAULT_ENV: f"{step}:{OCCURRENCE[step]}"})
    servers = [server]
    stop = threading.Event()

    def restart_when_dead() -> None:
        while not stop.is_set():
            if servers[-1].proc.poll() is not None:
                servers.append(ServerProcess(["--bind", server.address, *args]))
            time.sleep(0.05)

    watcher = threading.Thread(target=restart_when_dead, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(train, server.address, w) for w in range(2)]
            results = [job.result(timeout=240) for job in jobs]
    finally:
        stop.set()
        watcher.join()
        for s in servers:
            s.kill()
    assert servers[0].proc.returncode == -9, "the fault never fired"
    assert len(servers) == 2, [s.log() for s in servers]
    servers[1].wait_for("resumed from")
    expected = reference(mode)
    for key, (idx, val) in expected.items():
        for worker in range(2):
            np.testing.assert_array_equal(results[worker][key][0], idx, err_msg=str(key))
            np.testing.assert_array_equal(results[worker][key][1], val, err_msg=str(key))



def test_more_workers_than_handler_threads(start):
    """130 workers (over twice the default 64 threads) against a server with 4: waiting
    pulls hold no thread, so every push gets in and every round is exact."""
    workers, threads = 130, 4
    server = start("--workers", str(workers), "--threads", str(threads), "--deadline", "60")
    clients = [PSClient(server.address, w, timeout=60, workers=workers)
               for w in range(workers)]
    try:
        with ThreadPoolExecutor(workers) as pool:
            for r in range(3):
                jobs = [pool.submit(c.push_pull, "many", r, NUMEL,
                                    torch.tensor([w, NUMEL - 1]),
                                    torch.tensor([1.0, float(r)]))
                        for w, c in enumerate(clients)]
                for job in jobs:
                    idx, val = job.result(timeout=120)
                    assert idx.tolist() == [*range(workers), NUMEL - 1]
                    assert val.tolist() == [1.0] * workers + [float(r * workers)]
    finally:
        for c in clients:
            c.close()


def test_a_wrong_worker_count_fails_at_once_on_both_sides(start):
    server = start("--workers", "3", "--deadline", "120")
    client = PSClient(server.address, 0, workers=2, timeout=60)
    began = time.monotonic()
    with pytest.raises(PSError) as err:
        client.push_pull("w", 0, 10, torch.tensor([1]), torch.tensor([1.0]))
    assert time.monotonic() - began < 5
    assert err.value.code == "FAILED_PRECONDITION"
    assert "the job has 2 workers but this server was started with --workers 3" in \
        str(err.value)
    line = server.wait_for(r"ERROR refused ipv4:127\.0\.0\.1:\d+: the job has 2 workers")
    assert "--workers 3" in line.string
    client.close()


def test_nothing_listening_fails_after_the_connect_timeout():
    client = PSClient("127.0.0.1:1", 0, connect_timeout=1.0, retry_timeout=600)
    began = time.monotonic()
    with pytest.raises(PSError, match=r"UNAVAILABLE: nothing answered at this address for "
                       r"[\d.]+ s \(connect_timeout 1 s"):
        client.push_pull("w", 0, 10, torch.tensor([1]), torch.tensor([1.0]))
    assert time.monotonic() - began < 4
    client.close()


def test_connect_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_PS_CONNECT_TIMEOUT", "2.5")
    assert PSClient("127.0.0.1:1", 0).connect_timeout == 2.5
    monkeypatch.setenv("HVD_COMPRESS_PS_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"\$HVD_COMPRESS_PS_CONNECT_TIMEOUT='soon' is not"):
        PSClient("127.0.0.1:1", 0)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("rounds_first", [0, 3])
def test_unauthenticated_messages_are_refused_unread(start, tmp_path, rounds_first):
    """Eight 100 MB pushes without a token, at once: refused, and the server's peak RSS
    grows by far less than one of them (the body is never read, and gRPC buffers at most
    the server's 1 MB receive window of each stream: 0-4.7 MB measured, 5-65 MB with
    gRPC's tuned windows). Also after rounds of 3 MB replies, whose pages the server's
    heap then keeps (``HeapKeeper``)."""
    token = tmp_path / "token"
    token.write_text("s3cret")
    server = start("--workers", "1", "--token-file", str(token), "--max-message-mb", "256")
    numel = 1 << 22
    client = PSClient(server.address, 0, token="s3cret", workers=1)
    try:
        for r in range(rounds_first):
            idx = torch.arange(r % 8, numel, 8)
            agg_idx, _ = client.finish(client.start("big", r, numel, idx,
                                                    torch.ones(idx.numel())))
            assert agg_idx.numel() == idx.numel()
    finally:
        client.close()
    before = _peak_rss_mb(server.proc.pid)
    big = bytes(100 << 20)

    def send() -> grpc.StatusCode:
        with grpc.insecure_channel(server.address, options=[
                ("grpc.max_send_message_length", 256 << 20)]) as channel:
            try:
                channel.unary_unary(GRPC_PUSH)(big, timeout=60)
            except grpc.RpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: send(), range(8)))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    grown = _peak_rss_mb(server.proc.pid) - before
    print(f"server peak RSS grew {grown:.1f} MB for 8 x 100 MB unauthenticated pushes")
    assert grown < 20, grown  # 8 streams x RECEIVE_WINDOW_BYTES, with room
    server.wait_for(r"WARNING refused a call from ipv4:127\.0\.0\.1:\d+: missing or wrong "
                    "token")


def test_a_corpus_of_mutated_frames_is_refused_and_changes_nothing(start):
    """2,000 requests: valid frames with flipped bytes, truncated, extended, random bytes,
    pushes sent to Pull and pulls to Push. None is accepted into a sum, the server keeps
    serving, and the next round is exact."""
    server = start("--workers", "2", "--deadline", "30")
    rng = np.random.default_rng(7)
    idx, val = np.array([3, 9, 40]), np.array([1.0, 2.0, 3.0], np.float32)
    valid_push = encode_frame(Kind.PUSH, "fz", 0, 1, 0, 0, 100, idx, val)
    valid_pull = encode_frame(Kind.PULL, "fz", 0, 1, 0, 0, 100)
    codes: dict[str, int] = {}
    with grpc.insecure_channel(server.address) as channel:
        calls = {m: channel.unary_unary(f"/hvd_compress.ps.ParameterServer/{m}")
                 for m in ("Push", "Pull")}
        for i in range(2000):
            base = valid_push if i % 2 else valid_pull
            data = bytearray(base)
            how = i % 5
            if how == 0:
                for at in rng.integers(0, len(data), rng.integers(1, 4)):
                    data[at] ^= int(rng.integers(1, 256))
            elif how == 1:
                data = data[: int(rng.integers(0, len(data)))]
            elif how == 2:
                data += rng.bytes(int(rng.integers(1, 20)))
            elif how == 3:
                data = bytearray(rng.bytes(int(rng.integers(0, 200))))
            method = ("Pull" if i % 2 else "Push") if how == 4 else ("Push" if i % 2 else "Pull")
            try:
                calls[method](bytes(data), timeout=5)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as err:
                codes[err.code().name] = codes.get(err.code().name, 0) + 1
    print(f"refusals by code: {codes}")
    assert "OK" not in codes, codes  # nothing mutated passed as a valid request
    assert codes.get("INVALID_ARGUMENT", 0) > 1000, codes
    clients = [PSClient(server.address, w, timeout=30, workers=2) for w in range(2)]
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(c.push_pull, "fz", 0, 100, torch.from_numpy(idx),
                            torch.from_numpy(val * (w + 1))) for w, c in enumerate(clients)]
        for job in jobs:
            got_idx, got_val = job.result(timeout=60)
            assert got_idx.tolist() == [3, 9, 40] and got_val.tolist() == [3.0, 6.0, 9.0]
    for c in clients:
        c.close()


def test_an_abandoned_session_expires_on_a_live_server(start):
    """A job that vanished mid-round: after --idle-timeout its tensors are freed and the
    server says so."""
    server = start("--workers", "2", "--deadline", "1", "--idle-timeout", "2")
    client = PSClient(server.address, 0, workers=2, timeout=10)
    client.start("gone/w", 0, 100, torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    server.wait_for(r"worker 1 did not push within the 1 s deadline", timeout=15)
    server.wait_for(r"session 'gone' expired after 2 s idle: freed 1 tensor \(\d+ bytes\)",
                    timeout=15)
    client.close()


def test_a_plaintext_client_of_a_tls_server_is_told_at_once(start, tmp_path):
    """Found by the campaign (``bench.reliability security``): a grpc:// client of a TLS
    server retried for its whole connect_timeout, then said nothing answered. Now the
    first failure is recognised (TCP accepted, no HTTP/2 answer) and named, even with a
    connect_timeout longer than the test's own timeout."""
    from hvd_compress.bench.reliability import self_signed

    key, cert = self_signed(tmp_path, "server")
    server = start("--workers", "1", "--tls-cert", str(cert), "--tls-key", str(key))
    plain = PSClient(server.address, 0, connect_timeout=3600, timeout=30)
    with pytest.raises(PSError, match=r"UNAVAILABLE: a server accepts connections at this "
                       r"address but closes plaintext gRPC connections: it probably serves "
                       r"TLS \(started with --tls-cert\), so reach it with grpcs://"):
        plain.push_pull("tls", 0, 10, torch.tensor([1]), torch.tensor([1.0]))
    plain.close()
    # A plaintext server is not mistaken for one: the same client shape works against it.
    other = start("--workers", "1")
    ok = PSClient(other.address, 0, connect_timeout=3600, timeout=30, workers=1)
    assert ok.push_pull("tls", 0, 10, torch.tensor([1]), torch.tensor([2.0]))[1].tolist() \
        == [2.0]
    ok.close()


def test_the_fuzz_corpus_generator_never_makes_a_guarded_frame_valid():
    """The campaign's state check relies on every request to tensor ``fz/guarded`` being
    invalid (CRC broken, truncated or extended): checked on 3,000 generated requests with
    the reference decoder, and the other mutations do produce both kinds."""
    from hvd_compress.bench.reliability import expected_invalid, fuzz_case

    made: dict[str, set[bool]] = {}
    for i in range(3000):
        method, data, how = fuzz_case(np.random.default_rng([11, i]), i)
        invalid = expected_invalid(method, data)
        if i % 3 == 0:
            assert invalid, (i, how)
        made.setdefault(how, set()).add(invalid)
    assert made["body+crc"] == {True, False}  # some rewritten values stay valid pushes
    assert made["random"] == made["truncated"] == made["wrong-rpc"] == {True}


def test_the_campaign_command_runs_a_short_fuzz(tmp_path):
    """``python -m hvd_compress.bench.reliability fuzz`` end to end at 1,000 requests:
    its JSON says no crash, hang or accepted invalid request and exact clean rounds."""
    import json
    import subprocess
    import sys

    from tests.harness import ROOT, rank_env

    out = tmp_path / "fuzz.json"
    subprocess.run([sys.executable, "-m", "hvd_compress.bench.reliability", "fuzz",
                    "--requests", "1000", "--json", str(out)], cwd=ROOT, env=rank_env(),
                   check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())["fuzz"]
    assert report["requests"] == 1000
    assert (report["crashes"], report["hangs"], report["accepted_invalid"]) == (0, 0, 0)
    assert report["clean_round_exact"] == {"fz/guarded": True, "after/fresh": True}
    assert report["ok"]
