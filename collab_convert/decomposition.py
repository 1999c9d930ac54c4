"""Pure math of collaborative attention: no Hugging Face, no files.

A layer with N_h heads has per-head products T[i] = W_Q^(i)^T W_K^(i) (D_in x D_in), each of rank <= d_k.
The collaborative form approximates the stack by a rank-R CP decomposition

    T[i] ~= shared_query @ diag(mixing[i]) @ shared_key^T

Everything here works from the per-head projections (N_h x d_k x D_in); the dense N_h x D_in x D_in tensor
is never built. A Tucker (HOSVD) compression gives the query- and key-side subspaces from d_k-sized blocks;
CP-ALS then runs on the factored core, where each contraction costs O(N_h d_k r R) instead of O(N_h D_in^2 R).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The decomposition runs in float64: products of trained weights span many orders of magnitude and ALS
# normal equations square the condition number.
COMPUTE_DTYPE = torch.float64
ALS_DTYPE = torch.float32
EXACT = 1e-7  # relative errors below this are exact as far as the factored error formula can tell


@dataclass
class HeadProducts:
    """The stack T[i] = query_heads[i]^T @ key_heads[i], kept in factored form."""

    query_heads: torch.Tensor  # (N_h, d_k, D_in): rows of W_Q belonging to head i
    key_heads: torch.Tensor  # (N_h, d_k, D_in)

    @classmethod
    def from_projections(cls, query_weight: torch.Tensor, key_weight: torch.Tensor, num_heads: int) -> "HeadProducts":
        """Split nn.Linear weights (N_h*d_k x D_in) into heads. Keys may read a different width than queries."""
        if query_weight.shape[0] != key_weight.shape[0]:
            raise ValueError(f"query {tuple(query_weight.shape)} and key {tuple(key_weight.shape)} differ in heads")
        total = query_weight.shape[0]
        if total % num_heads:
            raise ValueError(f"{total} projection rows do not split into {num_heads} heads")
        d_k = total // num_heads
        q = query_weight.detach().to(COMPUTE_DTYPE).reshape(num_heads, d_k, query_weight.shape[1])
        k = key_weight.detach().to(COMPUTE_DTYPE).reshape(num_heads, d_k, key_weight.shape[1])
        return cls(q, k)

    @property
    def num_heads(self) -> int:
        return self.query_heads.shape[0]

    @property
    def head_dim(self) -> int:
        return self.query_heads.shape[1]

    @property
    def input_dim(self) -> int:
        return self.query_heads.shape[2]

    @property
    def full_rank(self) -> int:
        """The rank at which the collaborative form is exact: one block of d_k per head."""
        return self.num_heads * self.head_dim

    def squared_norm(self) -> float:
        """sum_i ||T[i]||_F^2 = sum_i tr((Q_i Q_i^T)(K_i K_i^T)), from d_k x d_k Gram blocks."""
        qq = self.query_heads @ self.query_heads.transpose(1, 2)
        kk = self.key_heads @ self.key_heads.transpose(1, 2)
        return float((qq * kk).sum())

    def dense(self) -> torch.Tensor:
        """The dense N_h x D_in x D_in tensor. For tests and the reference method only."""
        return self.query_heads.transpose(1, 2) @ self.key_heads


@dataclass
class CollaborativeFactors:
    """T[i] ~= shared_query @ diag(mixing[i]) @ shared_key^T."""

    shared_query: torch.Tensor  # (D_in, R)
    shared_key: torch.Tensor  # (D_in, R)
    mixing: torch.Tensor  # (N_h, R)

    @property
    def rank(self) -> int:
        return self.mixing.shape[1]

    def dense(self) -> torch.Tensor:
        return torch.einsum("ar,hr,br->hab", self.shared_query, self.mixing, self.shared_key)

    def balanced(self) -> "CollaborativeFactors":
        """Give each of the three factors the same column norm, so low-precision storage loses least."""
        nq = self.shared_query.norm(dim=0)
        nk = self.shared_key.norm(dim=0)
        nm = self.mixing.norm(dim=0)
        scale = (nq * nk * nm).clamp_min(0) ** (1.0 / 3.0)
        safe = lambda n: torch.where(n > 0, n, torch.ones_like(n))  # noqa: E731 - zero columns stay zero
        return CollaborativeFactors(
            self.shared_query / safe(nq) * scale,
            self.shared_key / safe(nk) * scale,
            self.mixing / safe(nm) * scale,
        )


def relative_error(products: HeadProducts, factors: CollaborativeFactors) -> float:
    """||T - T_hat||_F / ||T||_F, computed without forming either tensor."""
    norm_t = products.squared_norm()
    inner = _inner_with_products(products, factors.shared_query, factors.shared_key, factors.mixing)
    norm_f = _cp_squared_norm(factors.shared_query, factors.shared_key, factors.mixing)
    err2 = max(norm_t - 2.0 * inner + norm_f, 0.0)
    return math.sqrt(err2 / norm_t) if norm_t > 0 else 0.0


def _inner_with_products(products: HeadProducts, q: torch.Tensor, k: torch.Tensor, m: torch.Tensor) -> float:
    # <T, CP> = sum_i sum_r m_ir (Q_i q_r) . (K_i k_r)
    qproj = products.query_heads @ q  # (H, d_k, R)
    kproj = products.key_heads @ k
    return float(((qproj * kproj).sum(1) * m).sum())


def _cp_squared_norm(q: torch.Tensor, k: torch.Tensor, m: torch.Tensor) -> float:
    return float(((q.T @ q) * (k.T @ k) * (m.T @ m)).sum())


# ----------------------------------------------------------------------------------------------------------
# Spectra (the PCA redundancy analysis)


@dataclass
class Spectra:
    """Singular values of the views of one attention layer that the analysis reports."""

    query_projection: torch.Tensor  # of W_Q (N_h*d_k x D_in): the concatenated heads
    key_projection: torch.Tensor
    query_unfolding: torch.Tensor  # of [T[1] ... T[N_h]] (D_in x N_h*D_in): the query-side shared subspace
    key_unfolding: torch.Tensor  # of [T[1]^T ... T[N_h]^T]
    head_unfolding: torch.Tensor  # of the head mode (N_h x D_in^2)


def _block_cholesky_factor(heads: torch.Tensor) -> torch.Tensor:
    """R_i^T with heads[i] heads[i]^T = R_i^T R_i, via QR of heads[i]^T (stable, no squaring)."""
    _, r = torch.linalg.qr(heads.transpose(1, 2), mode="reduced")  # (H, d_k, d_k)
    return r.transpose(1, 2)


def query_side_matrix(products: HeadProducts) -> torch.Tensor:
    """A D_in x (N_h d_k) matrix with the same left singular vectors and values as the query unfolding.

    [T_1 ... T_N] [T_1 ... T_N]^T = sum_i Q_i^T (K_i K_i^T) Q_i = sum_i (Q_i^T R_i^T)(Q_i^T R_i^T)^T.
    """
    r_t = _block_cholesky_factor(products.key_heads)  # (H, d_k, d_k)
    blocks = products.query_heads.transpose(1, 2) @ r_t  # (H, D_in, d_k)
    return blocks.permute(1, 0, 2).reshape(products.input_dim, -1)


def key_side_matrix(products: HeadProducts) -> torch.Tensor:
    return query_side_matrix(HeadProducts(products.key_heads, products.query_heads))


def head_gram(products: HeadProducts) -> torch.Tensor:
    """<T_i, T_j> = tr((Q_i Q_j^T)(K_j K_i^T)), an N_h x N_h matrix from d_k-sized blocks."""
    qq = torch.einsum("iad,jbd->ijab", products.query_heads, products.query_heads)
    kk = torch.einsum("iad,jbd->ijab", products.key_heads, products.key_heads)
    return torch.einsum("ijab,ijab->ij", qq, kk)


def spectra(products: HeadProducts) -> Spectra:
    total = products.full_rank
    q_proj = products.query_heads.reshape(total, -1)
    k_proj = products.key_heads.reshape(total, -1)
    head_eigs = torch.linalg.eigvalsh(head_gram(products)).flip(0).clamp_min(0).sqrt()
    return Spectra(
        query_projection=torch.linalg.svdvals(q_proj),
        key_projection=torch.linalg.svdvals(k_proj),
        query_unfolding=torch.linalg.svdvals(query_side_matrix(products)),
        key_unfolding=torch.linalg.svdvals(key_side_matrix(products)),
        head_unfolding=head_eigs,
    )


def energy_rank(singular_values: torch.Tensor, share: float) -> int:
    """Smallest number of leading dimensions whose squared singular values hold `share` of the total."""
    energy = singular_values.to(COMPUTE_DTYPE) ** 2
    total = float(energy.sum())
    if total == 0:
        return 0
    cumulative = torch.cumsum(energy, 0) / total
    # A tiny slack keeps share=1.0 from tripping over rounding in the last place.
    return int(torch.searchsorted(cumulative, torch.tensor(share - 1e-12, dtype=COMPUTE_DTYPE)).item()) + 1


# ----------------------------------------------------------------------------------------------------------
# Tucker compression


@dataclass
class TuckerSubspaces:
    """Orthonormal bases of the query- and key-side subspaces of T (HOSVD factors)."""

    query_basis: torch.Tensor  # (D_in, r_q)
    key_basis: torch.Tensor  # (D_in, r_k)
    query_singular_values: torch.Tensor
    key_singular_values: torch.Tensor


def tucker_subspaces(products: HeadProducts, rtol: float = 1e-10) -> TuckerSubspaces:
    """HOSVD of T restricted to its numerical support.

    Every CP-ALS update of the query factor lies in the column space of the query unfolding (likewise for
    keys), so ALS on the core projected onto these bases is the same iteration as ALS on T itself, at the
    cost of r instead of D_in.
    """

    def basis(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, s, _ = torch.linalg.svd(matrix, full_matrices=False)
        keep = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
        return u[:, : max(keep, 1)], s

    uq, sq = basis(query_side_matrix(products))
    uk, sk = basis(key_side_matrix(products))
    return TuckerSubspaces(uq, uk, sq, sk)


def project(products: HeadProducts, subspaces: TuckerSubspaces) -> HeadProducts:
    """The Tucker core in factored form: core[i] = (Q_i U_q)^T (K_i U_k)."""
    return HeadProducts(products.query_heads @ subspaces.query_basis, products.key_heads @ subspaces.key_basis)


# ----------------------------------------------------------------------------------------------------------
# Initialisations


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


# ----------------------------------------------------------------------------------------------------------
# CP-ALS on the factored core


def _solve(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """rhs @ gram^-1 for a symmetric PSD gram, with a whisper of ridge against exact singularity."""
    tiny = 1e-12 if gram.dtype == torch.float64 else 1e-7
    ridge = tiny * float(gram.diagonal().abs().max().clamp_min(1e-30))
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + ridge * eye, rhs.T).T


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
        "shared subspace": shared_subspace_init(core, _identity_subspaces(core), rank),
    }
    errors = {name: relative_error(core, f) for name, f in candidates.items()}
    init_name = min(errors, key=errors.get)
    factors = candidates[init_name]
    error = errors[init_name]
    history = [error]

    iterations = 0
    # At full rank the per-head start is exact; the factored error formula only resolves it to ~1e-8.
    if rank < products.full_rank and error > EXACT:
        # ALS runs in float32: its GEMMs dominate and halve in cost; the error it steers by is accurate to
        # ~1e-6 of ||T||, far below any error worth chasing. Everything around it stays float64.
        # `device` moves only the ALS (the part that scales with rank and width); one code path for all.
        als = _FactoredALS(core, ALS_DTYPE, device)
        q, k, m = (t.to(device=device, dtype=ALS_DTYPE) for t in (factors.shared_query, factors.shared_key, factors.mixing))
        power = 3.0  # extrapolation step iteration^(1/power), grown more timid after each failed jump
        for iterations in range(1, max_iterations + 1):
            q_prev, k_prev = q, k
            q, k, m, new_error = als.sweep(q, k, m)
            # Bro's line search: CP-ALS crawls through long swamps; a jump along the last step often
            # lands far ahead. The jump is kept only if it lowers the error, so the fit stays monotone.
            if iterations > 1:
                step = iterations ** (1.0 / power)
                q_jump = q + (step - 1.0) * (q - q_prev)
                k_jump = k + (step - 1.0) * (k - k_prev)
                m_jump, jump_error = als.best_mixing(q_jump, k_jump)
                if jump_error < new_error:
                    q, k, m, new_error = q_jump, k_jump, m_jump, jump_error
                else:
                    power += 1.0
            history.append(new_error)
            improvement = error - new_error
            error = new_error
            if improvement < tolerance * error or error < EXACT:
                break
        factors = CollaborativeFactors(*(t.to(device="cpu", dtype=COMPUTE_DTYPE) for t in (q, k, m)))

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
    )


class _FactoredALS:
    """CP-ALS steps on a factored core; each contraction is one GEMM over the stacked heads."""

    def __init__(self, core: HeadProducts, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.norm = core.squared_norm()
        core = HeadProducts(core.query_heads.to(device=device, dtype=dtype), core.key_heads.to(device=device, dtype=dtype))
        self.core = core
        self.query_cat = core.query_heads.reshape(-1, core.query_heads.shape[2]).T  # (r_q, N_h d_k)
        self.key_cat = core.key_heads.reshape(-1, core.key_heads.shape[2]).T

    def sweep(self, q, k, m):
        """One pass of exact least-squares updates: query factor, key factor, then mixing."""
        # MTTKRP: sum_i Q_i^T (K_i k diag(m_i)) = [Q_1^T .. Q_N^T] @ stacked (K_i k diag(m_i)).
        kproj = self.core.key_heads @ k  # (H, d_k, R)
        q = _solve((k.T @ k) * (m.T @ m), self.query_cat @ (kproj * m[:, None, :]).reshape(-1, k.shape[1]))
        qproj = self.core.query_heads @ q
        k = _solve((q.T @ q) * (m.T @ m), self.key_cat @ (qproj * m[:, None, :]).reshape(-1, q.shape[1]))
        m, error = self._mixing_and_error(q, k, qproj)
        return q, k, m, error

    def best_mixing(self, q, k):
        return self._mixing_and_error(q, k, self.core.query_heads @ q)

    def _mixing_and_error(self, q, k, qproj):
        kproj = self.core.key_heads @ k
        rhs = (qproj * kproj).sum(1)  # (H, R): diag(q^T T_i k)
        gram = (q.T @ q) * (k.T @ k)
        m = _solve(gram, rhs)
        # ||T||^2 - 2<T, CP> + ||CP||^2 from quantities already at hand.
        err2 = self.norm - 2.0 * float((rhs * m).sum()) + float(((m.T @ m) * gram).sum())
        return m, math.sqrt(max(err2, 0.0) / self.norm)


def _identity_subspaces(core: HeadProducts) -> TuckerSubspaces:
    """The core's own coordinates are already its HOSVD basis, ordered by singular value."""
    eye_q = torch.eye(core.input_dim, dtype=core.query_heads.dtype)
    eye_k = torch.eye(core.key_heads.shape[2], dtype=core.key_heads.dtype)
    empty = torch.empty(0, dtype=core.query_heads.dtype)
    return TuckerSubspaces(eye_q, eye_k, empty, empty)


