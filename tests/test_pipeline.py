"""The pipeline on in-process ranks: routing, aggregation, bad input, state, fused rounds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Pipeline, Policy
from hvd_compress.comm.ops import AllReduce, AllToAll
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.base import Exchange, ExchangeContext, LowRank, Outcome, Scheme
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


# Fused rounds (buckets) ---------------------------------------------------------------------
# A small model in backward order: three matrices routed to the scheme, three 1-D biases
# routed dense by the policy.
MODEL = {"fc3.bias": (5,), "fc3.weight": (5, 24), "fc2.bias": (24,), "fc2.weight": (24, 16),
         "fc1.bias": (16,), "fc1.weight": (16, 3, 3)}
DENSE_1D = Policy(min_numel=1)

FUSION_SPECS = ["none", "fp16", "bf16", "onebit:bucket_size=16",
                "qsgd:bucket_size=16,error_feedback=True",
                "terngrad:bucket_size=16,error_feedback=True", "powersgd:rank=2,start_iter=1",
                "randomk:ratio=0.25", "topk:ratio=0.1", "dgc:ratio=0.1"]


def _grads(size: int, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    return [[{n: torch.randn(s, generator=gen) for n, s in MODEL.items()} for _ in range(steps)]
            for _ in range(size)]


def _run(spec: str, size: int, bucket_bytes: int | None, mode: str,
         grads: list[list[dict[str, torch.Tensor]]]
         ) -> tuple[list[list[dict[str, torch.Tensor]]], list[Pipeline], list[list[int]]]:
    """Every rank's aggregates per step, its pipeline, and its collectives per step.

    ``mode``: ``plan`` (plan in backward order, submit in that order), ``shuffled`` (the
    same plan, but each rank submits in its own order) or ``reduce`` (no plan)."""
    pipes = make_pipelines(Compression.parse(spec), size, DENSE_1D, bucket_bytes=bucket_bytes)

    def work(rank: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
        pipe = pipes[rank]
        if mode != "reduce":
            pipe.plan(list(MODEL), [torch.Size(s).numel() for s in MODEL.values()])
        out, counts = [], []
        for step, tensors in enumerate(grads[rank]):
            names = list(tensors)
            if mode == "shuffled":
                order = torch.randperm(len(names), generator=torch.Generator().manual_seed(
                    100 * rank + step))
                names = [names[i] for i in order]
            if mode == "reduce":
                out.append(pipe.reduce({n: tensors[n] for n in reversed(names)}))
            else:
                for name in names:
                    pipe.submit(name, tensors[name])
                out.append(pipe.wait())
            counts.append(pipe.last_step.collectives)
        return out, counts

    results = on_threads(size, work)
    return [r[0] for r in results], pipes, [r[1] for r in results]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("spec", FUSION_SPECS)
def test_fused_rounds_are_bit_identical_to_one_collective_per_tensor(spec: str,
                                                                     size: int) -> None:
    grads = _grads(size, steps=3)
    ref, ref_pipes, ref_counts = _run(spec, size, 1, "plan", grads)
    # Buckets of several sizes, with and without a plan, ranks submitting in their own order.
    for bucket_bytes, mode in [(None, "plan"), (1000, "shuffled"), (None, "reduce"),
                               (600, "reduce")]:
        out, pipes, counts = _run(spec, size, bucket_bytes, mode, grads)
        for rank in range(size):
            for step in range(len(grads[rank])):
                for name in MODEL:
                    assert torch.equal(out[rank][step][name], ref[rank][step][name]), \
                        (bucket_bytes, mode, rank, step, name)
            got, want = pipes[rank].state_dict(), ref_pipes[rank].state_dict()
            assert got["steps"] == want["steps"]
            assert got["residuals"].keys() == want["residuals"].keys()
            assert all(torch.equal(got["residuals"][k], v) for k, v in want["residuals"].items())
            assert got["scheme_state"].keys() == want["scheme_state"].keys()
            for name, st in want["scheme_state"].items():
                assert all(torch.equal(got["scheme_state"][name][k], v) for k, v in st.items())
            # Bytes stay counted per tensor, whatever travelled together.
            assert dict(pipes[rank].total.collective_bytes) == \
                dict(ref_pipes[rank].total.collective_bytes)
            assert pipes[rank].total.payload_bytes == ref_pipes[rank].total.payload_bytes
            # Fewer collectives (at least the three dense biases travel together when the
            # whole step is one bucket), never more.
            fewer = [c < r if bucket_bytes is None else c <= r
                     for c, r in zip(counts[rank], ref_counts[rank])]
            assert all(fewer), (bucket_bytes, mode, counts[rank], ref_counts[rank])


@pytest.mark.parametrize(("spec", "steps"), [
    # PowerSGD, start_iter=1: step 0 is one all-reduce of all six gradients; then phase 0
    # is one all-reduce of the three P and the three biases, phase 1 one of the three Q.
    ("powersgd:rank=2,start_iter=1", [(6, 1), (9, 2), (9, 2)]),
    # Compressed all-reduce: phase 0 an all-to-all (matrices) and an all-reduce (biases),
    # phase 1 an all-gather.
    ("onebit:bucket_size=16", [(9, 3)] * 3),
    # fp16 on a CPU: the compressed all-reduce, as 1-bit (float32 biases ride phase 0).
    ("fp16", [(9, 3)] * 3),
    ("none", [(6, 1)] * 3),
    ("topk:ratio=0.1", [(6, 4)] * 3),  # sparse sums travel alone; the biases together
])
def test_collectives_per_step_are_phases_times_groups(spec: str,
                                                      steps: list[tuple[int, int]]) -> None:
    grads = _grads(2, steps=len(steps))
    _, _, unfused = _run(spec, 2, 1, "plan", grads)
    _, _, fused = _run(spec, 2, None, "plan", grads)
    assert unfused == [[u for u, _ in steps]] * 2
    assert fused == [[f for _, f in steps]] * 2
    # Two buckets (matrices and biases split as [fc3.*, fc2.bias] / [fc2.weight] /
    # [fc1.*]) cost one collective per bucket, phase and group.
    _, _, three = _run(spec, 2, 1000, "plan", grads)
    assert all(f <= t <= u for f, t, u in zip(fused[0], three[0], unfused[0]))


def test_a_bucket_starts_once_its_last_member_is_submitted() -> None:
    pipes = make_pipelines(Compression.parse("powersgd:rank=2,start_iter=0"), 2, DENSE_1D,
                           bucket_bytes=1000, record=True)
    grads = _grads(2, steps=1)

    def work(rank: int) -> tuple[list[int], list[str], list[str]]:
        pipe = pipes[rank]
        buckets = pipe.plan(list(MODEL), [torch.Size(s).numel() for s in MODEL.values()])
        assert buckets == [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight"],
                           ["fc1.bias", "fc1.weight"]]
        started = []
        # Backward order, except that fc3.weight comes after fc2.bias.
        for name in ["fc3.bias", "fc2.bias", "fc3.weight", "fc2.weight", "fc1.bias"]:
            pipe.submit(name, grads[rank][0][name])
            started.append(len(pipe.comm.started))
        before_wait = list(pipe.comm.names)
        pipe.submit("fc1.weight", grads[rank][0]["fc1.weight"])
        out = pipe.wait()
        assert set(out) == set(MODEL)
        return started, before_wait, pipe.comm.names

    results = on_threads(2, work)
    started, before_wait, names = results[0]
    # Nothing until fc3.weight completes bucket 0; fc2.weight is a bucket alone.
    assert started == [0, 0, 1, 2, 2]
    assert before_wait[0].startswith("hvdc.b0.0.allreduce.")  # P of fc3 + both biases
    assert before_wait[1] == "hvdc.fc2.weight.P"
    # Every rank starts the same names (Horovod matches by name).
    assert names == results[1][2]
    assert len(names) == len(set(names)) == 1 + 1 + 1 + 1 + 1 + 1
    assert pipes[0].last_step.collectives == 6


def test_a_planned_bucket_with_members_missing_starts_at_wait() -> None:
    pipes = make_pipelines(Compression.none, 2, DENSE_1D, record=True)

    def work(rank: int) -> dict[str, torch.Tensor]:
        pipes[rank].plan(["c", "b", "a"], [4, 4, 4])
        pipes[rank].submit("c", torch.full((4,), 1.0 + rank))
        pipes[rank].submit("a", torch.full((4,), 10.0 * (rank + 1)))
        assert pipes[rank].comm.started == []
        return pipes[rank].wait()

    out = on_threads(2, work)
    assert torch.equal(out[0]["c"], torch.full((4,), 3.0))
    assert torch.equal(out[1]["a"], torch.full((4,), 30.0))
    assert pipes[0].comm.names == pipes[1].comm.names
    assert len(pipes[0].comm.names) == 1


def test_plan_less_reduce_fuses_in_sorted_name_order_on_every_rank() -> None:
    pipes = make_pipelines(Compression.none, 3, DENSE_1D, record=True)
    xs = [{"w": torch.full((2, 3), float(r)), "b": torch.full((3,), 1.0 + r),
           "a": torch.full((1,), 5.0)} for r in range(3)]
    orders = [["w", "b", "a"], ["a", "b", "w"], ["b", "w", "a"]]
    out = on_threads(3, lambda r: pipes[r].reduce({n: xs[r][n] for n in orders[r]}))
    for o in out:
        assert torch.equal(o["w"], torch.full((2, 3), 3.0))
        assert torch.equal(o["b"], torch.full((3,), 6.0))
        assert torch.equal(o["a"], torch.full((1,), 15.0))
    (name, op), = pipes[0].comm.started
    assert name.startswith("hvdc.b0.0.allreduce.")
    assert torch.equal(op.tensor, torch.tensor([5.0, 1.0, 1.0, 1.0, 0, 0, 0, 0, 0, 0]))
    assert all(p.comm.names == [name] for p in pipes)


def test_ranks_that_disagree_on_a_bucket_time_out_instead_of_mixing_tensors() -> None:
    pipes = make_pipelines(Compression.none, 2, DENSE_1D, timeout=0.5)
    plans = [["x", "y"], ["y", "x"]]  # same total size: only the names tell them apart

    def work(rank: int) -> None:
        pipes[rank].plan(plans[rank], [3, 3])
        with pytest.raises(TimeoutError, match=r"hvdc\.b0\.0\.allreduce\."):
            pipes[rank].reduce({"x": torch.ones(3), "y": torch.zeros(3)})
        assert not pipes[rank].pending

    on_threads(2, work)


class _RankDependentSplits(Scheme):
    """Breaks AllToAll's contract: rank r sends 1 + r elements to rank 0."""

    name = "rank-splits"

    def exchange(self, x: torch.Tensor, state: Any, ctx: ExchangeContext) -> Exchange:
        splits = tuple(1 + (ctx.rank if dest == 0 else 0) for dest in range(ctx.size))
        received = yield AllToAll("scatter", torch.zeros(sum(splits), dtype=torch.uint8),
                                  splits)
        return Outcome(x + sum(t.numel() for t in received), None, sum(splits))

    def payload_bytes(self, shape: torch.Size) -> int:
        return 2


