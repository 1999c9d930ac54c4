"""Rank-R collaborative factors by CP-ALS on the factored Tucker core.

A Tucker (HOSVD) compression gives the query- and key-side subspaces from d_k-sized blocks; CP-ALS then runs on
the factored core, where each contraction costs O(N_h d_k r R) instead of O(N_h D_in^2 R).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .products import COMPUTE_DTYPE, EXACT, CollaborativeFactors, HeadProducts, relative_error
from .tucker import TuckerSubspaces, identity_subspaces, project, tucker_subspaces

ALS_DTYPE = torch.float32


def per_head_truncation(products: HeadProducts, rank: int) -> CollaborativeFactors:
    """The best block-diagonal collaborative form: each head keeps its own leading singular directions.

    The R kept directions are the R largest singular values over all heads (a head keeps at most d_k), which
    minimises the error among forms whose mixing vectors select disjoint blocks. At R = N_h d_k it is exact.
    """
    heads, d_k, _ = products.query_heads.shape
    # T_i = Q_i^T K_i = (Uq Rq)... : thin QR of each side, then an SVD of the d_k x d_k middle.
    qa, ra = torch.linalg.qr(products.query_heads.transpose(1, 2), mode="reduced")  # (H, D, d), (H, d, d)
    qb, rb = torch.linalg.qr(products.key_heads.transpose(1, 2), mode="reduced")
    u, s, vh = torch.linalg.svd(ra @ rb.transpose(1, 2))  # (H, d, d)
    left = qa @ u  # (H, D, d)
    right = qb @ vh.transpose(1, 2)
    order = torch.argsort(s.reshape(-1), descending=True, stable=True)[:rank]
    head_of = order // d_k
    index_in_head = order % d_k
    # Keep each head's directions together and in order, which makes the result easy to read and stable.
    order = order[torch.argsort(head_of * d_k + index_in_head, stable=True)]
    head_of, index_in_head = order // d_k, order % d_k
    sigma = s[head_of, index_in_head].sqrt()
    shared_query = left[head_of, :, index_in_head].T * sigma
    shared_key = right[head_of, :, index_in_head].T * sigma
    mixing = torch.zeros(heads, len(order), dtype=products.query_heads.dtype)
    mixing[head_of, torch.arange(len(order))] = 1.0
    factors = CollaborativeFactors(shared_query, shared_key, mixing)
    # more rank than the heads have directions: pad with inert columns
    return _pad(factors, rank) if len(order) < rank else factors


def shared_subspace_init(products: HeadProducts, subspaces: TuckerSubspaces, rank: int) -> CollaborativeFactors:
    """Leading Tucker directions on both sides, with the best mixing for them (a least-squares fit)."""
    q = subspaces.query_basis[:, :rank]
    k = subspaces.key_basis[:, :rank]
    r = min(q.shape[1], k.shape[1])
    q, k = q[:, :r], k[:, :r]
    mixing = _solve_mixing(products, q, k)
    factors = CollaborativeFactors(q, k, mixing)
    if r < rank:
        factors = _pad(factors, rank)
    return factors


def _pad(factors: CollaborativeFactors, rank: int) -> CollaborativeFactors:
    pad = rank - factors.rank
    z = lambda t: torch.cat([t, t.new_zeros(t.shape[0], pad)], 1)  # noqa: E731
    return CollaborativeFactors(z(factors.shared_query), z(factors.shared_key), z(factors.mixing))


def _solve(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """rhs @ gram^-1 for a symmetric PSD gram, with a whisper of ridge against exact singularity."""
    tiny = 1e-12 if gram.dtype == torch.float64 else 1e-7
    ridged = gram.clone()
    diagonal = ridged.diagonal()
    diagonal += tiny * diagonal.abs().max().clamp_min(1e-30)  # on the device: no round trip to the host
    # Cholesky first: a third of a general solve's time, and the ridged gram is positive definite unless
    # rounding says otherwise, when the general solve takes over.
    factor, info = torch.linalg.cholesky_ex(ridged)
    if int(info) == 0:
        return torch.cholesky_solve(rhs.T, factor).T
    return torch.linalg.solve(ridged, rhs.T).T


def _solve_mixing(products: HeadProducts, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # m_i = diag(q^T T_i k) (q^T q * k^T k)^-1
    rhs = ((products.query_heads @ q) * (products.key_heads @ k)).sum(1)  # (H, R)
    return _solve((q.T @ q) * (k.T @ k), rhs)


@dataclass
class FitResult:
    factors: CollaborativeFactors
    relative_error: float
    initial_error: float
    initialisation: str
    iterations: int
    history: list[float] = field(default_factory=list)
    # singular values of the query- and key-side unfoldings (the Tucker spectra), for reports
    query_spectrum: torch.Tensor | None = None
    key_spectrum: torch.Tensor | None = None
    # the error of the best block-diagonal form at the same rank, where the fit computed it: the baseline
    # that the shared form must beat
    per_head_truncation_error: float | None = None


def fit_collaborative(
    products: HeadProducts,
    rank: int,
    max_iterations: int = 500,
    tolerance: float = 1e-3,
    device: str | torch.device = "cpu",
) -> FitResult:
    """Rank-R collaborative factors of the stacked head products.

    Starts from the better of the best per-head truncation and the shared-subspace initialisation, then runs
    CP-ALS on the Tucker core. ALS never increases the error, so the result is never worse than per-head
    truncation. Deterministic: no random start. Stops when an iteration lowers the error by less than
    `tolerance` of its value: on real models the embedding fidelity has settled long before the product
    error stops creeping down.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    subspaces = tucker_subspaces(products)
    core = project(products, subspaces)

    candidates = {
        "per-head truncation": per_head_truncation(core, rank),
        "shared subspace": shared_subspace_init(core, identity_subspaces(core), rank),
    }
    errors = {name: relative_error(core, f) for name, f in candidates.items()}
    init_name = min(errors, key=errors.get)
    factors, history, iterations = candidates[init_name], [errors[init_name]], 0
    # At full rank the per-head start is exact; the factored error formula only resolves it to ~1e-8.
    if rank < products.full_rank and errors[init_name] > EXACT:
        factors, iterations = _als(core, factors, history, max_iterations, tolerance, device)

    back = CollaborativeFactors(
        subspaces.query_basis @ factors.shared_query,
        subspaces.key_basis @ factors.shared_key,
        factors.mixing,
    ).balanced()
    return FitResult(
        factors=back,
        relative_error=relative_error(products, back),
        initial_error=errors[init_name],
        initialisation=init_name,
        iterations=iterations,
        history=history,
        query_spectrum=subspaces.query_singular_values,
        key_spectrum=subspaces.key_singular_values,
        per_head_truncation_error=errors["per-head truncation"],
    )


