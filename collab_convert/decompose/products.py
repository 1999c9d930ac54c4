"""The stacked per-head products of one attention layer and their collaborative factors, in factored form.

A layer with N_h heads has per-head products T[i] = W_Q^(i)^T W_K^(i) (D_in x D_in), each of rank <= d_k.
The collaborative form approximates the stack by a rank-R CP decomposition

    T[i] ~= shared_query @ diag(mixing[i]) @ shared_key^T

Everything here works from the per-head projections (N_h x d_k x D_in); the dense N_h x D_in x D_in tensor
is never built. Pure torch: no Hugging Face, no files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The decomposition runs in float64: products of trained weights span many orders of magnitude and ALS
# normal equations square the condition number.
COMPUTE_DTYPE = torch.float64
EXACT = 1e-7  # relative errors below this are exact as far as the factored error formula can tell


@dataclass
class HeadProducts:
    """The stack T[i] = query_heads[i]^T @ key_heads[i], kept in factored form."""

    query_heads: torch.Tensor  # (N_h, d_k, D_in): rows of W_Q belonging to head i
    key_heads: torch.Tensor  # (N_h, d_k, D_in)
    # ||T||^2 and each side's per-head QR, once: a fit's starts, spectra and errors all read them
    _squared_norm: float | None = field(default=None, init=False, repr=False, compare=False)
    _head_bases: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # what every fit of this layer recomputes otherwise (analyze fits one layer at several ranks)
    _head_svd: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _row_grams: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        if self._squared_norm is None:
            qq = self.query_heads @ self.query_heads.transpose(1, 2)
            kk = self.key_heads @ self.key_heads.transpose(1, 2)
            self._squared_norm = float((qq * kk).sum())
        return self._squared_norm

    def head_bases(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Thin QR of every head's rows on one side ("query" or "key"), transposed: heads[i]^T = basis[i] @
        triangle[i], with basis (N_h, D_in, d_k) orthonormal and triangle (N_h, d_k, d_k)."""
        if side not in self._head_bases:
            heads = self.query_heads if side == "query" else self.key_heads
            self._head_bases[side] = torch.linalg.qr(heads.transpose(1, 2), mode="reduced")
        return self._head_bases[side]

    def head_svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head's product in singular form, T_i = left_i diag(s_i) right_i^T: (left (N_h, D_in, d_k),
        s (N_h, d_k), right (N_h, D_in, d_k)), from the two sides' QR and an SVD of the d_k x d_k middle."""
        if self._head_svd is None:
            qa, ra = self.head_bases("query")
            qb, rb = self.head_bases("key")
            u, s, vh = torch.linalg.svd(ra @ rb.transpose(1, 2))  # (H, d, d)
            self._head_svd = qa @ u, s, qb @ vh.transpose(1, 2)
        return self._head_svd

    def forget_head_factors(self) -> None:
        """Let go of the per-head QR and SVD (each as large as the products): the ALS reads neither, and a fit
        whose products are its own (a calibrated fit's whitened ones) need not hold them through it."""
        self._head_bases.clear()
        self._head_svd = None

    def row_gram(self, side: str, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, rows rows^T): every head's rows on one side stacked (N_h d_k x D_in) in `dtype` on `device`,
        and their Gram matrix."""
        key = (side, dtype, str(device))
        if key not in self._row_grams:
            heads = self.query_heads if side == "query" else self.key_heads
            rows = heads.reshape(-1, heads.shape[2]).to(device=device, dtype=dtype)
            self._row_grams[key] = rows, rows @ rows.T
        return self._row_grams[key]

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

    def to(self, *args, **kwargs) -> "CollaborativeFactors":
        """The three factors moved or cast alike (torch.Tensor.to's arguments)."""
        return CollaborativeFactors(*(t.to(*args, **kwargs) for t in (self.shared_query, self.shared_key,
                                                                      self.mixing)))

    def balanced(self) -> "CollaborativeFactors":
        """Give each of the three factors the same column norm, so low-precision storage loses least."""
        return self.scaled(*self.balancing_scales())

    def scaled(self, query_scale: torch.Tensor, key_scale: torch.Tensor,
               mixing_scale: torch.Tensor) -> "CollaborativeFactors":
        """Each factor's columns multiplied by its scale."""
        return CollaborativeFactors(self.shared_query * query_scale, self.shared_key * key_scale,
                                    self.mixing * mixing_scale)

    def balancing_scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What balanced() multiplies each factor's columns by (zero columns stay zero)."""
        nq = self.shared_query.norm(dim=0)
        nk = self.shared_key.norm(dim=0)
        nm = self.mixing.norm(dim=0)
        scale = (nq * nk * nm).clamp_min(0) ** (1.0 / 3.0)
        safe = lambda n: torch.where(n > 0, n, torch.ones_like(n))  # noqa: E731
        return scale / safe(nq), scale / safe(nk), scale / safe(nm)


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


def content_bias(key_weight: torch.Tensor, query_bias: torch.Tensor | None, num_heads: int) -> torch.Tensor:
    """r_i = W_K^(i)^T b_Q^(i): the only part of the query bias that changes which key wins (N_h x D_in)."""
    total, d_in = key_weight.shape
    if query_bias is None:
        return torch.zeros(num_heads, d_in, dtype=COMPUTE_DTYPE)
    k = key_weight.to(COMPUTE_DTYPE).reshape(num_heads, total // num_heads, d_in)
    b = query_bias.to(COMPUTE_DTYPE).reshape(num_heads, total // num_heads)
    return torch.einsum("hdk,hd->hk", k, b)