def test_alltoall_splits_that_differ_between_senders_raise_when_fused() -> None:
    # Alone, each tensor's all-to-all goes as it is and any splits work.
    alone = make_pipelines(_RankDependentSplits(), 2, bucket_bytes=1)
    out = on_threads(2, lambda r: alone[r].reduce({"u": torch.zeros(2), "v": torch.zeros(2)}))
    assert torch.equal(out[0]["u"], torch.full((2,), 3.0))  # 1 from rank 0, 2 from rank 1
    fused = make_pipelines(_RankDependentSplits(), 2)

    def step(rank: int) -> str | None:
        try:
            fused[rank].reduce({"u": torch.zeros(2), "v": torch.zeros(2)})
        except RuntimeError as exc:
            return str(exc)
        return None

    messages = on_threads(2, step)
    # Rank 0 expects 1 + 1 elements from rank 1, which sends 2 + 2.
    assert messages[0] is not None and messages[1] is None
    assert "bucket 0 phase 0" in messages[0] and "['u', 'v']" in messages[0]
    assert "rank 0 received from rank 1 4 elements" in messages[0]
    assert not any(fused[0].state_dict()["steps"].values()) and not fused[0].pending


class _FailsOnRequest(Scheme):
    """Plain all-reduce over two rounds; raises in round ``fail_at`` for tensor "bad"."""

    name = "fails"
    error_feedback = True

    def __init__(self) -> None:
        self.fail_at: int | None = None

    def exchange(self, x: torch.Tensor, state: Any, ctx: ExchangeContext) -> Exchange:
        for round in range(2):
            if ctx.name == "bad" and self.fail_at == round:
                raise ValueError("codec failure")
            total = yield AllReduce(f"r{round}", x)
        return Outcome(total, x * 0.5, x.numel() * 4, {"seen": total.clone()})

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * shape.numel()


