"""Each bucket settled as its last round ends (:meth:`~hvd_compress.pipeline.Pipeline._settle`):
its finite check, its residual updates (computed, installed only when the step commits) and
the write of its aggregates, while later buckets' rounds are still in flight. The same
aggregates, residuals, scheme state and reports, bit for bit, as settling the whole step
at once (``settle_early = False``); a non-finite aggregate in any bucket still changes
nothing on any rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Pipeline, Policy
from hvd_compress.feedback import Commit, ErrorFeedback
from tests.threaded import make_pipelines, on_threads

# Backward order; matrices compressed, 1-D biases dense (the policy). Buckets of
# BUCKET_BYTES give five buckets, ending at different phases for PowerSGD (the bias-only
# buckets have one round, the others two).
MODEL = {"fc3.bias": (7,), "fc3.weight": (7, 40), "fc2.weight": (40, 24), "fc2.bias": (40,),
         "fc1.weight": (24, 3, 4, 4), "fc1.bias": (24,)}
BUCKET_BYTES = 1200
POLICY = Policy(min_numel=1)
SPECS = ["onebit:bucket_size=16", "powersgd:rank=2,start_iter=1", "topk:ratio=0.1", "none",
         "bf16", "qsgd:bucket_size=16,error_feedback=True", "dgc:ratio=0.1"]


def _grads(size: int, steps: int, seed: int = 11) -> list[list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[{n: torch.randn(s, generator=gen) for n, s in MODEL.items()}
             for _ in range(size)] for _ in range(steps)]


def _pipelines(spec: str, size: int, settle: bool) -> list[Pipeline]:
    pipes = make_pipelines(Compression.parse(spec), size, POLICY, average=True,
                           bucket_bytes=BUCKET_BYTES)
    for pipe in pipes:
        pipe.settle_early = settle
        pipe.report_every = 2  # the schemes without error feedback report every other step
        pipe.plan(list(MODEL), [torch.Size(s).numel() for s in MODEL.values()])
    return pipes


def _step(pipe: Pipeline, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One step writing into tensors of its own (NaN before; one of them bfloat16)."""
    into = {n: torch.full(g.shape, float("nan")) for n, g in grads.items()}
    into["fc2.weight"] = torch.zeros(MODEL["fc2.weight"], dtype=torch.bfloat16)
    for name, grad in grads.items():
        pipe.submit(name, grad.clone())  # the pipeline may sum a dense gradient in place
    out = pipe.wait(into)
    assert all(out[n] is into[n] for n in grads)
    return out


def _run(pipes: list[Pipeline], steps: list[list[dict[str, torch.Tensor]]]
         ) -> list[list[dict[str, torch.Tensor]]]:
    """Every step's aggregates, per step and rank."""
    return [on_threads(len(pipes), lambda r, g=g: _step(pipes[r], g[r])) for g in steps]


def _assert_same_state(got: Pipeline, want: Pipeline) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a["steps"] == b["steps"]
    assert a["residuals"].keys() == b["residuals"].keys()
    for name, residual in b["residuals"].items():
        assert torch.equal(a["residuals"][name], residual), name
    assert a["scheme_state"].keys() == b["scheme_state"].keys()
    for name, state in b["scheme_state"].items():
        assert state.keys() == a["scheme_state"][name].keys()
        for key, value in state.items():
            assert torch.equal(a["scheme_state"][name][key], value), (name, key)
    assert got.feedback.report() == want.feedback.report()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_settled_buckets_equal_the_step_settled_at_once_bit_for_bit(spec: str,
                                                                    size: int) -> None:
    steps = _grads(size, 4)
    early, late = _pipelines(spec, size, True), _pipelines(spec, size, False)
    assert len(early[0].buckets) == 5
    got, want = _run(early, steps), _run(late, steps)
    for step in range(len(steps)):
        for rank in range(size):
            for name in MODEL:
                assert torch.equal(got[step][rank][name], want[step][rank][name]), \
                    (step, rank, name)
                assert torch.equal(got[step][rank][name], got[step][0][name])
    for a, b in zip(early, late, strict=True):
        _assert_same_state(a, b)
        assert a.total.payload_bytes == b.total.payload_bytes
        assert dict(a.total.collective_bytes) == dict(b.total.collective_bytes)
        assert a.total.compressed_tensors == b.total.compressed_tensors


class _Watch:
    """Wraps a communicator's ``wait``: before each, records whether the first bucket's
    tensors already hold finite values in ``into`` (they are NaN until written)."""

    def __init__(self, pipe: Pipeline, names: list[str]) -> None:
        self.inner, self.names = pipe.comm, names
        self.rank, self.size = pipe.comm.rank, pipe.comm.size
        self.into: dict[str, torch.Tensor] = {}
        self.written: list[bool] = []
        pipe.comm = self  # type: ignore[assignment]

    def start(self, name: str, op: Any) -> Any:
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> Any:
        self.written.append(all(bool(self.into[n].isfinite().all()) for n in self.names))
        return self.inner.wait(handle)


