"""What the PyTorch binding has, on the TensorFlow binding: ``connect_timeout=``, ``ps=``,
Horovod's arguments and ``compression=`` checked at construction with the same messages,
Horovod's own TensorFlow compressors taken as the PyTorch binding takes Horovod's torch
ones, the schemes' optimizer checks on Keras optimizers, bfloat16 models end to end, and
the exact majority vote.

TensorFlow is imported only in the processes these tests start (it costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import horovod.torch as horovod_torch
import numpy as np
import pytest
import torch

from hvd_compress import Compression
from hvd_compress.binding import HOROVOD_COMPRESSORS, resolve_compression
from hvd_compress.comm.parameter_server import PS_ENV
from hvd_compress.comm.ps_client import check_timeout
from tests.harness import ROOT, rank_env, run_ranks
from tests.test_binding import ARGUMENT_ERRORS, KERAS_ACCUMULATION
from tests.workers.bf16 import bf16_value

pytestmark = [pytest.mark.multiprocess, pytest.mark.tensorflow]

ONE_PROCESS = """
import json, socket, time, warnings
import horovod.tensorflow as hvd, keras, numpy as np, tensorflow as tf
from hvd_compress import Compression
from hvd_compress.tensorflow import DistributedGradientTape
from hvd_compress.tensorflow.keras import DistributedOptimizer

hvd.init()
out = {}

def error(make):
    try:
        make()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

def keras_opt(**kwargs):
    return DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)

def tape(**kwargs):
    return DistributedGradientTape(tf.GradientTape(), compression=Compression.topk(), **kwargs)

for value in (0, -1.0, "1"):
    out[f"keras_timeout_{value}"] = error(lambda: keras_opt(ps="grpc://h:1",
                                                            connect_timeout=value))
    out[f"tape_timeout_{value}"] = error(lambda: tape(ps="grpc://h:1", connect_timeout=value))
out["keras_bad_ps"] = error(lambda: keras_opt(ps="grpc://host:notaport"))
out["tape_bad_ps"] = error(lambda: tape(ps="http://host:7070"))

# The schemes' optimizer checks, on Keras optimizers.
out["dgc_sgd_momentum"] = error(lambda: DistributedOptimizer(
    keras.optimizers.SGD(0.1, momentum=0.9), compression=Compression.dgc()))
out["dgc_rmsprop_momentum"] = error(lambda: DistributedOptimizer(
    keras.optimizers.RMSprop(0.01, momentum=0.5), compression=Compression.dgc()))
out["dgc_sgd"] = error(lambda: DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   compression=Compression.dgc()))
out["dgc_adam"] = error(lambda: DistributedOptimizer(keras.optimizers.Adam(),
                                                    compression=Compression.dgc()))
out["signum_sgd_momentum"] = error(lambda: DistributedOptimizer(
    keras.optimizers.SGD(0.1, momentum=0.9), compression=Compression.vote(momentum=0.9)))
out["vote_sgd_momentum"] = error(lambda: DistributedOptimizer(
    keras.optimizers.SGD(0.1, momentum=0.9), compression=Compression.vote()))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                         compression=Compression.onebit())
out["onebit_warnings"] = [str(w.message) for w in caught if w.category is UserWarning]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression=Compression.onebit())
    DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression=Compression.topk())
out["onebit_adamw_warnings"] = [str(w.message) for w in caught if w.category is UserWarning]

# Horovod's arguments and compression= values refused, with the PyTorch optimizer's messages.
from tests.test_binding import ARGUMENT_ERRORS
# horovod.torch's fp16 compressor, by its module and name: importing horovod.torch here would
# point Horovod's global process set at the torch library, which this process does not start.
torch_horovod_fp16 = type("FP16Compressor", (), {"__module__": "horovod.torch.compression"})
for path, make in (("tape", lambda **kw: DistributedGradientTape(tf.GradientTape(), **kw)),
                   ("keras", keras_opt)):
    out[f"{path}_argument_errors"] = [  # Horovod's tape has no backward_passes_per_step
        error(lambda: make(**kw)) for kw, _ in ARGUMENT_ERRORS
        if path == "keras" or "backward_passes_per_step" not in kw]
    out[f"{path}_compression_errors"] = [
        error(lambda: make(compression=value))
        for value in ("fp16", Compression.qsgd, torch_horovod_fp16, 3)]
out["keras_accumulation_errors"] = [error(lambda: keras_opt(**kw)) for kw in (
    {"backward_passes_per_step": 2}, {"average_aggregated_gradients": True})]

