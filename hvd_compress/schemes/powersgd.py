"""PowerSGD: low-rank gradient compression by one step of subspace iteration."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from hvd_compress.comm.ops import AllReduce
from hvd_compress.native import tensors as native
from hvd_compress.schemes.base import Exchange, ExchangeContext, LowRank, Outcome, Scheme
from hvd_compress.schemes.batched import FactorKey, FlatLayout
from hvd_compress.schemes.warmup import check_start_iter, dense_warmup

Q_STATE = "q"
P_STATE = "p"


class PowerSGD(Scheme):
    """PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", Algorithms 1 and 2).

    A tensor of shape ``(n, ...)`` is viewed as a matrix ``M`` of shape ``(n, m)``. With the
    previous step's ``Q`` (``m x r``; at first, Gaussian and identical on every rank)::

        P  = M Q                      all-reduce P       (round "P", n*r floats)
        P^ = orthonormal basis of P   (reduced QR, the same on every rank)
        Q  = M^T P^                   all-reduce Q       (round "Q", m*r floats)
        aggregate = P^ Q^T            (the sum over ranks of P^ P^T M_w)

    ``r = min(rank, n, m)``. Rank ``w``'s own contribution is ``P^ P^T M_w``; error feedback
    keeps ``M_w - P^ P^T M_w`` for the next step, so nothing is lost, only delayed. When
    ``M`` has rank at most ``r`` the aggregate is exact.

    ``alternate=True`` takes one half of that power iteration per step, alternating sides
    (the half-rank reducer its authors suggest for warm starts). With an orthonormal basis
    ``B`` kept from the previous step, one round::

        even steps (B = Q^, m x r):  P = M B      all-reduce P    aggregate = P B^T
                                     next B = orthonormal basis of P   (n x r)
        odd steps  (B = P^, n x r):  Q = M^T B    all-reduce Q    aggregate = B Q^T
                                     next B = orthonormal basis of Q   (m x r)

    Each step projects every rank's ``M_w`` onto the same subspace (``M_w B B^T`` or
    ``B B^T M_w``), so the aggregate is still the sum of the contributions and error
    feedback keeps the rest. Per step: one round instead of two, ``n r`` or ``m r`` floats
    instead of ``(n + m) r``, and one product with ``M`` fewer; the subspace is refined by
    half a power iteration per step instead of a whole one, so a gradient whose dominant
    subspace moves fast is tracked one step later. ``start_iter`` and the first basis (a
    Gaussian, orthonormalised, identical on every rank) are as above.

    Args:
        rank: ``r``. Per-rank payload is ``(n + m) r`` floats instead of ``n m``.
        start_iter: the first ``start_iter`` exchanges of each tensor are plain all-reduces,
            as in PyTorch's ``powerSGD_hook`` (there 1000): early gradients change fast and
            a low-rank view of them is poor. 10 suits small runs; raise it for long ones.
        min_compression_rate: a tensor for which ``n m / ((n + m) r)`` is below this goes
            dense (default 2, as in PyTorch's hook).
        warm_start: reuse the previous step's aggregated ``Q`` (Algorithm 2's warm start;
            one power iteration per step then tracks the dominant subspace over time).
            Otherwise draw a fresh Gaussian ``Q`` each step.
        loco_beta: the error-feedback memory (:meth:`~hvd_compress.schemes.base.Scheme.
            loco_option`): 0 (default) keeps the plain residual ``M_w - P^ P^T M_w``; in
            ``(0, 1)``, LoCo's moving average of those errors with this weight on the old
            residual. The first ``start_iter`` steps send exactly and keep no residual
            either way.

    Orthogonalisation is a Householder QR, which stays stable when ``P`` is rank-deficient
    (a zero gradient, say), where Gram-Schmidt would divide by zero.

    Past the warm-up, the pipeline hands a bucket's matrices to :meth:`exchange_many` at
    once (:mod:`hvd_compress.schemes.batched`): every ``P`` (then every ``Q``) of the bucket
    is computed into one flat buffer that is the round's request, and the matrices of equal
    shape are orthogonalised by one batched QR. Same products, same QR per matrix: the
    results are those of :meth:`exchange` tensor by tensor (``tests/test_powersgd_batched.py``
    checks it bit for bit); only the order of the factors in the round's buffer differs.
    ``batch_tensors = False`` on an instance keeps the per-tensor path (a performance switch,
    not an option: checkpoints do not record it). docs/benchmarks.md has the figures.
    """

    name = "powersgd"
    error_feedback = True
    linear_rounds = True  # P and Q are sums of per-rank products (hvd_compress.hierarchy)

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, loco_beta: float = 0.0,
                 alternate: bool = False) -> None:
        if rank < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {rank}")
        if alternate and not warm_start:
            raise ValueError("powersgd: alternate=True refines the previous step's basis, so "
                             "it needs warm_start=True")
        self.rank = rank
        self.start_iter = check_start_iter(self.name, start_iter)
        self.min_compression_rate = min_compression_rate
        self.warm_start = warm_start
        self.loco_beta = self.loco_option(loco_beta)
        self.alternate = alternate
        self.batch_tensors = True
        self._layouts: dict[tuple[FactorKey, ...], FlatLayout] = {}

    @staticmethod
    def matrix_shape(shape: torch.Size) -> tuple[int, int]:
        """The ``(n, m)`` matrix view of a tensor: first dimension by all the others."""
        n = shape[0] if len(shape) else 1
        return n, shape.numel() // max(n, 1)

    def factor_rank(self, shape: torch.Size) -> int:
        """``r = min(rank, n, m)``: the columns of the factors ``P`` and ``Q`` of a tensor of
        this shape (its :meth:`matrix_shape` ``(n, m)``)."""
        n, m = self.matrix_shape(shape)
        return min(self.rank, n, m)

    def applies_to(self, shape: torch.Size) -> bool:
        return len(shape) >= 2 and shape.numel() > 0

    def payload_bytes(self, shape: torch.Size) -> int:
        """Bytes per step: ``4 (n + m) r``; with ``alternate``, the mean of a step's
        ``4 n r`` and the next one's ``4 m r``."""
        n, m = self.matrix_shape(shape)
        both = 4 * (n + m) * self.factor_rank(shape)
        return both // 2 if self.alternate else both

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        if ctx.step < self.start_iter:
            return (yield from dense_warmup(x, state))

        n, m = self.matrix_shape(x.shape)
        r = self.factor_rank(x.shape)
        matrix = x.reshape(n, m)
        if self.alternate:
            return (yield from self._half_step(matrix, x.shape, r, state, ctx))
        q = self._q(state, ctx, m, r, x.device)
        _, p = yield from _reduce_product("P", matrix, q)
        p_hat = torch.linalg.qr(p).Q
        q_local = _left_product(p_hat, matrix).t()  # M^T P^ (see _reduce_product)
        q_total = (yield AllReduce("Q", q_local.t())).t()

        # Both kept as factors: the pipeline writes P^ Q^T straight into the gradient and
        # subtracts P^ Q_local^T from the residual, one product each. Q is kept as the
        # transpose of a contiguous r x m matrix, the layout the next step's product takes.
        aggregate = LowRank(p_hat, q_total, x.shape)
        sent = LowRank(p_hat, q_local, x.shape)
        return Outcome(aggregate, sent, 4 * (n + m) * r, {Q_STATE: q_total})

    def _half_step(self, matrix: torch.Tensor, shape: torch.Size, r: int,
                   state: Mapping[str, torch.Tensor], ctx: ExchangeContext) -> Exchange:
        """One round of ``alternate``: project on the kept basis's side, sum, keep the
        orthonormal basis of the sum for the other side next step."""
        left = (ctx.step - self.start_iter) % 2 == 1  # odd steps: B = P^, send M^T B
        key = P_STATE if left else Q_STATE
        rows = matrix.shape[0] if left else matrix.shape[1]
        basis = self._basis(key, state, ctx, rows, r, matrix.device)
        if left:
            local = _left_product(basis, matrix).t()  # M^T B (see _reduce_product)
            total = (yield AllReduce("Q", local.t())).t()
            aggregate, sent = LowRank(basis, total, shape), LowRank(basis, local, shape)
            kept = {Q_STATE: torch.linalg.qr(total).Q}
        else:
            local, total = yield from _reduce_product("P", matrix, basis)
            aggregate, sent = LowRank(total, basis, shape), LowRank(local, basis, shape)
            kept = {P_STATE: torch.linalg.qr(total).Q}
        return Outcome(aggregate, sent, 4 * local.numel(), kept)

    def batches(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                ctx: ExchangeContext) -> bool:
        """Whether this step of ``x`` goes through :meth:`exchange_many`: past the warm-up,
        unless ``batch_tensors`` is off."""
        return self.batch_tensors and ctx.step >= self.start_iter

    def exchange_many(self, xs: Sequence[torch.Tensor],
                      states: Sequence[Mapping[str, torch.Tensor]],
                      ctxs: Sequence[ExchangeContext]
                      ) -> Generator[AllReduce, Any, list[Outcome]]:
        """:meth:`exchange` of every tensor of ``xs`` (one dtype and device, past the
        warm-up) at once: one request per round for all of them, one outcome each."""
        shapes = [x.shape for x in xs]
        sizes = [self.matrix_shape(shape) for shape in shapes]
        ranks = [self.factor_rank(shape) for shape in shapes]
        matrices = [x.reshape(nm) for x, nm in zip(xs, sizes, strict=True)]
        if self.alternate:
            return (yield from self._half_steps(matrices, shapes, ranks, states, ctxs))
        qs = [self._q(state, ctx, m, r, x.device) for (_, m), r, state, ctx, x
              in zip(sizes, ranks, states, ctxs, xs, strict=True)]
        _, p_total, p_layout = yield from self._reduce_products("P", matrices, qs, False)
        p_hats = p_layout.orthonormal(p_layout.blocks(p_total))
        q_flat, q_total, q_layout = yield from self._reduce_products("Q", matrices, p_hats,
                                                                    True)
        return [Outcome(LowRank(p_hat, q_sum, shape), LowRank(p_hat, q_local, shape),
                        4 * (n + m) * r, {Q_STATE: q_sum})
                for p_hat, q_local, q_sum, shape, (n, m), r in zip(
                    p_hats, q_layout.factors(q_flat), q_layout.factors(q_total), shapes,
                    sizes, ranks, strict=True)]

    def _half_steps(self, matrices: list[torch.Tensor], shapes: list[torch.Size],
                    ranks: list[int], states: Sequence[Mapping[str, torch.Tensor]],
                    ctxs: Sequence[ExchangeContext]
                    ) -> Generator[AllReduce, Any, list[Outcome]]:
        """:meth:`_half_step` of every matrix: the right-hand ones' ``P`` in one round,
        then the left-hand ones' ``Q`` in another (one round when, as usual, every tensor
        is at the same step)."""
        outcomes: list[Outcome | None] = [None] * len(matrices)
        for left in (False, True):
            chosen = [i for i, ctx in enumerate(ctxs)
                      if ((ctx.step - self.start_iter) % 2 == 1) == left]
            if not chosen:
                continue
            key = P_STATE if left else Q_STATE
            bases = [self._basis(key, states[i], ctxs[i],
                                 matrices[i].shape[0 if left else 1], ranks[i],
                                 matrices[i].device) for i in chosen]
            mats = [matrices[i] for i in chosen]
            flat, total, layout = yield from self._reduce_products(
                "Q" if left else "P", mats, bases, left)
            locals_, totals = layout.factors(flat), layout.factors(total)
            kept = layout.orthonormal(layout.blocks(total))
            for i, basis, local, total_i, new in zip(chosen, bases, locals_, totals, kept,
                                                     strict=True):
                if left:
                    pair = LowRank(basis, total_i, shapes[i]), LowRank(basis, local, shapes[i])
                else:
                    pair = LowRank(total_i, basis, shapes[i]), LowRank(local, basis, shapes[i])
                outcomes[i] = Outcome(*pair, 4 * local.numel(),
                                      {(Q_STATE if left else P_STATE): new})
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def _q(self, state: Mapping[str, torch.Tensor], ctx: ExchangeContext, m: int, r: int,
           device: torch.device) -> torch.Tensor:
        """The ``m x r`` right factor of this step: the kept ``Q`` (warm start), or a
        Gaussian drawn alike on every rank."""
        q = state.get(Q_STATE) if self.warm_start else None
        if q is None or q.shape != (m, r):
            gen = ctx.generator("init-q", torch.device("cpu"), shared=True)
            q = torch.randn(m, r, generator=gen).to(device)
        return q

    @staticmethod
    def _basis(key: str, state: Mapping[str, torch.Tensor], ctx: ExchangeContext, rows: int,
               r: int, device: torch.device) -> torch.Tensor:
        """The kept orthonormal basis ``key`` (``rows x r``), or the first one: a shared
        Gaussian, orthonormalised."""
        basis = state.get(key)
        if basis is None or basis.shape != (rows, r):
            gen = ctx.generator(f"init-{key}", torch.device("cpu"), shared=True)
            basis = torch.linalg.qr(torch.randn(rows, r, generator=gen)).Q.to(device)
        return basis

    def _reduce_products(self, round_name: str, matrices: Sequence[torch.Tensor],
                         rights: Sequence[torch.Tensor], left: bool
                         ) -> Generator[AllReduce, Any,
                                        tuple[torch.Tensor, torch.Tensor, FlatLayout]]:
        """Every ``M R`` (or, ``left``, every ``M^T R``, each ``m x r``) into one flat
        buffer, summed over ranks in one round: (this rank's buffer, the flat sum, their
        :class:`FlatLayout`). Each factor is stored as
        :func:`_reduce_product` (or, ``left``, the per-tensor ``Q`` round) lays it out,
        computed by the same product, written in place into the buffer
        (:func:`_product_into`)."""
        keys: list[FactorKey] = []
        for matrix, right in zip(matrices, rights, strict=True):
            n, m = matrix.shape
            r = right.shape[1]
            keys.append((m, r, True) if left else (n, r, _transposed(n, m, r)))
        layout = self._layouts.get(key := tuple(keys))
        if layout is None:
            layout = self._layouts[key] = FlatLayout.of(keys)
        flat = torch.empty(layout.numel, dtype=matrices[0].dtype, device=matrices[0].device)
        stored = layout.member_views(flat)
        for matrix, right, out, (_, _, transposed) in zip(matrices, rights, stored, keys,
                                                          strict=True):
            if left:  # M^T R as (R^T M)^T, as exchange() computes Q
                _left_product(right, matrix, out)
            else:
                _right_product(right, matrix, transposed, out)
        total = yield AllReduce(round_name, flat)
        return flat, total, layout

    def options(self) -> dict[str, Any]:
        """``alternate`` only when on, so checkpoints from before the option still load."""
        options: dict[str, Any] = {"rank": self.rank, "start_iter": self.start_iter,
                                   "min_compression_rate": self.min_compression_rate,
                                   "warm_start": self.warm_start}
        if self.alternate:
            options["alternate"] = True
        return options


