"""The checks both bindings share (:mod:`hvd_compress.binding`): Horovod's arguments,
``compression=`` with Horovod's own compressors, and the module itself importable where
torch, TensorFlow and Horovod are not.

Run as ``python tests/frameworks_blocked.py tests.test_binding``, this file makes those
checks without any framework and prints what it saw (the first test does so). Its
module-level imports are therefore framework-free; torch and Horovod are imported inside
the tests that need them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hvd_compress.binding import (
    HOROVOD_COMPRESSORS,
    check_horovod_arguments,
    horovod_compressor,
    resolve_compression,
)

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "tensorflow", "horovod", "keras")

HOROVOD_OPS = types.SimpleNamespace(Average=0, Sum=1, Adasum=2)
"""``Average``, ``Sum`` and ``Adasum`` of ``horovod.torch`` and ``horovod.tensorflow``
(checked against both by the tests that import them)."""

VALID = {"op": 0, "gradient_predivide_factor": 1.0, "groups": None, "num_groups": 0}

ARGUMENT_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"op": 2}, "op must be hvd.Average or hvd.Sum, got op=hvd.Adasum: Adasum does not "
                "compose with gradient compression; pass op=hvd.Average (the default) or "
                "op=hvd.Sum"),
    ({"op": 7}, "op must be hvd.Average or hvd.Sum, got op=7: Adasum does not compose with "
                "gradient compression; pass op=hvd.Average (the default) or op=hvd.Sum"),
    ({"op": 1, "gradient_predivide_factor": 2.0},
     "gradient_predivide_factor=2.0 is only supported with op=hvd.Average, got op=hvd.Sum; "
     "pass op=hvd.Average or leave gradient_predivide_factor at 1.0"),
    ({"num_groups": 2}, "groups/num_groups are not supported by hvd_compress, got "
                        "num_groups=2; omit them (Horovod's tensor fusion still batches "
                        "small tensors)"),
    ({"groups": 3}, "groups/num_groups are not supported by hvd_compress, got groups=3; omit "
                    "them (Horovod's tensor fusion still batches small tensors)"),
    ({"backward_passes_per_step": 0},
     "backward_passes_per_step must be an integer >= 1, got 0"),
    ({"backward_passes_per_step": 1.5},
     "backward_passes_per_step must be an integer >= 1, got 1.5"),
]
"""Arguments that every wrapper refuses, and the message it raises ``ValueError`` with."""

KERAS_ACCUMULATION = "set gradient_accumulation_steps on the wrapped Keras optimizer instead"


def argument_error(horovod: Any, **kwargs: Any) -> str | None:
    """The message :func:`check_horovod_arguments` raises for ``VALID`` updated by
    ``kwargs``, or ``None`` when it accepts them."""
    try:
        check_horovod_arguments(horovod, **{**VALID, **kwargs})
    except ValueError as exc:
        return str(exc)
    return None


def framework_free_checks() -> dict[str, Any]:
    """What this module sees of :mod:`hvd_compress.binding` (run without the frameworks)."""
    out: dict[str, Any] = {}
    try:
        import torch  # noqa: F401
        out["torch"] = "imported"
    except ImportError as exc:
        out["torch"] = str(exc)
    out["errors"] = [argument_error(HOROVOD_OPS, **kwargs) for kwargs, _ in ARGUMENT_ERRORS]
    out["accepted"] = [argument_error(HOROVOD_OPS, op=op) for op in (0, 1)]
    out["keras_passes"] = argument_error(HOROVOD_OPS, backward_passes_per_step=2,
                                         accumulation=KERAS_ACCUMULATION)
    # Horovod's compressor classes, as Horovod 0.28 defines them, recognised by name alone.
    out["compressors"] = {}
    for framework in ("torch", "tensorflow"):
        for cls_name, scheme in (("NoneCompressor", "none"), ("FP16Compressor", "fp16")):
            cls = type(cls_name, (), {"__module__": f"horovod.{framework}.compression"})
            out["compressors"][f"{framework}.{cls_name}"] = [
                horovod_compressor(cls), horovod_compressor(cls()), scheme]
    lookalike = type("FP16Compressor", (), {"__module__": "mylib.compression"})
    out["lookalike"] = horovod_compressor(lookalike)
    out["loaded"] = sorted({name.split(".")[0] for name in sys.modules} & set(BLOCKED))
    return out


@pytest.mark.multiprocess
def test_shared_module_imports_and_checks_without_torch_tensorflow_or_horovod() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "frameworks_blocked.py"),
                           "tests.test_binding"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "torch is blocked" in out["torch"], out["torch"]  # the frameworks really were
    assert out["loaded"] == []
    assert out["errors"] == [message for _, message in ARGUMENT_ERRORS]
    assert out["accepted"] == [None, None]
    assert out["keras_passes"] == ("backward_passes_per_step must be 1 here, got 2: "
                                   f"{KERAS_ACCUMULATION}")
    for key, (of_class, of_instance, scheme) in out["compressors"].items():
        framework = key.split(".")[0]
        assert of_class == of_instance == [framework, scheme], key
    assert out["lookalike"] is None


def test_horovods_constants_are_the_ones_the_framework_free_checks_use() -> None:
    import horovod.torch as hvd

    assert (hvd.Average, hvd.Sum, hvd.Adasum) == (HOROVOD_OPS.Average, HOROVOD_OPS.Sum,
                                                 HOROVOD_OPS.Adasum)


@pytest.mark.parametrize(("kwargs", "message"), ARGUMENT_ERRORS)
def test_torch_optimizer_refuses_horovods_arguments_with_the_shared_message(
        kwargs: dict[str, Any], message: str) -> None:
    """Before ``hvd.init()``; the TensorFlow wrappers' messages are compared with the same
    list in tests/test_tensorflow_parity.py."""
    import horovod.torch as hvd
    import torch

    from hvd_compress.torch import DistributedOptimizer

    assert argument_error(hvd, **kwargs) == message
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError) as err:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert str(err.value) == message


def test_horovods_torch_compressors_are_the_table_s_classes() -> None:
    """The names in :data:`HOROVOD_COMPRESSORS` are those of Horovod's real classes (the
    TensorFlow ones are checked where TensorFlow is imported, in
    tests/test_tensorflow_parity.py)."""
    import horovod.torch as hvd

    for compressor, scheme in ((hvd.Compression.none, "none"), (hvd.Compression.fp16, "fp16")):
        assert isinstance(compressor, type)  # Horovod's compressors are classes
        qualified = f"{compressor.__module__}.{compressor.__qualname__}"
        assert HOROVOD_COMPRESSORS["torch"][qualified] == scheme
        assert horovod_compressor(compressor) == ("torch", scheme)


def test_a_lookalike_compressor_or_an_unknown_framework_is_refused() -> None:
    lookalike = type("FP16Compressor", (), {"__module__": "mylib.compression"})
    with pytest.raises(TypeError) as err:
        resolve_compression(lookalike, "torch")
    assert str(err.value).endswith("; got the class mylib.compression.FP16Compressor")
    with pytest.raises(ValueError, match=r"framework must be one of \('torch', 'tensorflow'\), "
                                         r"got 'jax'"):
        resolve_compression(None, "jax")


if __name__ == "__main__":
    print(json.dumps(framework_free_checks()))