def _als(core: HeadProducts, start: CollaborativeFactors, history: list[float], max_iterations: int,
         tolerance: float, device) -> tuple[CollaborativeFactors, int]:
    """CP-ALS with Bro's line search from `start`; appends each iteration's error to `history`.

    ALS runs in float32: its GEMMs dominate and halve in cost; the error it steers by is accurate to ~1e-6 of
    ||T||, far below any error worth chasing. Everything around it stays float64. `device` moves only the ALS
    (the part that scales with rank and width); one code path for all.
    """
    als = _FactoredALS(core, ALS_DTYPE, device)
    error = history[-1]
    state = als.start(*(t.to(device=device, dtype=ALS_DTYPE) for t in (start.shared_query, start.shared_key, start.mixing)),
                      error)
    power = 3.0  # extrapolation step iteration^(1/power), grown more timid after each failed jump
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        previous = state
        state = als.sweep(state)
        # Bro's line search: CP-ALS crawls through long swamps; a jump along the last step often lands far
        # ahead. The jump is kept only if it lowers the error, so the fit stays monotone.
        if iterations > 1:
            jump = als.extrapolate(previous, state, iterations ** (1.0 / power))
            if jump.error < state.error:
                state = jump
            else:
                power += 1.0
        history.append(state.error)
        improvement = error - state.error
        error = state.error
        if improvement < tolerance * error or error < EXACT:
            break
    factors = (state.query, state.key, state.mixing)
    return CollaborativeFactors(*(t.to(device="cpu", dtype=COMPUTE_DTYPE) for t in factors)), iterations


