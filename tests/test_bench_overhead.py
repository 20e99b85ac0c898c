"""``bench overhead``'s measurement of each exchange alone (:func:`hvd_compress.bench.
overhead.own_costs`): DDP's hook on a stand-in of its bucket against our pipeline, on the
same gradients, without a training step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_compress.bench import overhead

WORKER = """
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from hvd_compress.bench.overhead import OneBucket, one_rank_world

with one_rank_world():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(40, 30, generator=gen), torch.randn(30, generator=gen),
             torch.randn(20, 40, generator=gen)]
    bucket = OneBucket(grads)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                               start_powerSGD_iter=2, use_error_feedback=True,
                               warm_start=True)
    for step in range(4):
        bucket.refill()
        assert torch.equal(bucket.buffer(), bucket.flat)
        out = psgd.powerSGD_hook(state, bucket).wait()
        assert out.data_ptr() == bucket.buffer().data_ptr()
        views = bucket.gradients()
        assert [v.shape for v in views] == [g.shape for g in grads]
        # the views are the buffer: what the hook wrote into them is the buffer's content
        assert torch.equal(torch.cat([v.reshape(-1) for v in views]), bucket.buffer())
        if step < 2:  # a plain all-reduce of one rank: the gradients as they were
            assert torch.equal(bucket.buffer(), bucket.flat)
    # compressed after its start: the buffer holds the low-rank aggregate
    assert not torch.equal(bucket.buffer(), bucket.flat)
    assert torch.equal(views[1], grads[1])  # the vector is sent uncompressed
    print("ok")
"""


@pytest.mark.multiprocess
def test_the_stand_in_bucket_is_what_powersgd_hook_works_on(tmp_path: Path) -> None:
    """The hook reads and writes the stand-in's buffer through its gradient views, sends a
    vector as it is and the matrices compressed after its start, as on DDP's bucket."""
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


ROUNDS_WORKER = """
import json
import torch
import torch.distributed as dist
from hvd_compress import Compression
from hvd_compress.bench.cluster_rank import MODELS, RoundsOnly, _loss, rounds_only_hook
from hvd_compress.bench.overhead import OneBucket, one_rank_world
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.pipeline import Pipeline

with one_rank_world():
    workload = MODELS["transformer"]
    model = workload.build(0)
    inputs, target = workload.batch(torch.Generator().manual_seed(0))
    _loss(model(inputs), target).backward()
    named = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()][::-1]
    scheme = Compression.powersgd(rank=4, start_iter=1)
    pipeline = Pipeline(scheme, HorovodTorchCommunicator(None))
    pipeline.plan([n for n, _ in named], [g.shape for _, g in named])
    for _ in range(2):  # the second step is compressed
        for name, grad in named:
            pipeline.submit(name, grad)
        pipeline.wait()
    sent = []
    all_reduce = dist.all_reduce
    def record(tensor, *args, **kwargs):
        sent.append(tensor.element_size() * tensor.numel())
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = record
    bucket = OneBucket([g for _, g in named])
    state = RoundsOnly(scheme)
    out = rounds_only_hook(state, bucket).wait()
    kept = [t.data_ptr() for t in state.rounds[bucket.index()]]
    again = rounds_only_hook(state, bucket).wait()  # the next step: the same buffers
    print(json.dumps({"ours": pipeline.last_step.collective_bytes, "floor": sent,
                      "zeros": not out.any().item() and not again.any().item(),
                      "in_place": out.data_ptr() == bucket.buffer().data_ptr(),
                      "kept": kept == [t.data_ptr() for t in state.rounds[bucket.index()]]}))
"""


@pytest.mark.multiprocess
def test_the_rounds_floor_sends_what_our_powersgd_sends() -> None:
    """``bench cluster``'s ``rounds-powersgd`` floor on the transformer's gradients: its
    two all-reduces carry the bytes of our pipeline's rounds at the same rank, the dense
    tensors with every ``P`` and then every ``Q``, step after step from the same buffers,
    and the bucket comes back as zeros."""
    done = subprocess.run([sys.executable, "-c", ROUNDS_WORKER], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ours = result["ours"]
    assert set(ours) == {"dense", "P", "Q"}
    assert result["floor"] == [ours["dense"] + ours["P"], ours["Q"]] * 2  # two steps
    assert result["zeros"] and result["in_place"] and result["kept"]


@pytest.mark.multiprocess
def test_overhead_bench_times_every_system_side_by_side(tmp_path: Path) -> None:
    """The harness, in a process of its own: each system trains the model, our optimizer's
    phases are measured, the hook's and our own CPU per step are the differences of the
    rows' CPU times; every exchange alone has a CPU time per step, the hook's without its
    refill; the ratios and target lines come from those figures."""
    out = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, "-m", "hvd_compress.bench", "overhead",
                           "--models", "tiny", "--steps", "3", "--warmup", "3",
                           "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert set(row["step_s"]) == {"floor", "ddp", "hook", "ours", "alternate"}
    assert all(t > 0 for t in row["step_s"].values())
    alone = row["alone_cpu_s"]
    assert set(alone) == set(overhead.ALONE)
    assert all(seconds > 0 for name, seconds in alone.items() if name != "hook")
    for system in ("ours", "alternate"):
        if alone["hook"] > 0:
            assert row["alone_ratio"][system] == pytest.approx(alone[system] / alone["hook"])
            assert f"tiny: our exchange alone{'' if system == 'ours' else ' (alternate)'}" \
                in done.stdout
