"""A shared key for rotary attention, exact under RoPE: per frequency, across key heads (pure math, torch only).

RoPE multiplies frequency pair j of every head (dimension j with j + rotary_dim/2, the rotate_half layout) by
the same e^{i m theta_j}. Written as one complex number per head and frequency, k_{g,j}, a complex-linear mix
ACROSS heads WITHIN one frequency commutes with the rotation. So the shared key holds, for each frequency j,
R_j complex dimensions  shared_j = to_shared_j [k_{1,j} .. k_{G,j}]  rotated at theta_j as usual, and query
head i in key group g reads it through its own complex coefficients (its core):

    q_{i,j} conj(k_{g,j})  ~  sum_r  (q_{i,j} core_{i,j,r}) conj(shared_{j,r}),   core_{i,j,r} = conj(from_shared_j[g, r])

exact when R_j = G for every j. Dimensions RoPE leaves alone (partial rotary) share a real subspace the same way.

Which subspace: the one that loses the least score energy. With the query energy of each group w_g and the
second moment of the keys C, the loss of dropping a direction is an eigenvalue of W^1/2 C W^1/2; that
eigenvalue is in score units, so one ordering spreads a key-cache budget across frequencies and layers.
Keys are NOT centred for rotary dimensions: a constant key offset rotates with position and does not cancel
in the softmax. Pass-through dimensions are centred: there it does cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadGeometry:
    num_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dimensions of each head that RoPE rotates (head_dim unless partial rotary)

    @property
    def frequencies(self) -> int:
        return self.rotary_dim // 2

    @property
    def pass_dim(self) -> int:
        return self.head_dim - self.rotary_dim

    @property
    def group_of_head(self) -> torch.Tensor:
        return torch.arange(self.num_heads) // (self.num_heads // self.kv_heads)

    @property
    def full_width(self) -> int:
        """Key numbers per token of the original layer: every key head's vector."""
        return self.kv_heads * self.head_dim


@dataclass
class KeyStatistics:
    """What decides the shared key of one layer: query energy and key second moments, per frequency.

    From weights alone (inputs taken as isotropic) or from activations on calibration text."""

    key_moment: torch.Tensor  # (F, G, G) complex: E[k_j k_j^H] over tokens, uncentred
    query_energy: torch.Tensor  # (F, G) real: sum over the query heads of group g of E|q_{i,j}|^2
    pass_key_covariance: torch.Tensor  # (G p, G p): covariance of the pass-through key dimensions, centred
    pass_query_moment: torch.Tensor  # (G, p, p): sum over the heads of group g of E[q_pass q_pass^T]

    def __add__(self, other: "KeyStatistics") -> "KeyStatistics":
        return KeyStatistics(*(a + b for a, b in zip(self._parts(), other._parts(), strict=True)))

    def scaled(self, factor: float) -> "KeyStatistics":
        return KeyStatistics(*(part * factor for part in self._parts()))

    def to(self, device: torch.device | str) -> "KeyStatistics":
        return KeyStatistics(*(part.to(device) for part in self._parts()))

    def _parts(self):
        return self.key_moment, self.query_energy, self.pass_key_covariance, self.pass_query_moment