# Horovod's own TensorFlow compressors (classes, or instances) mean Compression.none/fp16.
v = tf.Variable(tf.reshape(tf.range(64 * 64, dtype=tf.float32), [64, 64]) / 7.0 + 0.1)
exact = {"none": v.numpy(), "fp16": v.numpy().astype(np.float16).astype(np.float32)}
out["fp16_rounds"] = bool(not np.array_equal(exact["fp16"], exact["none"]))
out["horovods"] = {}
for label, given in (("none", hvd.Compression.none), ("none()", hvd.Compression.none()),
                     ("fp16", hvd.Compression.fp16), ("fp16()", hvd.Compression.fp16())):
    expected = exact[label.rstrip("()")]
    with tf.GradientTape() as raw:
        target = 0.5 * tf.reduce_sum(v * v)  # its gradient is v
    wrapped = DistributedGradientTape(raw, compression=given)
    grad = wrapped.gradient(target, v)
    optimizer = DistributedOptimizer(keras.optimizers.SGD(1.0), compression=given)
    w = tf.Variable(tf.zeros([64, 64]))
    optimizer.apply([v], [w])  # w = 0 - 1.0 * (v exchanged)
    keras_exchange = optimizer.hvd_compress_state.exchange
    out["horovods"][label] = {
        "tape_scheme": repr(wrapped._exchange.pipeline.scheme),
        "keras_scheme": repr(keras_exchange.pipeline.scheme),
        "tape_exact": bool(np.array_equal(grad.numpy(), expected)),
        "keras_exact": bool(np.array_equal(w.numpy(), -expected)),
        "payload_bytes": [wrapped._exchange.last_step.payload_bytes,
                          keras_exchange.last_step.payload_bytes]}
out["horovod_classes"] = [f"{c.__module__}.{c.__qualname__}"
                          for c in (hvd.Compression.none, hvd.Compression.fp16)]

# A server never reached, with connect_timeout=0.5: the first step fails within it.
with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
out["port"] = port
ps = f"grpc://127.0.0.1:{port}"
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
optimizer = DistributedOptimizer(keras.optimizers.SGD(0.1), compression=Compression.topk(
    ratio=0.01), ps=ps, connect_timeout=0.5)
with tf.GradientTape() as g:
    loss = tf.reduce_sum(model(tf.ones([2, 64])))
grads = g.gradient(loss, model.trainable_variables)
for path, step in (("keras", lambda: optimizer.apply(grads, model.trainable_variables)),
                   ("tape", None)):
    if step is None:
        v = tf.Variable(tf.ones([64, 64]))
        with tf.GradientTape() as raw:
            target = tf.reduce_sum(v * v)
        wrapped = DistributedGradientTape(raw, compression=Compression.topk(ratio=0.01),
                                          ps=ps, connect_timeout=0.5)
        step = lambda: wrapped.gradient(target, v)
    started = time.monotonic()
    message = error(step)
    out[path] = {"seconds": time.monotonic() - started, "error": message}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """The checks of :data:`ONE_PROCESS`, in one fresh interpreter at Horovod size 1."""
    env = rank_env()
    env.pop(PS_ENV, None)
    env.pop("HVD_COMPRESS_PS_CONNECT_TIMEOUT", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ONE_PROCESS)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_connect_timeout_is_checked_at_construction(one_process: dict[str, Any]) -> None:
    for value, shown in (("0", "0"), ("-1.0", "-1.0"), ("1", "'1'")):
        for binding in ("keras", "tape"):
            message = one_process[f"{binding}_timeout_{value}"]
            assert message == ("ValueError: connect_timeout must be > 0 seconds or None, got "
                               f"{shown}"), (binding, value, message)
    # The same function checks the PyTorch optimizer's argument.
    assert check_timeout(None, "connect_timeout") is None
    assert check_timeout(2, "connect_timeout") == 2.0
    for bad in (0, -0.5, float("nan"), True, "3"):
        with pytest.raises(ValueError, match="connect_timeout must be > 0 seconds or None"):
            check_timeout(bad, "connect_timeout")


def test_bad_ps_is_refused_at_construction(one_process: dict[str, Any]) -> None:
    assert "'grpc://host:notaport' in ps='grpc://host:notaport'" in one_process["keras_bad_ps"]
    assert "the port 'notaport' is not a number" in one_process["keras_bad_ps"]
    assert "'http://' is not supported" in one_process["tape_bad_ps"]


