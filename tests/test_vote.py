"""signSGD with majority vote: the exact vote through the compressed all-reduce, 1 bit per
element on the wire, non-finite inputs reported, Signum's state, training on digits."""

from __future__ import annotations

import copy

import pytest
import torch

from hvd_compress import Compression, NonFiniteGradientError, Policy
from tests import convergence_harness as harness
from tests.harness import run_ranks
from tests.threaded import make_pipelines, on_threads

ALL = Policy(min_numel=1, compress_1d=True)


def vote(xs: list[torch.Tensor]) -> torch.Tensor:
    """sign(sum_i sign(x_i)) with sign(0) = +1 for inputs and ties."""
    count = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
    return torch.where(count >= 0, 1.0, -1.0)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 7, 8, 100, 1001])
def test_aggregate_is_the_exact_majority_vote(size: int, numel: int) -> None:
    gen = torch.Generator().manual_seed(size * 1000 + numel)
    xs = [torch.randn(numel, generator=gen) for _ in range(size)]
    xs[0][: numel // 3] = 0.0
    pipes = make_pipelines(Compression.vote(), size, policy=ALL, average=False)
    out = on_threads(size, lambda r: pipes[r].reduce({"w": xs[r]})["w"])
    expected = vote(xs) * size  # a sum over ranks: the average is the vote
    for o in out:
        assert torch.equal(o, expected)
    if size % 2 == 0:  # ties happen and go to +1
        signs = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
        assert torch.equal(expected[signs == 0], torch.full_like(expected[signs == 0], size))
    # Averaged, the optimizer gets the vote itself.
    pipes = make_pipelines(Compression.vote(), size, policy=ALL, average=True)
    out = on_threads(size, lambda r: pipes[r].reduce({"w": xs[r]})["w"])
    assert torch.equal(out[0], vote(xs))


def test_one_bit_per_element_on_the_wire() -> None:
    numel, size = 80_000, 2
    scheme = Compression.vote()
    assert scheme.payload_bytes(torch.Size([numel])) == numel // 8 + 1
    pipes = make_pipelines(scheme, size, policy=ALL)
    xs = [torch.randn(numel) for _ in range(size)]
    on_threads(size, lambda r: pipes[r].reduce({"w": xs[r]}))
    sent = pipes[0].last_step.collective_bytes
    # Each chunk: numel / 2 / 8 bytes of bits + 1 flag byte. This rank hands both chunks
    # to the all-to-all and its own voted chunk to the all-gather.
    assert sent["scatter"] == 2 * (numel // 16 + 1)
    assert sent["gather"] == numel // 16 + 1
    assert pipes[0].last_step.ratio > 31.9


def test_a_non_finite_input_is_reported_on_every_rank() -> None:
    pipes = make_pipelines(Compression.vote(momentum=0.9), 2, policy=ALL)
    good = {"w": torch.ones(50)}
    on_threads(2, lambda r: pipes[r].reduce(good))
    before = [p.scheme_state("w") for p in pipes]
    bad = [torch.ones(50), torch.ones(50)]
    bad[1][37] = float("nan")

    def step(rank: int) -> str:
        with pytest.raises(NonFiniteGradientError) as err:
            pipes[rank].reduce({"w": bad[rank]})
        return str(err.value)

    messages = on_threads(2, step)
    assert all("'w'" in m for m in messages)
    for p, state in zip(pipes, before):  # Signum's momentum kept as it was
        assert torch.equal(p.scheme_state("w")["momentum"], state["momentum"])


def test_signum_votes_with_momentum_and_resumes_exactly() -> None:
    beta, size = 0.9, 2
    scheme = Compression.vote(momentum=beta)
    gens = [torch.Generator().manual_seed(r) for r in range(size)]
    grads = [[torch.randn(40, generator=g) for _ in range(4)] for g in gens]
    pipes = make_pipelines(scheme, size, policy=ALL, average=True)
    m = [torch.zeros(40) for _ in range(size)]
    for step in range(3):
        out = on_threads(size, lambda r, s=step: pipes[r].reduce({"w": grads[r][s]})["w"])
        m = [beta * m[r] + (1 - beta) * grads[r][step] for r in range(size)]
        assert torch.equal(out[0], vote(m))
    saved = [copy.deepcopy(p.state_dict()) for p in pipes]
    resumed = make_pipelines(scheme, size, policy=ALL, average=True)
    for p, state in zip(resumed, saved):
        p.load_state_dict(state)
    a = on_threads(size, lambda r: pipes[r].reduce({"w": grads[r][3]})["w"])
    b = on_threads(size, lambda r: resumed[r].reduce({"w": grads[r][3]})["w"])
    assert torch.equal(a[0], b[0])


def test_signum_refuses_an_optimizer_with_momentum() -> None:
    params = list(harness.make_model().parameters())
    Compression.vote().check_optimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9))
    with pytest.raises(ValueError, match="construct it with momentum=0"):
        Compression.vote(momentum=0.9).check_optimizer(
            torch.optim.SGD(params, lr=0.01, momentum=0.9))


def test_vote_trains_digits() -> None:
    """signSGD and Signum on 2 ranks, every tensor voted, SGD at sign-method step sizes."""
    torch.set_num_threads(1)
    reference = harness.train(Compression.none, harness.sgd(0.1, 0.9), steps=400)[0]
    for scheme, lr in ((Compression.vote(), 0.002), (Compression.vote(momentum=0.9), 0.002)):
        runs = harness.train(scheme, harness.sgd(lr, 0.0), steps=400, policy=ALL)
        assert torch.equal(runs[0].params, runs[1].params)
        assert runs[0].accuracy > reference.accuracy - 3, (scheme, runs[0].accuracy,
                                                           reference.accuracy)


@pytest.mark.multiprocess
def test_vote_is_exact_on_two_horovod_ranks() -> None:
    numels = [1, 100, 4097]
    ranks = run_ranks("tests.workers.vote:votes", np=2, launcher="gloo", numels=numels)
    for name in ranks[0]["x"]:
        expected = vote([r["x"][name] for r in ranks]) * 2
        for r in ranks:
            assert torch.equal(r["aggregate"][name], expected), name
    # 1 bit per element plus a flag byte per chunk, both ways, summed over the tensors.
    chunks = sum(2 for n in numels if n > 8) + sum(1 for n in numels if n <= 8)
    expected_bytes = sum((n + 7) // 8 for n in numels)
    assert ranks[0]["bytes"]["scatter"] >= expected_bytes
    assert ranks[0]["bytes"]["scatter"] <= expected_bytes + chunks + len(numels)