@pytest.mark.parametrize("fail_at", [0, 1])
def test_an_exchange_that_raises_fails_the_whole_step_and_changes_no_state(
        fail_at: int) -> None:
    scheme = _FailsOnRequest()
    pipe = make_pipelines(scheme, 1)[0]
    pipe.plan(["good", "bad", "other"], [4, 4, 4])
    tensors = {"good": torch.ones(4), "bad": torch.ones(4), "other": torch.ones(4)}
    pipe.reduce(tensors)
    before = pipe.state_dict()
    scheme.fail_at = fail_at
    if fail_at == 0:  # in submit: the error propagates there, and wait() fails the step
        pipe.submit("good", tensors["good"])
        with pytest.raises(ValueError, match="codec failure"):
            pipe.submit("bad", tensors["bad"])
        pipe.submit("other", tensors["other"])
        with pytest.raises(RuntimeError, match="failed while its tensors were submitted"):
            pipe.wait()
    else:
        with pytest.raises(ValueError, match="codec failure"):
            pipe.reduce(tensors)
    after = pipe.state_dict()
    assert after["steps"] == before["steps"] == {"good": 1, "bad": 1, "other": 1}
    assert all(torch.equal(after["residuals"][k], v) for k, v in before["residuals"].items())
    assert all(torch.equal(after["scheme_state"][k]["seen"], v["seen"])
               for k, v in before["scheme_state"].items())
    assert not pipe.pending
    scheme.fail_at = None
    pipe.reduce(tensors)  # the next step runs, and its statistics are its own
    assert pipe.state_dict()["steps"] == {"good": 2, "bad": 2, "other": 2}
    assert pipe.last_step.collectives == 2
    assert dict(pipe.last_step.collective_bytes) == {"r0": 48, "r1": 48}


