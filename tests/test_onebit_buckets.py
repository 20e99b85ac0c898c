"""1-bit's own bucket size: the optimizers' default ``bucket_mb`` follows the scheme's
``fusion_mb`` (:func:`hvd_compress.policy.default_bucket_mb`); a given ``bucket_mb``
always wins."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hvd_compress import Compression
from hvd_compress.fusion import assign_buckets
from hvd_compress.policy import DEFAULT_BUCKET_MB, default_bucket_mb
from tests.harness import ROOT, rank_env


def test_onebit_names_its_bucket_size_and_the_others_keep_the_default() -> None:
    assert default_bucket_mb(Compression.onebit()) == 8.01
    assert default_bucket_mb(Compression.onebit(bucket_size=32, start_iter=4)) == 8.01
    for scheme in (Compression.topk(ratio=0.001), Compression.qsgd(bits=4),
                   Compression.fp16(), Compression.none(), object()):
        assert default_bucket_mb(scheme) == DEFAULT_BUCKET_MB == 64.0


def test_onebit_buckets_hold_a_2m_layer_with_its_bias() -> None:
    """On the 8.4 M-parameter MLP (backward order, biases passed dense) the 1-bit buckets
    put each 2 M-element layer with a bias, and the 4 M-element layer alone: the last
    layer's rounds can start while backward computes the other two."""
    names = ["fc3.b", "fc3.w", "fc2.b", "fc2.w", "fc1.b", "fc1.w"]
    numels = [1024, 1024 * 2048, 2048, 2048 * 2048, 2048, 2048 * 1024]
    cap = int(default_bucket_mb(Compression.onebit()) * 2**20)
    assert assign_buckets(names, numels, cap) == [["fc3.b", "fc3.w"], ["fc2.b"], ["fc2.w"],
                                                   ["fc1.b", "fc1.w"]]
    assert assign_buckets(names, numels, int(DEFAULT_BUCKET_MB * 2**20)) == [names]


SIZE_ONE = """
import horovod.torch as hvd, torch
from hvd_compress import Compression
from hvd_compress.torch import DistributedOptimizer
hvd.init()
MIB = 2**20
for compression, given, expected in (
        (Compression.onebit(), {}, int(8.01 * MIB)),
        (Compression.onebit(), {"bucket_mb": 64}, 64 * MIB),
        (Compression.onebit(), {"bucket_mb": None}, None),
        (Compression.fp16(), {}, 64 * MIB),
        (Compression.topk(ratio=0.01), {"bucket_mb": 2}, 2 * MIB)):
    model = torch.nn.Linear(64, 32)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=compression, **given)
    assert opt._pipeline.bucket_bytes == expected, (compression, given,
                                                    opt._pipeline.bucket_bytes)
    model(torch.ones(3, 64)).sum().backward()
    opt.step()
print("OK")
"""


@pytest.mark.multiprocess
def test_the_torch_optimizer_takes_the_schemes_bucket_size_unless_given() -> None:
    """``hvd.init()`` at size 1 in a fresh interpreter (not this one)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SIZE_ONE)], cwd=ROOT,
                          env=rank_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), \
        done.stdout[-3000:] + done.stderr[-3000:]

