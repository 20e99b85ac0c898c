"""The Keras ``OneBitAdam`` (:mod:`hvd_compress.tensorflow.onebit_adam`) on 2 Gloo ranks, with
L2 weight decay: Keras Adam on Horovod-averaged gradients (plus the decay) bit for bit
through the warm-up; afterwards identical ranks, the torch ``OneBitAdam``'s update on the
same inputs (to float32 rounding) with the same bytes, an exact resume from a checkpoint;
``model.fit`` on digits as accurate as Keras Adam; bad arguments refused at construction.

TensorFlow is imported only in the processes these tests start (it costs seconds)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.tensorflow]
FREEZE, STEPS = 4, 10


@pytest.fixture(scope="module")
def parity() -> list[dict[str, Any]]:
    return run_ranks("tests.workers.tf_onebit_adam:parity", freeze_step=FREEZE, steps=STEPS)


def test_warmup_is_keras_adam_on_averaged_gradients_bit_for_bit(
        parity: list[dict[str, Any]]) -> None:
    for rank in parity:
        assert len(rank["onebit"]) == len(rank["adam"]) == STEPS
        for step in range(FREEZE):
            assert np.array_equal(rank["onebit"][step], rank["adam"][step]), step
            assert not np.array_equal(rank["onebit"][step], rank["initial"]), step
        # The compressed stage is another update.
        assert not np.array_equal(rank["onebit"][-1], rank["adam"][-1])
        for step in range(FREEZE):  # the warm-up sent float32, uncompressed
            stats = rank["stats"][step]
            assert stats["payload_bytes"] == stats["dense_bytes"] == 4 * rank["initial"].size
            assert stats["compressed_tensors"] == 0


def test_ranks_stay_identical_after_every_step(parity: list[dict[str, Any]]) -> None:
    r0, r1 = parity
    for step in range(STEPS):
        assert np.array_equal(r0["onebit"][step], r1["onebit"][step]), step
        assert np.array_equal(r0["momentum"][step], r1["momentum"][step]), step


def test_compressed_update_is_the_torch_onebit_adams(parity: list[dict[str, Any]]) -> None:
    """From the freeze on, the torch ``OneBitAdam`` at the same state and fed the same
    gradients on each rank: the same weights and momentum after every step, to float32
    rounding (the frameworks round the element-wise operations differently; 1-bit codes of
    the same signs and scales that differ in their last bits), with the same bytes on the
    wire, round by round."""
    for rank in parity:
        compressed = rank["onebit"][FREEZE:]
        assert len(rank["torch"]) == len(compressed) == STEPS - FREEZE
        previous = rank["onebit"][FREEZE - 1]
        for step, (keras_w, torch_w, keras_m, torch_m) in enumerate(zip(
                compressed, rank["torch"], rank["momentum"][FREEZE:], rank["torch_momentum"])):
            moved = np.abs(keras_w - previous)
            assert moved.max() > 1e-4, step  # a real update, not rounding noise
            # The updates agree to 2e-5 of the largest step (measured: under 1e-5).
            np.testing.assert_allclose(keras_w - previous, torch_w - previous, rtol=1e-4,
                                       atol=2e-5 * moved.max())
            np.testing.assert_allclose(keras_m, torch_m, rtol=1e-4,
                                       atol=1e-5 * np.abs(torch_m).max())
            previous = keras_w
        for keras_stats, torch_stats in zip(rank["stats"][FREEZE:], rank["torch_stats"]):
            assert keras_stats == torch_stats
            assert keras_stats["compressed_tensors"] == 3  # the kernels; biases go dense
            assert keras_stats["dense_bytes"] / keras_stats["payload_bytes"] > 16
        assert rank["totals_steps"] == STEPS


def test_resume_mid_compression_gives_the_same_next_step(
        parity: list[dict[str, Any]]) -> None:
    """A ``tf.train.Checkpoint`` (and Keras' ``save_own_variables`` store) written two steps
    into the compressed stage, restored into a new model and optimizer: the same next step
    bit for bit, residuals included (without them the step differs)."""
    for rank in parity:
        expected = rank["onebit"][FREEZE + 2]
        assert np.array_equal(rank["resumed_checkpoint"], expected)
        assert np.array_equal(rank["resumed_store"], expected)
        assert not np.array_equal(rank["resumed_store_without_residuals"], expected)


def test_bad_arguments_are_refused_at_construction(parity: list[dict[str, Any]]) -> None:
    errors = parity[0]["errors"]
    assert errors.pop("defaults") is None
    for label in ("freeze_negative", "freeze_zero", "freeze_float", "freeze_bool"):
        assert errors[label].startswith("ValueError: OneBitAdam: freeze_step must be an "
                                        "integer >= 1"), errors[label]
    assert errors["qsgd"].startswith("ValueError: OneBitAdam needs a compression scheme "
                                     "with error feedback"), errors["qsgd"]
    assert "Compression.parse('onebit')" in errors["string"]
    assert errors["string"].startswith("TypeError: ")
    for label, option in (("amsgrad", "amsgrad=True"), ("clipnorm", "clipnorm=1.0"),
                          ("accumulation", "gradient_accumulation_steps=2"),
                          ("ema", "use_ema=True")):
        assert errors[label].startswith(f"ValueError: OneBitAdam does not support {option}: "
                                        ), errors[label]
    assert errors["beta_1"] == "ValueError: OneBitAdam: beta_1 must be a number in [0.0, " \
                               "1.0), got 1.0"
    assert errors["epsilon"] == "ValueError: OneBitAdam: epsilon must be a number >= 0.0, " \
                                "got -1e-08"
    assert "weight_decay must be a number >= 0.0, got -0.1" in errors["weight_decay"]
    assert "learning_rate must be >= 0, got -1.0" in errors["learning_rate"]
    assert errors["wrapped"].startswith("OneBitAdam averages across ranks by itself"), errors


def test_model_fit_on_digits_is_as_accurate_as_keras_adam() -> None:
    """``model.fit`` (the step traced, the stage chosen in the graph) on 2 ranks for 30
    epochs of 22 steps, frozen after 100: within 1 point of uncompressed Keras Adam's test
    accuracy, identical ranks, more than 16x fewer bytes per step after the freeze."""
    ranks = run_ranks("tests.workers.tf_onebit_adam:fit_digits", timeout=600,
                      freeze_step=100, epochs=30)
    r0, r1 = ranks
    assert r0["steps_per_epoch"] == 22
    for label in ("adam", "onebit"):
        assert r0[label]["iterations"] == 22 * 30
        assert np.array_equal(r0[label]["weights"], r1[label]["weights"]), label
    adam, onebit = r0["adam"]["accuracy"], r0["onebit"]["accuracy"]
    assert adam > 90, adam
    assert onebit > adam - 1.0, (onebit, adam)
    stats = r0["onebit"]["stats"]
    assert stats["compressed_tensors"] == 3
    assert stats["dense_bytes"] / stats["payload_bytes"] > 16
