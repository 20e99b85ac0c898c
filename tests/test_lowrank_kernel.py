"""The kernels of hvd_compress/native/lowrank.cpp, PowerSGD's CPU arithmetic: the commit
(``LowRank.write`` and ``LowRank.subtract_from``) and the two products of its rounds
(``lowrank_right``: ``M Q``; ``lowrank_left``: ``B^T M``) give, bit for bit, the sums in the
order the file states, whatever the rank, the shape, the factors' strides and the thread
count; and they agree with torch's products (the path without the kernels) within float32
rounding."""

from __future__ import annotations

import pytest
import torch

from hvd_compress.native.loader import disabled, library
from hvd_compress.native.tensors import lowrank_apply, lowrank_left, lowrank_right
from hvd_compress.schemes.base import LowRank

pytestmark = pytest.mark.skipif(library() is None, reason="native kernels not built")


def stated(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """The kernel's sum in float32, one torch operation at a time (each rounded, no fused
    multiply-add): ``((L0 R0 + L1 R1) + L2 R2) + ...``."""
    acc = left[:, :1] * right[:, 0]
    for k in range(1, left.shape[1]):
        acc = acc + left[:, k:k + 1] * right[:, k]
    return acc


def factors(n: int, m: int, r: int, seed: int, transposed_left: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    left = (torch.randn(r, n, generator=gen).t() if transposed_left
            else torch.randn(n, r, generator=gen))
    right = torch.randn(r, m, generator=gen).t()  # as PowerSGD keeps Q
    return left, right


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("n,m", [(1, 1), (7, 3), (64, 1000), (300, 513)])
@pytest.mark.parametrize("transposed_left", [False, True])
def test_write_and_subtract_are_the_stated_arithmetic(r: int, n: int, m: int,
                                                      transposed_left: bool) -> None:
    left, right = factors(n, m, r, r * 1000 + n + m, transposed_left)
    value = LowRank(left, right, torch.Size([n, m]))
    acc = stated(left, right)

    out = torch.full((n, m), float("nan"))  # what it held is ignored
    value.write(out, 0.25)
    assert torch.equal(out, 0.25 * acc)

    x = torch.randn(n, m, generator=torch.Generator().manual_seed(5))
    expected = x - acc
    value.subtract_from(x)
    assert torch.equal(x, expected)
    assert torch.equal(value.materialize(), acc)


def test_a_tensor_of_another_shape_is_written_through_its_matrix_view() -> None:
    """A 4-D gradient (a CNN's weight, viewed as n x m by PowerSGD)."""
    left, right = factors(16, 8 * 3 * 3, 4, 1, False)
    value = LowRank(left, right, torch.Size([16, 8, 3, 3]))
    out = torch.empty(16, 8, 3, 3)
    value.write(out, 2.0)
    assert torch.equal(out, (2.0 * stated(left, right)).view(16, 8, 3, 3))


def test_threads_give_the_same_bits() -> None:
    left, right = factors(1024, 700, 4, 2, True)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty(1024, 700)
            assert lowrank_apply(out, left, right, 0.5, False)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_without_the_kernels_addmm_agrees_within_rounding() -> None:
    left, right = factors(200, 300, 4, 3, False)
    value = LowRank(left, right, torch.Size([200, 300]))
    native = value.write(torch.empty(200, 300), 0.5)
    with disabled():
        assert not lowrank_apply(torch.empty(200, 300), left, right, 0.5, False)
        fallback = value.write(torch.empty(200, 300), 0.5)
    exact = 0.5 * (left.double() @ right.double().t())
    terms = 0.5 * (left.abs().double() @ right.abs().double().t())  # r float32 roundings
    for got in (native, fallback):
        assert ((got.double() - exact).abs() <= 4 * 2**-23 * terms).all()


def test_other_dtypes_and_strided_outputs_take_torch() -> None:
    left, right = factors(20, 30, 2, 4, False)
    assert not lowrank_apply(torch.empty(20, 30, dtype=torch.float64), left.double(),
                             right.double(), 1.0, False)
    assert not lowrank_apply(torch.empty(30, 20).t(), left, right, 1.0, False)
    value = LowRank(left, right, torch.Size([20, 30]))
    strided = torch.empty(30, 20).t()
    value.write(strided, 1.0)  # through materialize: the kernel into a fresh tensor
    assert torch.equal(strided, stated(left, right))


def stated_right(matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``M Q`` summed as ``hvdc_lowrank_right`` states: 16 lanes over the whole groups of
    16 entries (lane l the entries j % 16 == l, in order), the lanes added in order, then
    the rest in order."""
    n, m = matrix.shape
    whole = m // 16 * 16
    out = torch.empty(n, right.shape[1])
    for k in range(right.shape[1]):
        products = matrix * right[:, k]
        if whole:
            groups = products[:, :whole].reshape(n, whole // 16, 16)
            acc = groups[:, 0]
            for g in range(1, whole // 16):
                acc = acc + groups[:, g]
            total = acc[:, 0]
            for lane in range(1, 16):
                total = total + acc[:, lane]
            rest = range(whole, m)
        else:
            total, rest = products[:, 0], range(1, m)
        for j in rest:
            total = total + products[:, j]
        out[:, k] = total
    return out


def stated_left(basis: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``B^T M`` summed over the rows in order, as ``hvdc_lowrank_left`` states."""
    out = basis[0][:, None] * matrix[0]
    for i in range(1, matrix.shape[0]):
        out = out + basis[i][:, None] * matrix[i]
    return out


@pytest.mark.parametrize("r", [1, 2, 3, 4, 8, 9])
@pytest.mark.parametrize("n,m", [(1, 1), (5, 15), (33, 16), (70, 100), (40, 1031)])
def test_the_round_products_are_the_stated_sums(r: int, n: int, m: int) -> None:
    gen = torch.Generator().manual_seed(r * 7 + n + m)
    matrix = torch.randn(n, m, generator=gen)
    basis = torch.randn(r, n, generator=gen).t()  # strided, as a factor cut from a buffer
    right = torch.randn(r, m, generator=gen).t()  # PowerSGD's kept Q
    out = torch.empty(r, n)
    assert lowrank_right(out.t(), matrix, right)  # the r x n layout of the P round
    assert torch.equal(out.t(), stated_right(matrix, right))
    rows = torch.empty(n, r)
    assert lowrank_right(rows, matrix, right)
    assert torch.equal(rows, out.t())
    left = torch.empty(r, m)
    assert lowrank_left(left, basis, matrix)
    assert torch.equal(left, stated_left(basis, matrix))


def test_the_round_products_give_the_same_bits_on_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(9)
    matrix, basis = torch.randn(700, 1100, generator=gen), torch.randn(700, 4, generator=gen)
    right = torch.randn(1100, 4, generator=gen)
    seen = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            p, q = torch.empty(700, 4), torch.empty(4, 1100)
            assert lowrank_right(p, matrix, right) and lowrank_left(q, basis, matrix)
            seen.append((p, q))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, seen[0][0]) and torch.equal(b, seen[0][1]) for a, b in seen)
    terms = (matrix.abs().double() @ right.abs().double())
    assert ((seen[0][0].double() - matrix.double() @ right.double()).abs()
            <= 1100 * 2**-23 * terms).all()