def content_bias(key_weight: torch.Tensor, query_bias: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """r_i = W_K^(i)^T b_Q^(i): the only part of the query bias that changes which key wins (N_h x D_in)."""
    total, d_in = key_weight.shape
    if query_bias is None:
        return torch.zeros(num_heads, d_in, dtype=COMPUTE_DTYPE)
    k = key_weight.to(COMPUTE_DTYPE).reshape(num_heads, total // num_heads, d_in)
    b = query_bias.to(COMPUTE_DTYPE).reshape(num_heads, total // num_heads)
    return torch.einsum("hdk,hd->hk", k, b)


def fit_reference_parafac(products: HeadProducts, rank: int, seed: int = 0, tolerance: float = 1e-6) -> FitResult:
    """The paper's re-parametrization, for comparison: TensorLy CP-ALS on the dense tensor, random start.

    Cordonnier et al. run `parafac(T, rank, init="random", tol=1e-6)` (100 iterations). This builds the dense
    N_h x D_in x D_in tensor and a D_in^2 x R Khatri-Rao matrix, so it is slow and memory-hungry by design.
    """
    import tensorly as tl
    from tensorly.decomposition import parafac

    tl.set_backend("pytorch")
    dense = products.dense()
    cp, errors = parafac(dense, rank, init="random", tol=tolerance, random_state=seed, return_errors=True)
    weights, (mixing, shared_query, shared_key) = cp
    factors = CollaborativeFactors(shared_query, shared_key, mixing * weights[None, :]).balanced()
    error = relative_error(products, factors)
    return FitResult(factors, error, float("nan"), "random (reference)", len(errors), [error])


# ----------------------------------------------------------------------------------------------------------
# Calibrated fits: the error that matters is the error of the attention logits on real inputs


@dataclass
class InputMetric:
    """How one side's inputs are distributed: E[(x . v)^2] = v^T covariance v, and their mean."""

    covariance: torch.Tensor  # (D, D), symmetric PSD
    mean: torch.Tensor  # (D,)


def _square_root(covariance: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric C^(1/2) and C^(-1/2) of C + ridge * mean(diag C) * I (the ridge keeps unseen directions alive)."""
    c = covariance.to(COMPUTE_DTYPE)
    c = 0.5 * (c + c.T)
    size = c.shape[0]
    shift = ridge * float(c.diagonal().mean().clamp_min(1e-12))
    values, vectors = torch.linalg.eigh(c + shift * torch.eye(size, dtype=c.dtype))
    values = values.clamp_min(shift)
    root = (vectors * values.sqrt()) @ vectors.T
    inverse_root = (vectors * values.rsqrt()) @ vectors.T
    return root, inverse_root


def whiten(products: HeadProducts, query_metric: InputMetric, key_metric: InputMetric, ridge: float = 1e-3,
           inverses: bool = False):
    """The head products as the logits see them: (W_Q^(i) C_x^(1/2), W_K^(i) C_y^(1/2))."""
    query_root, query_inverse = _square_root(query_metric.covariance, ridge)
    key_root, key_inverse = _square_root(key_metric.covariance, ridge)
    whitened = HeadProducts(products.query_heads @ query_root, products.key_heads @ key_root)
    return (whitened, (query_inverse, key_inverse)) if inverses else whitened


def fit_calibrated(
    products: HeadProducts,
    rank: int,
    query_metric: InputMetric,
    key_metric: InputMetric,
    max_iterations: int = 500,
    tolerance: float = 1e-3,
    ridge: float = 1e-3,
    device: str | torch.device = "cpu",
) -> tuple[FitResult, torch.Tensor]:
    """Fit the collaborative factors to the logits on real inputs rather than to the raw products.

    The logit error of head i on a query x and key y is x^T (T_i - T~_i) y. Over calibration inputs its mean
    square is ||C_x^(1/2) (T_i - T~_i) C_y^(1/2)||_F^2, so fitting the whitened products
    (W_Q^(i) C_x^(1/2), W_K^(i) C_y^(1/2)) minimises it, with the same algorithm. The key covariance is taken
    around each sequence's own mean: an error that is the same for every key of a sequence only shifts the
    softmax and costs nothing, so no rank is spent on it. The query covariance is centred too, because the
    query mean's share of the error, mu_x^T (T_i - T~_i) y, is a per-key linear term that the content bias
    absorbs exactly: that correction is returned (N_h x D_in) for the caller to add to the content bias.
    """
    whitened, (query_inverse, key_inverse) = whiten(products, query_metric, key_metric, ridge, inverses=True)
    fit = fit_collaborative(whitened, rank, max_iterations, tolerance, device)
    factors = CollaborativeFactors(
        query_inverse @ fit.factors.shared_query, key_inverse @ fit.factors.shared_key, fit.factors.mixing
    ).balanced()
    # mu_x^T (T_i - T~_i) for every head, without forming T: (mu Q_i^T) K_i - ((mu Q~) * m_i) K~^T
    mean = query_metric.mean.to(COMPUTE_DTYPE)
    exact = torch.einsum("hdq,q,hdk->hk", products.query_heads, mean, products.key_heads)
    approximate = ((mean @ factors.shared_query) * factors.mixing) @ factors.shared_key.T
    correction = exact - approximate
    # The reported error is the whitened one: the share of logit energy on real inputs that is lost.
    return (
        FitResult(
            factors=factors,
            relative_error=fit.relative_error,
            initial_error=fit.initial_error,
            initialisation=fit.initialisation,
            iterations=fit.iterations,
            history=fit.history,
            query_spectrum=fit.query_spectrum,
            key_spectrum=fit.key_spectrum,
        ),
        correction,
    )
