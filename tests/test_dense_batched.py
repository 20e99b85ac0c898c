"""The small dense tensors' batched path (:meth:`~hvd_compress.schemes.dense.NoCompression.
exchange_many`) and the step-wide commit (:meth:`~hvd_compress.feedback.ErrorFeedback.
commit_many`, the pipeline's one-call finite check and writes): the same aggregates,
residuals and reports, bit for bit, as one exchange and one commit per tensor."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Policy
from hvd_compress.feedback import Commit, ErrorFeedback
from hvd_compress.schemes.dense import BATCH_UP_TO, NoCompression
from tests.threaded import make_pipelines, on_threads

# Biases and norms (dense under the policy), matrices PowerSGD compresses, one dense
# matrix too small to compress, and one dense tensor above BATCH_UP_TO (its own request).
SHAPES = {"w1": (32, 24), "b1": (32,), "ln": (24,), "w2": (24, 16), "b2": (24,),
          "tiny": (3, 3), "big": (BATCH_UP_TO + 5,)}
POLICY = Policy(min_numel=16)


def _run(spec: str, batch: bool, size: int, steps: int, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[list[dict[str, torch.Tensor]]], list]:
    """Every rank's aggregates (written into tensors of their own) for ``steps`` steps."""
    monkeypatch.setattr(NoCompression, "batch_tensors", batch)
    scheme = Compression.parse(spec)
    pipes = make_pipelines(scheme, size, POLICY, average=True)
    gen = torch.Generator().manual_seed(size)
    outs = []
    for _ in range(steps):
        grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
                 for _ in range(size)]

        def work(rank: int, grads: list = grads) -> dict[str, torch.Tensor]:
            into = {n: torch.full(g.shape, float("nan")) for n, g in grads[rank].items()}
            for name, grad in grads[rank].items():
                pipes[rank].submit(name, grad)
            results = pipes[rank].wait(into)
            assert all(results[n] is into[n] for n in into)
            return into

        outs.append(on_threads(size, work))
    return outs, pipes


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("spec", ["none", "powersgd:rank=2,start_iter=1"])
def test_batched_dense_equals_per_tensor_bit_for_bit(spec: str, size: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Averaged aggregates (a scale of 1/3 on three ranks), residuals and the error
    feedback report equal those of one request per dense tensor; replicas agree."""
    batched, pipes_b = _run(spec, True, size, 3, monkeypatch)
    single, pipes_s = _run(spec, False, size, 3, monkeypatch)
    for step, (outs_b, outs_s) in enumerate(zip(batched, single, strict=True)):
        for r in range(size):
            for name in SHAPES:
                assert torch.equal(outs_b[r][name], outs_s[r][name]), (step, r, name)
                assert torch.equal(outs_b[r][name], outs_b[0][name]), (step, r, name)
    for pb, ps in zip(pipes_b, pipes_s, strict=True):
        for name in SHAPES:
            eb, es = pb.feedback.get(name), ps.feedback.get(name)
            assert (eb is None) == (es is None) and (eb is None or torch.equal(eb, es)), name
        assert pb.feedback.report() == ps.feedback.report()
        assert pb.last_step.dense_tensors == ps.last_step.dense_tensors
        assert pb.last_step.collective_bytes == ps.last_step.collective_bytes


def test_the_small_dense_tensors_of_a_bucket_travel_in_one_request() -> None:
    pipes = make_pipelines(Compression.none, 2, POLICY, record=True)
    grads = {n: torch.ones(s) for n, s in SHAPES.items() if n != "big"}
    on_threads(2, lambda r: pipes[r].reduce(grads))
    (name, op), = pipes[0].comm.started
    assert name.startswith("hvdc.b0.0.allreduce.")
    assert op.tensor.numel() == sum(g.numel() for g in grads.values())
    assert pipes[0].last_step.dense_tensors == len(grads)


def test_ranks_that_lay_a_batch_out_differently_never_sum_it() -> None:
    """The same names and total size but other sizes per tensor: the batch's name
    differs, so the ranks wait for each other instead of summing misaligned slices."""
    pipes = make_pipelines(Compression.none, 2, POLICY, timeout=0.5)
    sizes = [(3, 3), (2, 4)]

    def work(rank: int) -> None:
        x, y = sizes[rank]
        with pytest.raises(TimeoutError, match=r"hvdc\.b0\.0\.allreduce\."):
            pipes[rank].reduce({"x": torch.ones(x), "y": torch.zeros(y)})

    on_threads(2, work)


def test_a_non_finite_batched_tensor_is_named_and_nothing_is_committed() -> None:
    pipes = make_pipelines(Compression.parse("powersgd:rank=2,start_iter=0"), 1, POLICY)
    grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(3))
             for n, s in SHAPES.items()}
    pipes[0].reduce(grads)
    residual = pipes[0].feedback.get("w1").clone()
    grads["ln"][5] = float("inf")
    with pytest.raises(NonFiniteGradientError) as info:
        pipes[0].reduce(grads)
    assert info.value.names == ["ln"] and info.value.local == ["ln"]
    assert torch.equal(pipes[0].feedback.get("w1"), residual)
    grads["ln"][5] = 0.0
    grads["w2"][0, 0] = float("nan")  # a low-rank aggregate: its factors are NaN
    with pytest.raises(NonFiniteGradientError) as info:
        pipes[0].reduce(grads)
    assert info.value.names == ["w2"]


@pytest.mark.parametrize("measure", [True, False])
def test_commit_many_equals_commit_sent_one_by_one_and_conserves(measure: bool) -> None:
    """Residuals, reports and the error-feedback sum ``sum sent + e_T = sum g``."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"a": (6, 5), "b": (7,), "c": (4, 4)}
    many, one = ErrorFeedback(), ErrorFeedback()
    grads_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    sent_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    for step in range(4):
        commits_many, commits_one = [], []
        for name, shape in shapes.items():
            g = torch.randn(shape, generator=gen)
            grads_sum[name] += g.double()
            xm, xo = many.compensate(name, g), one.compensate(name, g)
            assert torch.equal(xm, xo)
            sent = None if name == "b" and step % 2 else xm.round()  # exact, or rounded
            if sent is not None:
                sent_sum[name] += sent.double()
            else:
                sent_sum[name] += xm.double()
            commits_many.append(Commit(name, xm, sent, "test", measure))
            commits_one.append(Commit(name, xo, None if sent is None else sent.clone(),
                                      "test", measure))
        many.commit_many(commits_many)
        for commit in commits_one:
            one.commit_sent(*commit)
        assert many.report() == one.report()
        for name in shapes:
            rm, ro = many.get(name), one.get(name)
            assert (rm is None) == (ro is None) and (rm is None or torch.equal(rm, ro))
    for name in shapes:
        residual = many.get(name)
        kept = residual.double() if residual is not None else 0.0
        assert torch.allclose(sent_sum[name] + kept, grads_sum[name], atol=1e-5), name
