"""Rank-R collaborative factors by CP-ALS on the factored products, in their Tucker subspaces.

The dense N_h x D_in x D_in tensor is never formed. CP-ALS runs in the span of the heads' rows (the Tucker
subspaces of the two sides), where each contraction is one GEMM with the heads' Gram matrix,
O((N_h d_k)^2 R) instead of the dense tensor's O(N_h D_in^2 R).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .products import COMPUTE_DTYPE, EXACT, CollaborativeFactors, HeadProducts, relative_error
from .tucker import TuckerSubspaces, tucker_subspaces

ALS_DTYPE = torch.float32
# The shared-subspace start is tried up to this many ranks per head. It only ever started better than per-head
# truncation at a few ranks per head: all-MiniLM-L6-v2 up to R = 16 (12 heads), rxnmapper's ALBERT up to R = 2
# (8 heads), per-head truncation at every rank above, up to full. Above the limit its HOSVD vectors, a fifth of a
# weight-only fit's time, are not computed (the spectra for the report are: eigenvalues alone).
SHARED_START_RANKS_PER_HEAD = 4


def starts_shared(products: HeadProducts, rank: int) -> bool:
    """Whether a weight-only fit at this rank tries the shared-subspace start (and so reads the HOSVD's vectors)."""
    return rank <= SHARED_START_RANKS_PER_HEAD * products.num_heads


def per_head_truncation(products: HeadProducts, rank: int) -> CollaborativeFactors:
    """The best block-diagonal collaborative form: each head keeps its own leading singular directions.

    The R kept directions are the R largest singular values over all heads (a head keeps at most d_k), which
    minimises the error among forms whose mixing vectors select disjoint blocks. At R = N_h d_k it is exact.
    """
    return _per_head_truncation(products, rank)[0]


def _per_head_truncation(products: HeadProducts, rank: int) -> tuple[CollaborativeFactors, float]:
    """(the best per-head truncation, its relative error): the error is the energy of the singular values
    it drops, exact and without cancellation."""
    heads, d_k, _ = products.query_heads.shape
    left, s, right = products.head_svd()  # (H, D, d), (H, d), (H, D, d)
    order = torch.argsort(s.reshape(-1), descending=True, stable=True)[:rank]
    energy = s.reshape(-1) ** 2
    total = float(energy.sum())
    dropped = torch.ones_like(energy, dtype=torch.bool)
    dropped[order] = False  # the energy left out, summed as itself: no cancellation against the total
    error = math.sqrt(float(energy[dropped].sum()) / total) if total > 0 else 0.0
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
    return (_pad(factors, rank) if len(order) < rank else factors), error


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
        if rhs.shape[0] > gram.shape[0]:
            # Many right-hand sides (the factor updates): one explicit inverse and a GEMM run in 60% of the time
            # of cholesky_solve, whose triangular solves were a third of an ALS sweep.
            return rhs @ torch.cholesky_inverse(factor)
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
    # where the ALS ran: its factors as combinations of the fitted heads' stacked rows, (N_h d_k, R) weights for
    # each side (shared_query = query rows^T @ weights): the same combinations of other rows carry the factors
    # into those rows' basis (a calibrated fit's raw heads, calibrated.fit_calibrated)
    row_weights: tuple[torch.Tensor, torch.Tensor] | None = None


def fit_collaborative(
    products: HeadProducts,
    rank: int,
    max_iterations: int = 500,
    tolerance: float = 1e-3,
    device: str | torch.device = "cpu",
    subspaces: TuckerSubspaces | None = None,
    own_products: bool = False,
) -> FitResult:
    """Rank-R collaborative factors of the stacked head products (`subspaces`: their HOSVD with bases, where the
    caller has it already).

    Starts from the better of the best per-head truncation and, at a few ranks per head, the shared-subspace
    initialisation, then runs CP-ALS. ALS never increases the error, so the result is never worse than
    per-head truncation. Deterministic: no random start. Stops when an iteration lowers the error by less than
    `tolerance` of its value: on real models the embedding fidelity has settled long before the product error
    stops creeping down.

    The ALS works in the span of the heads' rows, which is the Tucker (HOSVD) subspace of each side: every
    update of a factor lies there, and working in it needs no basis. The HOSVD is computed for the spectra and
    the shared-subspace start. `own_products`: the products are the caller's to fit once (not the same
    layer at several ranks), so what the starts derived from them is let go before the ALS.
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    tries_shared = starts_shared(products, rank)
    if subspaces is None or (tries_shared and subspaces.query_basis is None):
        subspaces = tucker_subspaces(products, bases=tries_shared)
    candidates, errors = {}, {}
    candidates["per-head truncation"], errors["per-head truncation"] = _per_head_truncation(products, rank)
    if tries_shared:
        candidates["shared subspace"] = shared_subspace_init(products, subspaces, rank)
        errors["shared subspace"] = relative_error(products, candidates["shared subspace"])
    init_name = min(errors, key=errors.get)
    history, iterations, row_weights = [errors[init_name]], 0, None
    if own_products:  # 32 MB of head bases at D_in = 1024, 16 heads; the start not chosen
        products.forget_head_factors()
        candidates = {init_name: candidates[init_name]}
    # At full rank the per-head start is exact; the factored error formula only resolves it to ~1e-8.
    if rank < products.full_rank and errors[init_name] > EXACT and max_iterations > 0:
        # handed over, not held here: the ALS lets the start go once it has read it (float64, 2 D_in R)
        factors, iterations, row_weights = _als(products, candidates.pop(init_name), history, max_iterations,
                                                tolerance, device)
    else:
        factors = candidates[init_name]

    factors, row_weights = _balanced(factors, row_weights)
    return FitResult(
        factors=factors,
        # a start kept as it was has its error already (the truncation's exact, without cancellation)
        relative_error=relative_error(products, factors) if iterations else errors[init_name],
        initial_error=errors[init_name],
        initialisation=init_name,
        iterations=iterations,
        history=history,
        query_spectrum=subspaces.query_singular_values,
        key_spectrum=subspaces.key_singular_values,
        per_head_truncation_error=errors["per-head truncation"],
        row_weights=row_weights,
    )


def _balanced(factors: CollaborativeFactors, row_weights: tuple[torch.Tensor, torch.Tensor] | None):
    """factors.balanced(), and the row weights that give its shared query and key."""
    query_scale, key_scale, mixing_scale = factors.balancing_scales()
    balanced = factors.scaled(query_scale, key_scale, mixing_scale)
    return balanced, None if row_weights is None else (row_weights[0] * query_scale, row_weights[1] * key_scale)


def _als(core: HeadProducts, start: CollaborativeFactors, history: list[float], max_iterations: int,
         tolerance: float, device) -> tuple[CollaborativeFactors, int, tuple[torch.Tensor, torch.Tensor] | None]:
    """CP-ALS with Bro's line search from `start`; appends each iteration's error to `history`. Returns the
    factors, the iterations run and, where any ran, the factors' weights on the heads' rows (float64).

    ALS runs in float32: its GEMMs dominate and halve in cost; the error it steers by is accurate to ~1e-6 of
    ||T||, far below any error worth chasing. Everything around it stays float64. `device` moves only the ALS
    (the part that scales with rank and width); one code path for all.

    Nesterov momentum with restarts (Mitchell, Ye and De Sterck) was tried in its place: a lower product error
    in the same time (MiniLM r192: 0.4090 against 0.4109) and a third of the time at tolerance 1e-5, but its
    calibrated fits grew large, cancelling components (median magnitude 2.5x), from which the refinement could
    not improve: embedding cosine 0.9915 / 1st percentile 0.9794 against 0.9941 / 0.9852. Not kept.
    """
    als = _FactoredALS(core, ALS_DTYPE, device)
    state = als.start(*(t.to(device=device, dtype=ALS_DTYPE) for t in (start.shared_key, start.mixing)),
                      history[-1])
    del start  # the caller handed it over: its float64 factors are not held through the sweeps
    state, iterations = _iterate(als, state, history, max_iterations, tolerance)
    shared_query, shared_key, mixing = als.factors(state)
    weights = state.query_weights, state.key_weights
    del als, state  # the heads' rows and Gram matrices, before the float64 copies are made
    factors = CollaborativeFactors(*(t.to(device="cpu", dtype=COMPUTE_DTYPE) for t in (shared_query, shared_key,
                                                                                         mixing)))
    return factors, iterations, tuple(t.to(device="cpu", dtype=COMPUTE_DTYPE) for t in weights)


def _iterate(als: "_FactoredALS", state: "_ALSState", history: list[float], max_iterations: int,
             tolerance: float) -> tuple["_ALSState", int]:
    """(the last state, iterations run) of the sweeps from `state`; a function of its own so that only the last
    state outlives it."""
    error, power = history[-1], 3.0  # extrapolation step iteration^(1/power), grown more timid after each failure
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        previous = state
        state = als.sweep(state)
        # Bro's line search: CP-ALS crawls through long swamps; a jump along the last step often lands far
        # ahead. The jump is kept only if it lowers the error, so the fit stays monotone. It is made in the
        # previous state's tensors, which nothing reads after it: two states held, not three.
        if iterations > 1:
            jump = als.extrapolate(previous, state, iterations ** (1.0 / power))
            if jump.error < state.error:
                state = jump
            else:
                power += 1.0
            del jump
        del previous
        history.append(state.error)
        improvement = error - state.error
        error = state.error
        if improvement < tolerance * error or error < EXACT:
            break
    return state, iterations


@dataclass
class _ALSState:
    """Factors with the products every update reuses: the heads projected onto them and their Gram matrices.

    The query and key factors are held as weights on the heads' rows (q = Q^T query_weights, with Q the
    N_h d_k x r_q stack of every head's query rows), the form every ALS update produces: the update of q is
    Q^T X G^-1 for some X. Then the projections Q q = (Q Q^T) query_weights need one GEMM with the fixed
    head Gram matrix instead of two (Q^T, then Q), and q itself is formed once, at the end.
    """

    query_weights: torch.Tensor  # (N_h d_k, R)
    key_weights: torch.Tensor  # (N_h d_k, R)
    mixing: torch.Tensor  # (H, R)
    query_projected: torch.Tensor  # (H, d_k, R): Q_i q
    key_projected: torch.Tensor  # (H, d_k, R): K_i k
    query_gram: torch.Tensor  # q^T q
    key_gram: torch.Tensor  # k^T k
    error: float


class _FactoredALS:
    """CP-ALS steps on a factored core; each contraction is one GEMM over the stacked heads.

    A sweep costs two head GEMMs (the projections through the heads' Gram matrices), two Gram products, two
    small inverses and their GEMMs. The line search's jump costs no head GEMM: projections are linear in the
    factors, so the jumped projections are the same extrapolation of the last two.
    """

    def __init__(self, core: HeadProducts, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.norm = core.squared_norm()
        self.head_shape = core.query_heads.shape[:2]  # (N_h, d_k)
        # (N_h d_k, D_in): every head's rows, stacked, and their Gram matrices
        self.query_rows, self.query_cross = core.row_gram("query", dtype, device)
        self.key_rows, self.key_cross = core.row_gram("key", dtype, device)

    def start(self, k, m, error: float) -> _ALSState:
        """A state whose key side is ready for a sweep: a sweep's first update reads only the key factor and the
        mixing, so the start's query factor is not needed."""
        kproj = (self.key_rows @ k).reshape(*self.head_shape, -1)
        return _ALSState(None, None, m, None, kproj, None, k.T @ k, error)

    def sweep(self, state: _ALSState) -> _ALSState:
        """One pass of exact least-squares updates: query factor, key factor, then mixing."""
        m = state.mixing
        mixing_gram = m.T @ m
        # q = Q^T X (k^T k * m^T m)^-1 with X the stacked K_i k diag(m_i): the MTTKRP sum_i Q_i^T K_i k diag(m_i)
        qw, qproj, query_gram = self._update(self.query_cross, state.key_projected * m[:, None, :],
                                             state.key_gram * mixing_gram)
        kw, kproj, key_gram = self._update(self.key_cross, qproj * m[:, None, :], query_gram * mixing_gram)
        return self._mixed(qw, kw, qproj, kproj, query_gram, key_gram)

    def _update(self, cross: torch.Tensor, mixed_projection: torch.Tensor, gram: torch.Tensor):
        """(weights on the head rows, projections, Gram matrix) of one side's least-squares update."""
        weights = _solve(gram, mixed_projection.reshape(-1, gram.shape[0]))
        projected = cross @ weights  # Q Q^T w = Q q
        return weights, projected.reshape(*self.head_shape, -1), weights.T @ projected  # q^T q = w^T Q Q^T w

    def extrapolate(self, previous: _ALSState, current: _ALSState, step: float) -> _ALSState:
        """The state at current + (step - 1) (current - previous), with its best mixing, made in `previous`'s
        tensors (which it overwrites)."""
        def ahead(name: str) -> torch.Tensor:  # previous + step (current - previous), in one pass
            return getattr(previous, name).lerp_(getattr(current, name), step)

        qw, kw, qproj, kproj = (ahead(name) for name in ("query_weights", "key_weights", "query_projected",
                                                           "key_projected"))
        rank = qw.shape[1]
        return self._mixed(qw, kw, qproj, kproj, qw.T @ qproj.reshape(-1, rank), kw.T @ kproj.reshape(-1, rank))

    def factors(self, state: _ALSState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query_rows.T @ state.query_weights, self.key_rows.T @ state.key_weights, state.mixing

    def _mixed(self, qw, kw, qproj, kproj, query_gram, key_gram) -> _ALSState:
        """The state of these factors with their least-squares mixing, and its relative error."""
        rhs = (qproj * kproj).sum(1)  # (H, R): diag(q^T T_i k)
        gram = query_gram * key_gram
        m = _solve(gram, rhs)
        # ||T||^2 - 2<T, CP> + ||CP||^2 from quantities already at hand.
        err2 = self.norm - 2.0 * float((rhs * m).sum()) + float(((m.T @ m) * gram).sum())
        return _ALSState(qw, kw, m, qproj, kproj, query_gram, key_gram, math.sqrt(max(err2, 0.0) / self.norm))