def test_horovods_arguments_are_refused_at_construction_as_by_the_torch_optimizer(
        one_process: dict[str, Any]) -> None:
    """The tape and the Keras optimizer raise the PyTorch optimizer's messages
    (tests/test_binding.py checks those against the PyTorch optimizer)."""
    expected = [f"ValueError: {message}" for _, message in ARGUMENT_ERRORS]
    assert one_process["keras_argument_errors"] == expected
    assert one_process["tape_argument_errors"] == [  # the tape has no backward_passes_per_step
        f"ValueError: {message}" for kwargs, message in ARGUMENT_ERRORS
        if "backward_passes_per_step" not in kwargs]
    assert one_process["keras_accumulation_errors"] == [
        f"ValueError: backward_passes_per_step must be 1 here, got 2: {KERAS_ACCUMULATION}",
        f"ValueError: average_aggregated_gradients must be False here, got True: "
        f"{KERAS_ACCUMULATION}"]


def test_bad_compression_is_refused_at_construction_saying_what_to_pass(
        one_process: dict[str, Any]) -> None:
    expected = []
    for value in ("fp16", Compression.qsgd, horovod_torch.Compression.fp16, 3):
        with pytest.raises(TypeError) as err:
            resolve_compression(value, "tensorflow")
        expected.append(f"TypeError: {err.value}")
    assert "got the string 'fp16': use Compression.parse('fp16')" in expected[0]
    assert "got the class QSGD itself: call it with its options" in expected[1]
    assert "pass horovod.tensorflow.Compression.fp16 or Compression.fp16" in expected[2]
    assert "got an instance of builtins.int" in expected[3]
    for path in ("tape", "keras"):
        assert one_process[f"{path}_compression_errors"] == expected, path


def test_horovods_tensorflow_compressors_construct_and_step(
        one_process: dict[str, Any]) -> None:
    """``horovod.tensorflow.Compression.none``/``.fp16`` (the classes Horovod passes, and
    instances) on the tape and the Keras optimizer: the scheme is ``Compression.none`` /
    ``Compression.fp16``, and at size 1 the exchanged gradient is the gradient itself,
    rounded to float16 and back for fp16, bit for bit (the rounding changes these values)."""
    assert one_process["fp16_rounds"]
    assert sorted(one_process["horovods"]) == ["fp16", "fp16()", "none", "none()"]
    for label, result in one_process["horovods"].items():
        scheme = label.rstrip("()")
        assert result["tape_scheme"] == result["keras_scheme"] == f"Compression.{scheme}"
        assert result["tape_exact"] and result["keras_exact"], (label, result)
        element_bytes = 2 if scheme == "fp16" else 4
        assert result["payload_bytes"] == [64 * 64 * element_bytes] * 2, (label, result)
    assert {name: HOROVOD_COMPRESSORS["tensorflow"].get(name)
            for name in one_process["horovod_classes"]} == {
        "horovod.tensorflow.compression.NoneCompressor": "none",
        "horovod.tensorflow.compression.FP16Compressor": "fp16"}


def test_a_server_never_reached_fails_the_first_step_within_connect_timeout(
        one_process: dict[str, Any]) -> None:
    """``connect_timeout=0.5`` on the Keras optimizer and on the tape: the first step
    against a port nothing listens on fails within seconds (not the 60 s of retries),
    naming the address."""
    address = f"127.0.0.1:{one_process['port']}"
    for binding in ("keras", "tape"):
        result = one_process[binding]
        assert result["error"] is not None and address in result["error"], (binding, result)
        assert result["error"].startswith("PSError"), (binding, result)
        assert result["seconds"] < 5, (binding, result)


def test_schemes_check_keras_optimizers(one_process: dict[str, Any]) -> None:
    """DGC applies momentum itself and Signum before its vote: a Keras optimizer with its own
    momentum is refused when the wrapper is made, saying what to do."""
    for key, name, momentum in (("dgc_sgd_momentum", "SGD", 0.9),
                                ("dgc_rmsprop_momentum", "RMSprop", 0.5)):
        message = one_process[key]
        assert message is not None and message.startswith("ValueError: Compression.dgc "
                                                          "applies momentum itself"), message
        assert f"wrapped optimizer {name} has momentum={momentum}" in message, message
        assert f"Compression.dgc(momentum={momentum})" in message, message
    assert one_process["dgc_sgd"] is None and one_process["dgc_adam"] is None
    assert "Compression.vote(momentum=0.9) (Signum)" in one_process["signum_sgd_momentum"]
    assert one_process["vote_sgd_momentum"] is None  # signSGD itself keeps no momentum
    warnings = one_process["onebit_warnings"]
    assert len(warnings) == 1 and "SGD has momentum=0.9" in warnings[0], warnings
    warnings = one_process["onebit_adamw_warnings"]  # 1-bit warned, top-k not
    assert len(warnings) == 1 and "AdamW (betas in parameter group 0)" in warnings[0] \
        and "OneBitAdam" in warnings[0], warnings


