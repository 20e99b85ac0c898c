"""The pipeline on in-process ranks: routing, aggregation, bad input, state."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Pipeline, Policy
from hvd_compress.comm.ops import AllReduce
from hvd_compress.comm.threads import ThreadGroup
from tests.threaded import make_pipelines, on_threads


@pytest.mark.parametrize("spec", ["onebit:bucket_size=16", "bf16",
                                  "qsgd:bucket_size=16,error_feedback=True"])
def test_three_ranks_aggregate_the_decoded_contributions(spec: str) -> None:
    """Uneven chunks (3 ranks, 100 elements, buckets of 16): the identity still holds."""
    scheme = Compression.parse(spec)
    pipes = make_pipelines(scheme, 3)
    xs = [torch.randn(10, 10) for _ in range(3)]
    out = on_threads(3, lambda r: pipes[r].reduce({"w": xs[r]})["w"])
    assert all(torch.equal(o, out[0]) for o in out)
    if scheme.error_feedback:
        sent = sum(x - p.feedback.get("w") for x, p in zip(xs, pipes))
        kept = torch.cat([p.scheme_state("w")["chunk_residual"] for p in pipes]).view(10, 10)
        torch.testing.assert_close(out[0] + kept, sent)
    else:
        torch.testing.assert_close(out[0], sum(xs), rtol=0.02, atol=0.02)


def test_average_and_prescale() -> None:
    group = ThreadGroup(2)
    pipes = [Pipeline(Compression.none, group.communicator(r), average=True, prescale=4.0)
             for r in range(2)]
    xs = [torch.full((3,), 2.0), torch.full((3,), 4.0)]
    out = on_threads(2, lambda r: pipes[r].reduce({"b": xs[r]})["b"])
    torch.testing.assert_close(out[0], torch.full((3,), 3.0))


def test_policy_routes_small_and_one_dimensional_tensors_dense() -> None:
    pipe = make_pipelines(Compression.onebit(), 1, Policy())[0]
    assert pipe.route("w", torch.Size([64, 64])) is pipe.scheme
    assert pipe.route("b", torch.Size([4096])).name == "none"
    assert pipe.route("small", torch.Size([8, 8])).name == "none"
    pipe.reduce({"w": torch.randn(64, 64), "b": torch.randn(4096)})
    stats = pipe.last_step
    assert stats.compressed_tensors == 1 and stats.dense_tensors == 1
    assert stats.payload_bytes == Compression.onebit().payload_bytes(torch.Size([64, 64])) \
        + 4 * 4096
    assert set(stats.collective_bytes) == {"scatter", "gather", "dense"}


def test_dtype_is_kept_and_empty_tensors_pass_through() -> None:
    pipe = make_pipelines(Compression.onebit(bucket_size=8), 1)[0]
    out = pipe.reduce({"h": torch.randn(32, 4, dtype=torch.float64),
                       "e": torch.zeros(0, 5)})
    assert out["h"].dtype == torch.float64 and out["e"].shape == (0, 5)


def test_bad_input_is_refused_before_any_communication() -> None:
    pipe = make_pipelines(Compression.onebit(), 1)[0]
    with pytest.raises(TypeError, match=r"'idx' has dtype torch\.int64"):
        pipe.submit("idx", torch.arange(10))
    with pytest.raises(TypeError, match="sparse"):
        pipe.submit("s", torch.eye(3).to_sparse())
    pipe.submit("w", torch.randn(16, 16))
    with pytest.raises(RuntimeError, match="submitted twice"):
        pipe.submit("w", torch.randn(16, 16))
    pipe.wait()
    assert not pipe.pending


def test_nonfinite_gradient_fails_every_rank_and_keeps_state() -> None:
    pipes = make_pipelines(Compression.onebit(bucket_size=16), 2)
    good = [{"w": torch.randn(8, 8)} for _ in range(2)]
    on_threads(2, lambda r: pipes[r].reduce(good[r]))
    before = [p.state_dict() for p in pipes]
    bad = [{"w": good[0]["w"].clone()}, {"w": good[1]["w"].clone()}]
    bad[1]["w"][0, 0] = float("inf")

    def step(rank: int) -> str:
        with pytest.raises(NonFiniteGradientError) as info:
            pipes[rank].reduce(bad[rank])
        return str(info.value)

    messages = on_threads(2, step)
    assert "rank (1) produced non-finite values for ['w']" in messages[1]
    assert "another rank did not" in messages[0]
    for p, b in zip(pipes, before):
        after = p.state_dict()
        assert after["steps"] == b["steps"]
        assert torch.equal(after["residuals"]["w"], b["residuals"]["w"])
        assert torch.equal(after["scheme_state"]["w"]["chunk_residual"],
                           b["scheme_state"]["w"]["chunk_residual"])
    out = on_threads(2, lambda r: pipes[r].reduce(good[r])["w"])  # the job goes on
    assert torch.isfinite(out[0]).all()


def test_state_dict_resumes_exactly_and_rejects_another_scheme() -> None:
    spec = "powersgd:rank=2,start_iter=1"
    grads = [[torch.randn(16, 12) for _ in range(4)] for _ in range(2)]
    first = make_pipelines(Compression.parse(spec), 2)
    for t in range(3):
        on_threads(2, lambda r, t=t: first[r].reduce({"w": grads[r][t]}))
    saved = [p.state_dict() for p in first]
    second = make_pipelines(Compression.parse(spec), 2)
    for p, s in zip(second, saved):
        p.load_state_dict(s)
    a = on_threads(2, lambda r: first[r].reduce({"w": grads[r][3]})["w"])
    b = on_threads(2, lambda r: second[r].reduce({"w": grads[r][3]})["w"])
    assert torch.equal(a[0], b[0])
    other = make_pipelines(Compression.powersgd(rank=3), 1)[0]
    with pytest.raises(ValueError, match="construct the optimizer with the same compression"):
        other.load_state_dict(saved[0])


def test_a_missing_rank_times_out_with_its_number() -> None:
    group = ThreadGroup(2, timeout=0.2)
    comm = group.communicator(0)
    handle = comm.start("hvdc.w.dense", AllReduce("dense", torch.ones(2)))
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        comm.wait(handle)
