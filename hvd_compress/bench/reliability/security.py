"""The ``security`` campaign: tokens, replays, impersonation, oversized pushes and TLS
mistakes (see :mod:`hvd_compress.bench.reliability`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hvd_compress.bench.launch import ROOT, process_env
from hvd_compress.bench.reliability.common import (
    NUMEL,
    Server,
    exact_sum,
    is_exact,
    push_pairs,
    servers,
)
from hvd_compress.ps_protocol import GRPC_SERVICE, token_metadata
from hvd_compress.sparse_wire import Kind, encode_frame


def _code(call: Callable[[], Any]) -> str:
    """The gRPC status name a call ends with; a push's answer when it succeeds
    (``OK accepted`` or ``OK duplicate``)."""
    import grpc

    try:
        reply = call()
    except grpc.RpcError as err:
        return err.code().name
    return f"OK {reply.decode()}" if reply in (b"accepted", b"duplicate") else "OK"


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A throw-away EC key and self-signed certificate for ``localhost`` and 127.0.0.1,
    valid one day: ``(key, certificate)`` PEM files ``NAME.key`` and ``NAME.pem``."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
                   capture_output=True)
    return key, cert


def impostor_main(argv: list[str]) -> None:
    """``_impostor ADDRESS TOKEN WORKER TENSOR ROUND``: a process of its own pushing as
    ``WORKER`` with its own client. Prints ``ready`` once imported, pushes when a line
    comes on stdin, then prints ``OK`` or the error's gRPC status name."""
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    address, token, worker, tensor, round = argv
    client = PSClient(address, int(worker), token=token, workers=2, timeout=20,
                      retry_timeout=5)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        client.push_pull(tensor, int(round), NUMEL, *map(torch.from_numpy, push_pairs(
            77, tensor, int(round), int(worker))))
        print("OK", flush=True)
    except PSError as err:
        print(err.code, flush=True)
    finally:
        client.close()