# The step's hot path: no full-size temporaries ----------------------------------------------
def test_finite_check_passes_a_finite_aggregate_whose_sum_overflows() -> None:
    """The check sums each aggregate; a sum beyond float32's range is looked at element by
    element, so only a real NaN or infinity fails the step."""
    pipes = make_pipelines(Compression.none, 2)
    big = [{"w": torch.full((4,), 1e38)} for _ in range(2)]  # aggregate 2e38 each, sum inf
    out = on_threads(2, lambda r: pipes[r].reduce(big[r])["w"])
    assert torch.equal(out[0], torch.full((4,), 2e38))
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = [{"w": torch.ones(4)}, {"w": torch.tensor([1.0, bad, 1.0, 1.0])}]

        def step(rank: int, grads: list = grads) -> None:
            with pytest.raises(NonFiniteGradientError):
                pipes[rank].reduce(grads[rank])

        on_threads(2, step)


@pytest.mark.parametrize("spec", ["none", "powersgd:rank=2,start_iter=0", "onebit:bucket_size=16"])
def test_wait_into_writes_the_same_aggregates_into_the_given_tensors(spec: str) -> None:
    grads = _grads(2, steps=2)
    ref, _, _ = _run(spec, 2, None, "plan", grads)
    pipes = make_pipelines(Compression.parse(spec), 2, DENSE_1D, average=True)

    def work(rank: int) -> list[dict[str, torch.Tensor]]:
        pipes[rank].plan(list(MODEL), [torch.Size(s).numel() for s in MODEL.values()])
        out = []
        for tensors in grads[rank]:
            into = {n: torch.full(t.shape, float("nan")) for n, t in tensors.items()}
            into["fc2.weight"] = torch.zeros(MODEL["fc2.weight"], dtype=torch.bfloat16)
            for name, tensor in tensors.items():
                pipes[rank].submit(name, tensor)
            got = pipes[rank].wait(into)
            assert all(got[n] is into[n] for n in tensors)
            out.append(got)
        return out

    out = on_threads(2, work)
    for rank in range(2):
        for step in range(2):
            for name in MODEL:
                want = ref[rank][step][name] / 2  # _run sums; this pipeline averages
                got = out[rank][step][name]
                if got.dtype == torch.bfloat16:
                    assert torch.equal(got, want.to(torch.bfloat16))
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_error_feedback_alternates_two_buffers_and_a_failed_step_keeps_the_residual() -> None:
    pipes = make_pipelines(Compression.onebit(bucket_size=16), 2)
    gen = torch.Generator().manual_seed(3)
    pointers = []
    for _ in range(5):
        grads = [{"w": torch.randn(8, 8, generator=gen)} for _ in range(2)]
        on_threads(2, lambda r, grads=grads: pipes[r].reduce(grads[r]))
        pointers.append(pipes[0].feedback.get("w").data_ptr())
    assert len(set(pointers[1:])) == 2  # after the first step: two buffers, in turn
    kept = pipes[0].feedback.get("w").clone()
    grads = [{"w": torch.randn(8, 8)}, {"w": torch.full((8, 8), float("nan"))}]

    def fail(rank: int) -> None:
        with pytest.raises(NonFiniteGradientError):
            pipes[rank].reduce(grads[rank])

    on_threads(2, fail)
    assert torch.equal(pipes[0].feedback.get("w"), kept)