ALIGNED_BYTES = 64
"""The alignment of a fresh CPU tensor's memory (torch's allocator)."""


def _off_alignment(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.data_ptr() % ALIGNED_BYTES != 0


def _aligned(factor: torch.Tensor) -> torch.Tensor:
    """``factor``, or a copy of it with the same strides at a fresh, aligned address.

    On some CPUs (AMD EPYC) MKL's GEMM rounds a product differently when its thin factor,
    or its destination, lies at an address that is not a multiple of 16 bytes. The big
    matrix's own address does not change the bits (measured for every shape in
    ``tests/test_pipeline.py`` and ``tests/test_powersgd_layout.py``). Factors cut from a
    bucket's flat buffer lie anywhere, while the per-tensor path's are fresh tensors. So
    every product takes its factor through here and its destination through
    :func:`_product_into`, and the paths agree bit for bit. A copy costs the factor's
    ``n r`` elements, small beside the product's ``n m r``."""
    return factor.clone() if _off_alignment(factor) else factor


def _product_into(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``out = left @ right``, computed into a fresh tensor and copied when ``out`` lies
    off the alignment (:func:`_aligned`)."""
    if _off_alignment(out):
        out.copy_(left @ right)
    else:
        torch.matmul(left, right, out=out)


def _left_product(basis: torch.Tensor, matrix: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``B^T M`` (``r x m``) into ``out`` (a fresh tensor if ``None``): on the CPU by the
    native kernel (:func:`hvd_compress.native.tensors.lowrank_left`, its order of sums
    stated), else MKL's product through :func:`_aligned` and :func:`_product_into`."""
    if out is None:
        out = torch.empty(basis.shape[1], matrix.shape[1], dtype=matrix.dtype,
                          device=matrix.device)
    if not native.lowrank_left(out, basis, matrix):
        _product_into(out, _aligned(basis.t()), matrix)
    return out


def _right_product(right: torch.Tensor, matrix: torch.Tensor, transposed: bool,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``M R`` into ``out`` (a fresh tensor if ``None``), laid out ``r x n`` (its transpose)
    when ``transposed``, else ``n x r``: on the CPU by the native kernel
    (:func:`hvd_compress.native.tensors.lowrank_right`), else MKL's product of the layout
    :func:`_reduce_product` explains."""
    n, r = matrix.shape[0], right.shape[1]
    if out is None:
        out = torch.empty((r, n) if transposed else (n, r), dtype=matrix.dtype,
                          device=matrix.device)
    if native.lowrank_right(out.t() if transposed else out, matrix, right):
        return out
    if transposed:
        _product_into(out, _aligned(right.t().contiguous()), matrix.t())
    else:
        _product_into(out, matrix, _aligned(right))
    return out


TRANSPOSED_UP_TO = 1 << 19
"""The most elements of ``M`` for which :func:`_reduce_product` computes ``M R`` at rank
above 4 as ``(R^T M^T)^T`` (up to rank 4 it always does)."""


def _transposed(n: int, m: int, rank: int) -> bool:
    """Whether :func:`_reduce_product` computes ``M R`` (``M`` being ``n x m``) transposed."""
    return rank <= 4 or n * m <= TRANSPOSED_UP_TO


def _reduce_product(round_name: str, matrix: torch.Tensor, right: torch.Tensor
                    ) -> Generator[AllReduce, Any, tuple[torch.Tensor, torch.Tensor]]:
    """``matrix @ right`` (``n x r``) summed over ranks in one all-reduce round: (this
    rank's product, the sum), both ``n x r`` (possibly transposed views).

    The products with ``M`` are the scheme's main cost, and with a thin factor (``r`` of a
    few columns) MKL's CPU GEMM is much faster on the transposed problem. ``M Q`` as
    ``(Q^T M^T)^T`` is up to 3x faster on the transformer's and the CNN's matrices of
    ``bench overhead``'s zoo, level on a 2048 x 1024 one at rank 4, and slower above rank
    4 beyond :data:`TRANSPOSED_UP_TO` elements, where ``M Q`` is kept. (``M^T P^`` as
    ``(P^^T M)^T``, 2-4x faster at every size measured at ranks 4 and 8, is written out
    where it is used.) It is the same product; the request then carries ``P^T``, the same
    elements in another order, chosen from the shapes alone, so every rank sends the same
    layout. ``right`` kept as the transpose of a contiguous matrix (as :class:`PowerSGD`
    keeps ``Q``) is used without a copy. On the CPU with the native kernels both layouts
    are computed by ``lowrank.cpp`` alike (:func:`_right_product`); the layout still
    follows the shapes, so a rank without the kernels sends the same one.
    """
    n, m = matrix.shape
    if _transposed(n, m, right.shape[1]):
        local_t = _right_product(right, matrix, True)
        total_t = yield AllReduce(round_name, local_t)
        return local_t.t(), total_t.t()
    local = _right_product(right, matrix, False)
    total = yield AllReduce(round_name, local)
    return local, total