def statistics_of(queries: torch.Tensor, keys: torch.Tensor, geometry: HeadGeometry,
                  lengths: list[int] | None = None) -> KeyStatistics:
    """Sums (not means) over the tokens of one sequence, or of several laid end to end (`lengths`, each one's
    token count: only the pass-through keys' covariance reads them, each sequence centred on its own mean):
    queries (n, N_h, d) and keys (n, G, d), before RoPE.

    In real arithmetic, float64: a frequency's complex key moment from the Gram matrix of its keys' real and
    imaginary parts, |q|^2 as the sum of the two squares. Complex tensors cost six times as much here (abs, the
    conjugate's copies): a sixteenth of SmolLM2's calibration pass. The calibration pass gives a batch's sequences
    in one call: hundreds of small float64 tensors per batch no longer fragment the heap it keeps, and its peak on
    a 12-layer GPT-2-medium-shaped checkpoint fell from 245 to 205-209 MB (docs/benchmarks.md, "Another CPU")."""
    half, rotary, groups = geometry.frequencies, geometry.rotary_dim, geometry.kv_heads
    # (F, 2G, n): each frequency's real parts of the G keys, then their imaginary parts, turned and widened in
    # one copy (widening, then joining the halves and turning them, were three copies of a batch's keys)
    parts = torch.empty(half, 2 * groups, keys.shape[0], dtype=torch.float64, device=keys.device)
    parts.view(half, 2, groups, keys.shape[0]).copy_(keys[..., :rotary].unflatten(-1, (2, half)).permute(3, 2, 1, 0))
    gram = parts @ parts.transpose(1, 2)  # (F, 2G, 2G)
    real, imaginary = gram[:, :groups, :groups], gram[:, groups:, groups:]
    # k k^H for k = a + ib: a a^T + b b^T + i (b a^T - a b^T)
    key_moment = torch.complex(real + imaginary, gram[:, groups:, :groups] - gram[:, :groups, groups:])
    rotated = queries[..., :rotary].double()
    squares = (rotated * rotated).sum(0)  # (N_h, rotary_dim); ** 2 took twice as long
    group_of_head = geometry.group_of_head.to(queries.device)
    energy = torch.zeros(half, groups, dtype=torch.float64, device=queries.device)
    energy.index_add_(1, group_of_head, (squares[:, :half] + squares[:, half:]).T)
    p = geometry.pass_dim
    pass_keys = keys[..., geometry.rotary_dim:].reshape(keys.shape[0], -1).double()
    centred = torch.cat([part - part.mean(0, keepdim=True) for part in pass_keys.split(lengths or keys.shape[0])])
    pass_queries = queries[..., geometry.rotary_dim:].double()  # (n, N_h, p)
    query_moment = torch.zeros(geometry.kv_heads, p, p, dtype=torch.float64, device=queries.device)
    query_moment.index_add_(0, group_of_head, torch.einsum("nhp,nhq->hpq", pass_queries, pass_queries))
    return KeyStatistics(key_moment, energy, centred.T @ centred, query_moment)


def projection_tokens(weight: torch.Tensor, bias: torch.Tensor | None, heads: int, head_dim: int) -> torch.Tensor:
    """A projection seen from unit-variance isotropic inputs: each input dimension's contribution is one token,
    and the bias one more: (D (+1), heads, d)."""
    rows = weight.double().T.reshape(weight.shape[1], heads, head_dim)
    return rows if bias is None else torch.cat([rows, bias.double().reshape(1, heads, head_dim)])


def weight_statistics(query_weight: torch.Tensor, query_bias: torch.Tensor | None, key_weight: torch.Tensor,
                      key_bias: torch.Tensor | None, geometry: HeadGeometry) -> KeyStatistics:
    """Statistics from the projections alone, for unit-variance isotropic inputs."""
    return statistics_of(projection_tokens(query_weight, query_bias, geometry.num_heads, geometry.head_dim),
                         projection_tokens(key_weight, key_bias, geometry.kv_heads, geometry.head_dim), geometry)


@dataclass
class WeightedSubspace:
    """The best rank-R shared subspace of vectors v with second moment C, errors weighted by W."""

    to_shared: torch.Tensor  # (R, n): shared = to_shared @ v
    from_shared: torch.Tensor  # (n, R): v ~ from_shared @ shared
    losses: torch.Tensor  # (n,) score energy each direction carries, largest first


def weighted_subspace(moment: torch.Tensor, weight_root: torch.Tensor, rank: int,
                      inverse_root: torch.Tensor | None = None) -> WeightedSubspace:
    """Minimise E ||W^1/2 (v - from_shared to_shared v)||^2 over rank-R maps: the top eigenvectors P of
    W^1/2 C W^1/2 give to_shared = P^H W^1/2 and from_shared = W^-1/2 P (exact at full rank). `inverse_root`:
    W^-1/2 where the caller has it (else the pseudo-inverse of the root)."""
    weighted = weight_root @ moment @ weight_root.conj().T
    weighted = (weighted + weighted.conj().T) / 2
    values, vectors = torch.linalg.eigh(weighted)
    weighted = None  # let go before the products below (and a pseudo-inverse's work matrices)
    order = torch.argsort(values, descending=True)
    values, vectors = values[order].clamp_min(0), vectors[:, order[:rank]]
    inverse_root = torch.linalg.pinv(weight_root) if inverse_root is None else inverse_root
    return WeightedSubspace(vectors.conj().T @ weight_root, inverse_root @ vectors, values)


def _floor(diagonal: torch.Tensor) -> torch.Tensor:
    """What a weight with this diagonal gets added on every direction: a millionth of its mean diagonal entry."""
    return 1e-6 * diagonal.real.mean().clamp_min(1e-30)


def _regularised(weight: torch.Tensor) -> torch.Tensor:
    """A weight with no zero direction (a silent head must not make the map singular)."""
    return weight + _floor(weight.diagonal()) * torch.eye(weight.shape[0], dtype=weight.dtype)