def impersonation(srv: Server, clients: list[Any], round: int) -> dict[str, Any]:
    """Round ``round`` of ``sec/w``: worker 0 pushes, then another process and a raw call
    without identity push as worker 1 (bound to ``clients[1]``), then worker 1 pushes."""
    import grpc
    import torch

    out: dict[str, Any] = {}
    tensor = "sec/w"
    other = subprocess.Popen([sys.executable, "-m", "hvd_compress.bench.reliability",
                              "_impostor", srv.address, "s3cret-token", "1", tensor,
                              str(round)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=process_env(), cwd=ROOT)
    try:
        ready = other.stdout.readline().strip()  # imports done: the deadline is not spent
        first = clients[0].start(tensor, round, NUMEL, *map(torch.from_numpy,
                                                            push_pairs(1, tensor, round, 0)))
        answer, _ = other.communicate("go\n", timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    out["impersonation_other_process"] = (answer.strip() if ready == "ready" else
                                          f"the other process failed ({other.returncode})")
    raw = encode_frame(Kind.PUSH, tensor, 0, 1, round, 1, NUMEL,
                       *push_pairs(99, tensor, round, 1))
    with grpc.insecure_channel(srv.address) as channel:
        out["impersonation_without_identity"] = _code(lambda: channel.unary_unary(
            f"/{GRPC_SERVICE}/Push")(raw, timeout=10, metadata=token_metadata("s3cret-token")))
    second = clients[1].push_pull(tensor, round, NUMEL, *map(torch.from_numpy,
                                                             push_pairs(1, tensor, round, 1)))
    want = exact_sum(1, tensor, round, 2)
    out[f"round_{round}_exact_after_impersonation"] = [
        is_exact(clients[0].finish(first), want), is_exact(second, want)]
    text = srv.text()
    out["impersonation_refused_unread"] = bool(re.search(
        r"WARNING rejected push from \S+ before reading it: worker 1 of session 'sec' .*"
        r"first seen from \S+", text))
    return out


def security(work: Path) -> dict[str, Any]:
    import grpc
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    print("security:", flush=True)
    token = work / "token"
    token.write_text("s3cret-token")
    out: dict[str, Any] = {}
    args = ["--workers", "2", "--deadline", "5", "--token-file", str(token)]
    with servers(work, ("sec", args, {})) as (srv,):
        push = encode_frame(Kind.PUSH, "sec/w", 0, 1, 0, 0, NUMEL,
                            *push_pairs(1, "sec/w", 0, 0))
        with grpc.insecure_channel(srv.address) as channel:
            call = channel.unary_unary(f"/{GRPC_SERVICE}/Push")
            out["no_token"] = _code(lambda: call(push, timeout=10))
            out["wrong_token"] = _code(lambda: call(push, timeout=10,
                                                    metadata=token_metadata("guess")))
        clients = [PSClient(srv.address, w, token="s3cret-token", workers=2, timeout=20)
                   for w in range(2)]

        def round_of(r: int, tensor: str = "sec/w") -> list[bool]:
            with ThreadPoolExecutor(2) as pool:
                jobs = [pool.submit(c.push_pull, tensor, r, NUMEL,
                                    *map(torch.from_numpy, push_pairs(1, tensor, r, w)))
                        for w, c in enumerate(clients)]
                got = [j.result(timeout=60) for j in jobs]
            return [is_exact(g, exact_sum(1, tensor, r, 2)) for g in got]

        out["round_0_exact"] = round_of(0)
        with grpc.insecure_channel(srv.address) as channel:
            call = channel.unary_unary(f"/{GRPC_SERVICE}/Push")
            meta = token_metadata("s3cret-token")
            out["replay_closed_round"] = _code(lambda: call(push, timeout=10, metadata=meta))
            out["round_1_exact_after_replay"] = round_of(1)
            out.update(impersonation(srv, clients, 2))
            # A second, different push for (worker 0, round 0) of a session no client
            # holds, from calls without identity (the content check catches them)
            pushes = [encode_frame(Kind.PUSH, "raw/w", 0, 1, 0, 0, NUMEL,
                                   *push_pairs(seed, "raw/w", 0, 0)) for seed in (1, 99)]
            out["conflicting_push_first_push"] = _code(
                lambda: call(pushes[0], timeout=10, metadata=meta))
            out["conflicting_push_second_sender"] = _code(
                lambda: call(pushes[1], timeout=10, metadata=meta))
            pull = encode_frame(Kind.PULL, "raw/w", 0, 1, 0, 0, NUMEL)
            out["conflicting_push_first_sender"] = _code(lambda: channel.unary_unary(
                f"/{GRPC_SERVICE}/Pull")(pull, timeout=10, metadata=meta))
            bad_worker = encode_frame(Kind.PUSH, "sec/w", 0, 1, 3, 7, NUMEL,
                                      *push_pairs(1, "sec/w", 3, 0))
            out["worker_id_out_of_range"] = _code(
                lambda: call(bad_worker, timeout=10, metadata=meta))
        out["conflict_logged_warning"] = bool(re.search(r"WARNING .*(conflict|different)",
                                                        srv.text(), re.IGNORECASE))
        for c in clients:
            c.close()
        # Eight 100 MB unauthenticated pushes at once
        before = srv.memory_mb()
        big = bytes(100 << 20)

        def send_big() -> str:
            with grpc.insecure_channel(srv.address, options=[
                    ("grpc.max_send_message_length", 256 << 20)]) as channel:
                return _code(lambda: channel.unary_unary(f"/{GRPC_SERVICE}/Push")(
                    big, timeout=120))

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: send_big(), range(8)))
        after = srv.memory_mb()
        out["unauthenticated_8x100MB"] = {"codes": sorted(set(codes)),
                                          "peak_mb_before": before["peak_mb"],
                                          "peak_mb_after": after["peak_mb"],
                                          "peak_growth_mb": round(after["peak_mb"] -
                                                                  before["peak_mb"], 1)}
    # TLS misconfiguration, both ways
    key, cert = self_signed(work, "server")
    _, other_cert = self_signed(work, "other")
    tls_args = ["--workers", "1", "--tls-cert", str(cert), "--tls-key", str(key)]
    with servers(work, ("tls", tls_args, {}), ("plain", ["--workers", "1"], {})) as (tls, plain):
        cases = {"wrong_ca": (f"grpcs://localhost:{tls.port}", other_cert.read_bytes()),
                 "tls_to_plain_server": (f"grpcs://localhost:{plain.port}", cert.read_bytes()),
                 "plain_to_tls_server": (f"grpc://localhost:{tls.port}", None),
                 "right_ca": (f"grpcs://localhost:{tls.port}", cert.read_bytes())}
        for name, (address, ca) in cases.items():
            client = PSClient(address, 0, root_certificates=ca, workers=1, timeout=30,
                              connect_timeout=30, retry_timeout=30)
            began = time.monotonic()
            try:
                client.push_pull("tls/w", 0, 10, torch.tensor([1]), torch.tensor([1.0]))
                result = "OK"
            except PSError as err:
                result = f"{err.code}: {err.detail[:160]}"
            client.close()
            out[f"tls_{name}"] = {"result": result,
                                  "seconds": round(time.monotonic() - began, 2)}
    expect = {"no_token": "UNAUTHENTICATED", "wrong_token": "UNAUTHENTICATED",
              "replay_closed_round": "PERMISSION_DENIED",  # worker 0 is bound
              "conflicting_push_first_push": "OK accepted",
              "conflicting_push_second_sender": "ALREADY_EXISTS",
              "conflicting_push_first_sender": "ABORTED",
              "impersonation_other_process": "PERMISSION_DENIED",
              "impersonation_without_identity": "PERMISSION_DENIED",
              "worker_id_out_of_range": "INVALID_ARGUMENT"}
    problems = [f"{k}: {out[k]} (expected {v})" for k, v in expect.items() if out[k] != v]
    if not all(out["round_0_exact"] + out["round_1_exact_after_replay"] +
               out["round_2_exact_after_impersonation"]):
        problems.append("a round was not exact")
    if not out["impersonation_refused_unread"]:
        problems.append("the other process's push was not refused unread, logged at WARNING "
                        "with the bound worker's first peer")
    if not out["conflict_logged_warning"]:
        problems.append("the conflicting push was not logged at WARNING")
    big = out["unauthenticated_8x100MB"]
    if big["codes"] != ["UNAUTHENTICATED"] or big["peak_growth_mb"] > 100:
        problems.append(f"unauthenticated large pushes: {big}")
    if out["tls_right_ca"]["result"] != "OK":
        problems.append(f"TLS with the right CA failed: {out['tls_right_ca']}")
    for name in ("wrong_ca", "tls_to_plain_server", "plain_to_tls_server"):
        case = out[f"tls_{name}"]
        if case["result"] == "OK" or case["seconds"] > 10:
            problems.append(f"TLS {name}: {case}")
    out["problems"] = problems
    out["ok"] = not problems
    for key, value in out.items():
        if key not in ("problems", "ok"):
            print(f"  {key}: {value}", flush=True)
    print("  " + ("all as expected" if not problems else "FAILED: " + "; ".join(problems)),
          flush=True)
    return out