@dataclass
class _ALSState:
    """Factors with the products every update reuses: the heads projected onto them and their Gram matrices."""

    query: torch.Tensor  # (r_q, R)
    key: torch.Tensor  # (r_k, R)
    mixing: torch.Tensor  # (H, R)
    query_projected: torch.Tensor  # (H, d_k, R): Q_i q
    key_projected: torch.Tensor  # (H, d_k, R): K_i k
    query_gram: torch.Tensor  # q^T q
    key_gram: torch.Tensor  # k^T k
    error: float


class _FactoredALS:
    """CP-ALS steps on a factored core; each contraction is one GEMM over the stacked heads.

    A sweep costs four head GEMMs (two MTTKRPs, two projections) and four small solves. The line search's jump
    costs no head GEMM: projections are linear in the factors, so the jumped projections are the same
    extrapolation of the last two.
    """

    def __init__(self, core: HeadProducts, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.norm = core.squared_norm()
        core = HeadProducts(core.query_heads.to(device=device, dtype=dtype), core.key_heads.to(device=device, dtype=dtype))
        self.core = core
        self.query_cat = core.query_heads.reshape(-1, core.query_heads.shape[2]).T  # (r_q, N_h d_k)
        self.key_cat = core.key_heads.reshape(-1, core.key_heads.shape[2]).T

    def start(self, q, k, m, error: float) -> _ALSState:
        return _ALSState(q, k, m, self.core.query_heads @ q, self.core.key_heads @ k, q.T @ q, k.T @ k, error)

    def sweep(self, state: _ALSState) -> _ALSState:
        """One pass of exact least-squares updates: query factor, key factor, then mixing."""
        m = state.mixing
        mixing_gram = m.T @ m
        # MTTKRP: sum_i Q_i^T (K_i k diag(m_i)) = [Q_1^T .. Q_N^T] @ stacked (K_i k diag(m_i)).
        rank = m.shape[1]
        q = _solve(state.key_gram * mixing_gram, self.query_cat @ (state.key_projected * m[:, None, :]).reshape(-1, rank))
        qproj, query_gram = self.core.query_heads @ q, q.T @ q
        k = _solve(query_gram * mixing_gram, self.key_cat @ (qproj * m[:, None, :]).reshape(-1, rank))
        return self._mixed(q, k, qproj, self.core.key_heads @ k, query_gram, k.T @ k)

    def extrapolate(self, previous: _ALSState, current: _ALSState, step: float) -> _ALSState:
        """The state at current + (step - 1) (current - previous), with its best mixing."""
        def ahead(name: str) -> torch.Tensor:
            now = getattr(current, name)
            return now + (step - 1.0) * (now - getattr(previous, name))

        q, k = ahead("query"), ahead("key")
        return self._mixed(q, k, ahead("query_projected"), ahead("key_projected"), q.T @ q, k.T @ k)

    def _mixed(self, q, k, qproj, kproj, query_gram, key_gram) -> _ALSState:
        """The state of these factors with their least-squares mixing, and its relative error."""
        rhs = (qproj * kproj).sum(1)  # (H, R): diag(q^T T_i k)
        gram = query_gram * key_gram
        m = _solve(gram, rhs)
        # ||T||^2 - 2<T, CP> + ||CP||^2 from quantities already at hand.
        err2 = self.norm - 2.0 * float((rhs * m).sum()) + float(((m.T @ m) * gram).sum())
        return _ALSState(q, k, m, qproj, kproj, query_gram, key_gram, math.sqrt(max(err2, 0.0) / self.norm))