def test_scheme_state_and_results_never_alias_the_reused_fusion_buffers() -> None:
    """PowerSGD's Q is the fused Q all-reduce's result; a later step reuses that buffer, so
    the committed Q (and the aggregates handed out) must be tensors of their own."""
    spec = "powersgd:rank=2,start_iter=0"
    pipes = make_pipelines(Compression.parse(spec), 2, DENSE_1D)
    grads = _grads(2, steps=2)
    first = on_threads(2, lambda r: pipes[r].reduce(grads[r][0]))
    q = {n: pipes[0].scheme_state(n)["q"].clone() for n in ("fc2.weight", "fc1.weight")}
    kept = {n: t.clone() for n, t in first[0].items()}
    bad = [dict(g) for g in grads[1]]
    bad[1]["fc2.weight"] = torch.full(MODEL["fc2.weight"], float("nan"))

    def fail(rank: int) -> None:
        with pytest.raises(NonFiniteGradientError):
            pipes[rank].reduce(bad[rank])

    on_threads(2, fail)  # the fused buffers now hold this failed step's values
    for name, want in q.items():
        assert torch.equal(pipes[0].scheme_state(name)["q"], want)
    on_threads(2, lambda r: pipes[r].reduce(grads[r][1]))
    assert all(torch.equal(first[0][n], kept[n]) for n in kept)


def test_low_rank_factors_write_subtract_and_sum_like_their_product() -> None:
    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(6, 2, generator=gen), torch.randn(20, 2, generator=gen)
    value = LowRank(left, right, torch.Size((6, 4, 5)))
    dense = (left @ right.t()).view(6, 4, 5)
    torch.testing.assert_close(value.materialize(), dense)  # the bits: test_lowrank_kernel
    torch.testing.assert_close(value.total(), dense.sum())
    out = torch.full((6, 4, 5), float("nan"))
    torch.testing.assert_close(value.write(out, 0.5), 0.5 * dense)  # beta=0 ignores NaN
    half = torch.zeros(6, 4, 5, dtype=torch.float16)
    torch.testing.assert_close(value.write(half, 0.5), (0.5 * dense).half())
    x = torch.randn(6, 4, 5, generator=gen)
    torch.testing.assert_close(value.subtract_from(x.clone()), x - dense)
    left[0, 0] = float("nan")
    assert not value.total().isfinite()


@pytest.mark.parametrize("bad_name", ["fc2.bias", "fc2.weight"])
def test_finite_check_by_shared_buffers_names_exactly_the_bad_tensors(bad_name: str) -> None:
    """The finite check takes the norms of the buffers the aggregates are views of (the
    fused round's result, PowerSGD's flat sums and QR blocks): a NaN in one batched tensor
    fails the step naming that tensor only, and a finite tensor whose buffer's norm
    overflows float32 (another member's huge values) is still passed."""
    spec = "powersgd:rank=2,start_iter=0"
    pipes = make_pipelines(Compression.parse(spec), 2, DENSE_1D)
    grads = _grads(2, steps=2)
    on_threads(2, lambda r: pipes[r].reduce(grads[r][0]))
    bad = [dict(g) for g in grads[1]]
    bad[1][bad_name] = torch.full(MODEL[bad_name], float("nan"))

    def fail(rank: int) -> list[str]:
        with pytest.raises(NonFiniteGradientError) as info:
            pipes[rank].reduce(bad[rank])
        return info.value.names  # type: ignore[no-any-return]

    assert on_threads(2, fail) == [[bad_name], [bad_name]]
    huge = [dict(g) for g in grads[1]]
    for g in huge:  # each sum 2e38 is finite; the bias buffer's norm is not
        g["fc3.bias"] = torch.full(MODEL["fc3.bias"], 1e38)
    out = on_threads(2, lambda r: pipes[r].reduce(huge[r]))
    assert torch.equal(out[0]["fc3.bias"], torch.full(MODEL["fc3.bias"], 2e38))
    assert all(torch.isfinite(t).all() for t in out[0].values())
