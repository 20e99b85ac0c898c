"""``hierarchy="host"`` in the TensorFlow binding (tape and Keras optimizer): its refusals,
in process, and 4 real Horovod ranks as 2 emulated hosts of 2 (one launch)."""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness import launch_command, rank_env, run_command
from tests.servers import ServerProcess

pytestmark = pytest.mark.tensorflow

TAPE_SPECS = ["none", "onebit:bucket_size=64", "powersgd:rank=2,start_iter=1",
              "topk:ratio=0.05"]
KERAS_SPECS = ["none", "qsgd:bucket_size=64"]
HOST_ENV = {"HVD_COMPRESS_RANKS_PER_HOST": "2", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def _run_ranks(np_: int, timeout: float, **kwargs: Any) -> list[Any]:
    """``tests.workers.tf_hierarchy`` on ``np_`` ``horovodrun --gloo`` ranks (Horovod's
    TensorFlow library alone, see that module); each rank's result."""
    with tempfile.TemporaryDirectory(prefix="hvdc-tf-hier-") as out:
        cmd = [*launch_command("gloo", np_), sys.executable, "-m", "tests.workers.tf_hierarchy",
               out, json.dumps(kwargs)]
        done = run_command(cmd, timeout, {**rank_env(), **HOST_ENV})
        results = [Path(out) / f"rank{r}.pkl" for r in range(np_)]
        if done.returncode != 0 or not all(p.exists() for p in results):
            raise AssertionError(f"tests.workers.tf_hierarchy on {np_} ranks exited with "
                                 f"{done.returncode}; output:\n{done.stdout[-6000:]}")
        return [pickle.loads(p.read_bytes()) for p in results]


def _refusals() -> list[tuple[dict, str]]:
    import horovod.tensorflow as hvd

    from hvd_compress import Compression

    return [({"hierarchy": "rack"}, "must be one of"),
            ({"compression": Compression.auto()}, "Compression.auto"),
            ({"ps": "mpi"}, "gRPC servers only"),
            ({"process_set": hvd.ProcessSet([0])}, "process_set=None")]


def test_the_tensorflow_binding_refuses_what_two_levels_cannot_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any collective (no Horovod started here), with the torch optimizer's
    messages."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from hvd_compress.tensorflow import DistributedGradientTape
    from hvd_compress.tensorflow.keras import DistributedOptimizer

    for options, message in _refusals():
        options = {"hierarchy": "host", **options}
        with pytest.raises(ValueError, match=message):
            DistributedGradientTape(tf.GradientTape(), **options)
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(keras.optimizers.SGD(), **options)
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(ValueError, match="elastic"):
        DistributedGradientTape(tf.GradientTape(), hierarchy="host")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_hosts_of_two_ranks_agree_resume_and_match_the_flat_route() -> None:
    """Tape under ``tf.function`` against an eager resume from each rank's own state;
    ``none`` bit for bit the flat route's; top-k's pairs through a server of 2 workers (the
    hosts); the Keras optimizer's replicas identical."""
    server = ServerProcess(["--bind", "127.0.0.1:0", "--workers", "2", "--deadline", "60"])
    try:
        ranks = _run_ranks(4, timeout=280, specs=TAPE_SPECS, keras_specs=KERAS_SPECS,
                           ps=f"grpc://{server.address}")
    finally:
        server.kill()
    for spec in TAPE_SPECS:
        first = ranks[0]["tape"][spec]
        for rank in ranks:
            for name, value in rank["tape"][spec]["two"].items():
                np.testing.assert_array_equal(value, first["two"][name], err_msg=spec)
                np.testing.assert_array_equal(rank["tape"][spec]["resumed"][name], value,
                                              err_msg=f"{spec} resumed")
                assert np.abs(value).sum() > 0, (spec, name)
        stats = [r["tape"][spec]["stats"] for r in ranks]
        assert [s["layout"]["local_rank"] for s in stats] == [0, 1, 0, 1]
        assert {s["layout"]["hosts"] for s in stats} == {2}
        assert all(s["collective_bytes"]["host"] > 0 for s in stats), spec
        cross = "ParameterServerCommunicator" if spec.startswith("topk") \
            else "HostTwoLevelCommunicator" if spec.startswith("powersgd") \
            else "HorovodTFCommunicator"
        assert all(s["cross"] == cross for s in stats), spec
        # Compressed pieces: sliced row blocks ("w#0") or whole tensors (PowerSGD's rounds).
        compressed = set().union(*(s["compressed"] for s in stats))
        assert bool(compressed) == (spec != "none"), (spec, compressed)
    assert ranks[0]["tape"]["onebit:bucket_size=64"]["stats"]["layout"]["split"] == "slices"
    assert ranks[0]["tape"]["powersgd:rank=2,start_iter=1"]["stats"]["layout"]["split"] \
        == "rounds"  # the flat algorithm, its all-reduces in two levels
    assert "sparse" in ranks[0]["tape"]["topk:ratio=0.05"]["stats"]["collective_bytes"]
    none = ranks[0]["tape"]["none"]
    for name, value in none["flat"].items():
        np.testing.assert_array_equal(none["two"][name], value, err_msg=name)
    for spec in KERAS_SPECS:
        first = ranks[0]["keras"][spec]["two"]
        for rank in ranks:
            for name, value in rank["keras"][spec]["two"].items():
                np.testing.assert_array_equal(value, first[name], err_msg=f"keras {spec}")
    # Keras' SGD with learning rate 1 makes the tape's update: the same aggregates.
    for name, value in ranks[0]["keras"]["none"]["two"].items():
        np.testing.assert_array_equal(value, none["flat"][name], err_msg=f"keras {name}")