@pytest.mark.parametrize("settle", [True, False])
def test_the_first_bucket_is_written_before_the_last_round_is_waited_on(settle: bool) -> None:
    """1-bit: the first bucket's aggregates are in the gradients before the pipeline waits
    on the last bucket's gather (with ``settle_early``), not before its own gather ends."""
    pipes = _pipelines("onebit:bucket_size=16", 2, settle)
    first = pipes[0].buckets[0]
    watches = [_Watch(p, first) for p in pipes]
    grads = _grads(2, 1)[0]

    def step(rank: int) -> None:
        into = {n: torch.full(g.shape, float("nan")) for n, g in grads[rank].items()}
        watches[rank].into = into
        for name, grad in grads[rank].items():
            pipes[rank].submit(name, grad)
        pipes[rank].wait(into)

    on_threads(2, step)
    for watch in watches:
        assert not watch.written[0]  # nothing before the first round's end
        assert watch.written[-1] == settle


@pytest.mark.parametrize("spec", SPECS)
def test_a_non_finite_aggregate_in_the_last_bucket_changes_nothing_on_any_rank(
        spec: str) -> None:
    """The earlier buckets' residual updates were computed, but none is kept: residuals,
    scheme state, counters and reports stay as before on every rank; the next good step
    equals that of pipelines that never saw the failed one, bit for bit."""
    size = 3
    steps = _grads(size, 3)
    pipes, clean = _pipelines(spec, size, True), _pipelines(spec, size, True)
    _run(pipes, steps[:1])
    _run(clean, steps[:1])
    last = pipes[0].buckets[-1]
    first = pipes[0].buckets[0]
    bad = [dict(g) for g in steps[1]]
    bad[2][last[0]] = bad[2][last[0]].clone()
    bad[2][last[0]].view(-1)[3] = float("nan")

    def fail(rank: int) -> NonFiniteGradientError:
        with pytest.raises(NonFiniteGradientError) as info:
            _step(pipes[rank], bad[rank])
        return info.value

    errors = on_threads(size, fail)
    assert [e.names for e in errors] == [[last[0]]] * size
    assert [e.local for e in errors] == [[], [], [last[0]]]
    for a, b in zip(pipes, clean, strict=True):
        _assert_same_state(a, b)
    got, want = _run(pipes, steps[2:]), _run(clean, steps[2:])
    for rank in range(size):
        for name in MODEL:
            assert torch.equal(got[0][rank][name], want[0][rank][name]), (rank, name)
    for a, b in zip(pipes, clean, strict=True):
        _assert_same_state(a, b)
    # Bad tensors in the first and the last bucket: both named on every rank, each by
    # the rank whose input held it.
    bad = [dict(g) for g in steps[1]]
    bad[0][first[-1]] = torch.full(MODEL[first[-1]], float("inf"))
    bad[1][last[0]] = torch.full(MODEL[last[0]], float("nan"))
    errors = on_threads(size, fail)
    order = [n for n in MODEL if n in (first[-1], last[0])]
    assert [sorted(e.names) for e in errors] == [sorted(order)] * size
    assert [e.local for e in errors] == [[first[-1]], [last[0]], []]


@pytest.mark.parametrize("spec", ["onebit:bucket_size=16", "powersgd:rank=2,start_iter=1",
                                  "topk:ratio=0.1"])
def test_state_saved_after_settled_steps_resumes_exactly(spec: str) -> None:
    steps = _grads(2, 5, seed=4)
    first = _pipelines(spec, 2, True)
    _run(first, steps[:3])
    second = _pipelines(spec, 2, True)
    for a, b in zip(second, first, strict=True):
        a.load_state_dict(b.state_dict())
    reference = _pipelines(spec, 2, False)
    want = _run(reference, steps)[3:]
    got, resumed = _run(first, steps[3:]), _run(second, steps[3:])
    for step in range(2):
        for rank in range(2):
            for name in MODEL:
                assert torch.equal(got[step][rank][name], want[step][rank][name])
                assert torch.equal(resumed[step][rank][name], want[step][rank][name])
    for a, b, c in zip(first, second, reference, strict=True):
        assert a.state_dict()["steps"] == b.state_dict()["steps"] == c.state_dict()["steps"]
        for name, residual in c.state_dict()["residuals"].items():
            assert torch.equal(a.feedback.get(name), residual)
            assert torch.equal(b.feedback.get(name), residual)


@pytest.mark.parametrize("beta", [0.0, 0.8])
def test_prepare_changes_nothing_until_install(beta: float) -> None:
    """:meth:`ErrorFeedback.prepare` computes the residuals (the old ones only read);
    :meth:`~ErrorFeedback.install` keeps them: together the same residuals and report as
    :meth:`~ErrorFeedback.commit_sent` one by one, with LoCo too."""
    gen = torch.Generator().manual_seed(2)
    split, whole = ErrorFeedback(beta=beta), ErrorFeedback(beta=beta)
    for step in range(3):
        commits = []
        for name in ("a", "b"):
            g = torch.randn(5, 4, generator=gen)
            x, y = split.compensate(name, g), whole.compensate(name, g)
            sent = x.round()
            commits.append(Commit(name, x, sent, "test", step != 1))
            whole.commit_sent(name, y, sent.clone(), "test", step != 1)
        kept = {n: None if split.get(n) is None else split.get(n).clone() for n in ("a", "b")}
        report = split.report()
        candidates = split.prepare(commits)
        assert split.report() == report
        for name, residual in kept.items():
            now = split.get(name)
            assert (now is None and residual is None) or torch.equal(now, residual)
        split.install(candidates)
        assert split.report() == whole.report()
        for name in ("a", "b"):
            assert torch.equal(split.get(name), whole.get(name))