def _matrix_root(matrix: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((matrix + matrix.conj().T) / 2)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.conj().T


def _block_roots(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W^1/2 and W^-1/2 of the block-diagonal weight with these (G, p, p) blocks, regularised as one matrix (the
    floor a share of the mean over every block's diagonal): block by block, with no (G p)^2 pseudo-inverse. At a
    GPT-2-medium width (G p = 1024, float64, rank 512) the pass-through fit then peaked 75 MB above its start, not
    106 MB, in a third of the time."""
    floor = _floor(blocks.diagonal(dim1=-2, dim2=-1))  # the whole weight's, as _regularised's
    regularised = (blocks + blocks.transpose(-1, -2)) / 2 + floor * torch.eye(blocks.shape[-1], dtype=blocks.dtype)
    values, vectors = torch.linalg.eigh(regularised)  # every value at least the floor: W is invertible
    root = (vectors * values.clamp_min(0).sqrt()[:, None, :]) @ vectors.transpose(-1, -2)
    inverse = (vectors * values.clamp_min(floor).rsqrt()[:, None, :]) @ vectors.transpose(-1, -2)
    return torch.block_diag(*root), torch.block_diag(*inverse)


def frequency_subspace(statistics: KeyStatistics, frequency: int, rank: int) -> WeightedSubspace:
    weight = _regularised(torch.diag(statistics.query_energy[frequency]).to(torch.complex128))
    return weighted_subspace(statistics.key_moment[frequency], _matrix_root(weight), rank)


def pass_subspace(statistics: KeyStatistics, rank: int) -> WeightedSubspace:
    root, inverse_root = _block_roots(statistics.pass_query_moment)
    return weighted_subspace(statistics.pass_key_covariance, root, rank, inverse_root)


@dataclass
class KeySpectrum:
    """Score energy lost by dropping each shared direction, per frequency and for the pass-through dimensions."""

    frequency_losses: torch.Tensor  # (F, G), largest first within a frequency
    pass_losses: torch.Tensor  # (G p,)


def key_spectrum(statistics: KeyStatistics, geometry: HeadGeometry) -> KeySpectrum:
    losses = [frequency_subspace(statistics, j, 0).losses for j in range(geometry.frequencies)]
    losses = torch.stack(losses) if losses else torch.zeros(0, geometry.kv_heads, dtype=torch.float64)
    passes = pass_subspace(statistics, 0).losses if geometry.pass_dim else torch.zeros(0, dtype=torch.float64)
    return KeySpectrum(losses.float(), passes.float())


@dataclass(frozen=True)
class KeyRanks:
    """Shared dimensions of one layer: complex ones per frequency, real ones for the pass-through part."""

    frequency_ranks: tuple[int, ...]
    pass_rank: int

    @property
    def width(self) -> int:
        """Cached numbers per token: two per complex dimension, one per real one."""
        return 2 * sum(self.frequency_ranks) + self.pass_rank

    @staticmethod
    def full(geometry: HeadGeometry) -> "KeyRanks":
        return KeyRanks((geometry.kv_heads,) * geometry.frequencies, geometry.kv_heads * geometry.pass_dim)


def allocate(spectra: list[KeySpectrum], budget: int) -> list[KeyRanks]:
    """Spread `budget` cached numbers per token (over all layers) where they keep the most score energy.

    Items are shared directions; a complex one costs 2 numbers, a real one 1. Losses fall within each
    frequency, so taking items by loss per number picks a prefix of every frequency. Every layer keeps at least
    its strongest complex direction (with no rotated dimension, as under absolute positions: its strongest real
    one), so no layer's scores collapse to uniform attention."""
    items = []  # (loss per number, layer, frequency or -1 for pass-through, cost)
    counts = [[0] * s.frequency_losses.shape[0] for s in spectra]
    passes = [0] * len(spectra)
    spent = 0
    for layer, spectrum in enumerate(spectra):
        rotated = spectrum.frequency_losses.shape[0] > 0
        strongest = int(spectrum.frequency_losses[:, 0].argmax()) if rotated else None
        if rotated:
            counts[layer][strongest], spent = 1, spent + 2
        else:
            passes[layer], spent = 1, spent + 1
        for j, losses in enumerate(spectrum.frequency_losses.tolist()):
            items += [(loss / 2, layer, j, 2) for loss in losses[1 if j == strongest else 0:]]
        items += [(loss, layer, -1, 1) for loss in spectrum.pass_losses.tolist()[0 if rotated else 1:]]
    items.sort(key=lambda item: (-item[0], item[1], item[2]))  # ties broken by position: deterministic
    for _, layer, frequency, cost in items:
        if spent + cost > budget:
            continue
        spent += cost
        if frequency < 0:
            passes[layer] += 1
        else:
            counts[layer][frequency] += 1
    return [KeyRanks(tuple(c), p) for c, p in zip(counts, passes, strict=True)]


@dataclass
class SharedKeyFactors:
    """One layer's shared rotary key, in the layout the checkpoint stores.

    key_mixing maps a token's key vector (all key heads, original layout, after any key norm) to the shared key
    [real parts (W) | imaginary parts (W) | pass-through (P)], W = sum_j R_j, slots ordered by frequency.
    query_core[i] = (real, imaginary) coefficients of head i per complex slot; pass_core[i] maps head i's
    pass-through query (p) onto the P shared pass-through dimensions."""

    key_mixing: torch.Tensor  # (2W + P, G d)
    query_core: torch.Tensor  # (N_h, 2, W)
    pass_core: torch.Tensor  # (N_h, p, P)
    ranks: KeyRanks
    lost_energy: float  # share of the score energy the dropped directions carried


def slot_frequencies(ranks: KeyRanks) -> torch.Tensor:
    """The rotary frequency of every complex slot of the shared key."""
    counts = torch.tensor(ranks.frequency_ranks, dtype=torch.long)  # long even when empty (absolute positions)
    return torch.repeat_interleave(torch.arange(len(ranks.frequency_ranks)), counts)


def fit_shared_key(statistics: KeyStatistics, geometry: HeadGeometry, ranks: KeyRanks) -> SharedKeyFactors:
    g, d, half = geometry.kv_heads, geometry.head_dim, geometry.frequencies
    width = sum(ranks.frequency_ranks)
    mixing = torch.zeros(2 * width + ranks.pass_rank, g * d, dtype=torch.float64)
    core = torch.zeros(geometry.num_heads, 2, width, dtype=torch.float64)
    groups, slot, lost, total = geometry.group_of_head, 0, 0.0, 0.0
    for j, rank in enumerate(ranks.frequency_ranks):
        subspace = frequency_subspace(statistics, j, rank)
        lost, total = lost + float(subspace.losses[rank:].sum()), total + float(subspace.losses.sum())
        # Unit rows keep the shared key at the scale of the original keys (matters in bf16); the core takes
        # the scale instead, so the product is unchanged.
        norms = subspace.to_shared.abs().norm(dim=1).clamp_min(1e-30)
        to_shared, from_shared = subspace.to_shared / norms[:, None], subspace.from_shared * norms[None, :]
        columns = torch.arange(g) * d + j
        for r in range(rank):
            a, b = to_shared[r].real, to_shared[r].imag  # shared = sum_g (a + ib)(k_re + i k_im)
            mixing[slot + r, columns], mixing[slot + r, columns + half] = a, -b
            mixing[width + slot + r, columns], mixing[width + slot + r, columns + half] = b, a
            coefficient = from_shared[groups, r].conj()
            core[:, 0, slot + r], core[:, 1, slot + r] = coefficient.real, coefficient.imag
        slot += rank
    pass_core = torch.zeros(geometry.num_heads, geometry.pass_dim, ranks.pass_rank, dtype=torch.float64)
    if geometry.pass_dim:
        subspace = pass_subspace(statistics, ranks.pass_rank)
        lost, total = lost + float(subspace.losses[ranks.pass_rank:].sum()), total + float(subspace.losses.sum())
        pass_columns = (torch.arange(g)[:, None] * d + geometry.rotary_dim + torch.arange(geometry.pass_dim)).flatten()
        mixing[2 * width:, pass_columns] = subspace.to_shared.real
        blocks = subspace.from_shared.real.reshape(g, geometry.pass_dim, ranks.pass_rank)
        pass_core = blocks[groups]
    return SharedKeyFactors(mixing, core, pass_core, ranks, lost / total if total > 0 else 0.0)


def shared_scores(queries: torch.Tensor, keys: torch.Tensor, factors: SharedKeyFactors, geometry: HeadGeometry,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference scores (N_h, n, n) of the shared form for one sequence (queries (n, N_h, d), keys (n, G, d)),
    cos/sin (n, rotary_dim) as transformers makes them; used by tests and the refinement."""
    from .rotary_ops import query_in_shared_basis, rotate_shared_key, rotate_half_dims

    rotated = rotate_half_dims(queries.transpose(0, 1), cos, sin, geometry.rotary_dim)
    shared_query = query_in_shared_basis(rotated, factors.query_core, factors.pass_core,
                                         slot_frequencies(factors.ranks), geometry.rotary_dim)
    shared_key = keys.reshape(keys.shape[0], -1).to(factors.key_mixing.dtype) @ factors.key_mixing.T
    shared_key = rotate_shared_key(shared_key, cos, sin, slot_frequencies(factors.ranks))
    return shared_query @ shared_key.T