BF16_SCHEMES = ["none", "fp16", "bf16", "onebit", "qsgd", "terngrad", "powersgd:start_iter=1",
                "randomk", "topk", "dgc", "vote"]


def test_bf16_keras_model_trains_with_every_scheme_with_identical_ranks() -> None:
    ranks = run_ranks("tests.workers.tf_bf16:training", timeout=900, specs=BF16_SCHEMES)
    for spec in BF16_SCHEMES:
        r0, r1 = ranks[0][spec], ranks[1][spec]
        assert r0["dtypes"] == ["bfloat16"], (spec, r0["dtypes"])
        # Each rank drew its own weights; the callback gave every rank rank 0's.
        assert not np.array_equal(r0["initial"], r1["initial"]), spec
        assert np.array_equal(r0["weights"][0], r0["initial"]), spec
        assert np.array_equal(r1["weights"][0], r0["initial"]), spec
        assert len(r0["weights"]) == 5, spec
        for step, (w0, w1) in enumerate(zip(r0["weights"], r1["weights"])):
            assert np.isfinite(w0).all(), (spec, step)
            assert np.array_equal(w0, w1), f"{spec}: ranks differ after step {step}"
        assert not np.array_equal(r0["weights"][-1], r0["weights"][0]), f"{spec}: no training"
        if spec != "dgc":  # DGC runs the optimizer without momentum
            # Each rank added rank + 1 to its slots; the broadcast restored rank 0's.
            assert r0["momentum"] is not None and r0["momentum"].size > 0, spec
            assert np.array_equal(r0["momentum"], r1["momentum"]), spec
    assert ranks[0]["onebit"]["ratio"] > 10 and ranks[0]["vote"]["ratio"] > 10


def test_bf16_collectives_of_the_tf_binding_are_exact() -> None:
    ranks = run_ranks("tests.workers.tf_bf16:collectives")
    x0, x1 = bf16_value(0), bf16_value(1)
    # Summed in float32 (exact for two bfloat16 values of these magnitudes), rounded once.
    expected_sum = (x0.float() + x1.float()).to(torch.bfloat16)
    for rank, out in enumerate(ranks):
        assert out["allreduce"].dtype == torch.bfloat16
        assert torch.equal(out["allreduce"], expected_sum)
        assert [torch.equal(a, b) for a, b in zip(out["allgather"], (x0, x1))] == [True, True]
        own = slice(0, 400) if rank == 0 else slice(400, 1000)
        assert torch.equal(out["alltoall"][0], x0[own]) and torch.equal(out["alltoall"][1],
                                                                        x1[own])
        for name in ("broadcast", "broadcast_traced"):  # from rank 1: its bits everywhere
            assert torch.equal(out[name].view(torch.int16), x1.view(torch.int16)), name


def _vote(xs: list[np.ndarray]) -> np.ndarray:
    """sign(sum_i sign(x_i)), with sign(0) = +1 for inputs and ties."""
    count = sum(np.where(x >= 0, 1.0, -1.0) for x in xs)
    return np.where(count >= 0, 1.0, -1.0).astype(np.float32)


def test_majority_vote_through_the_tf_binding_is_exact() -> None:
    ranks = run_ranks("tests.workers.tf_vote:votes", numel=8000)
    size, numel = len(ranks), 8000
    expected = _vote([r["x"] for r in ranks])
    signs = sum(np.where(r["x"] >= 0, 1.0, -1.0) for r in ranks)
    assert (signs == 0).sum() > 1000  # ties occur with 2 ranks, and go to +1
    for result in ranks:
        for path in ("eager", "traced"):
            # op=hvd.Sum: the sum over ranks of the vote.
            assert np.array_equal(result[path], expected * size), path
            # 1 bit per element each way: each chunk's bits plus one flag byte.
            assert result[f"{path}_bytes"] == {"scatter": size * (numel // 16 + 1),
                                               "gather": numel // 16 + 1}, path
        # Keras SGD(lr) with Compression.vote() (averaged): every weight moves by lr * vote.
        lr = np.float32(result["lr"])
        for before, after, *grads in zip(result["before"], result["after"],
                                         *[r["grads"] for r in ranks]):
            assert np.array_equal(after, before - lr * _vote(list(grads)))
        assert np.array_equal(result["after"][0], ranks[0]["after"][0])
