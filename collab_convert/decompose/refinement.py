"""Recovery without labels: refine collaborative factors against the original layer's attention.

The calibrated fit minimises the logit error over every (query, key) pair, but softmax only listens to the
keys that win. Layer by layer, this refines shared_query, shared_key, mixing and content_bias so that each
head's attention distribution on the calibration sequences matches the original's (mean KL divergence),
starting from the calibrated fit and keeping whichever is better. Pure torch math: no model, no files.
"""

from __future__ import annotations


from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..devices import HOST, Device, training_products
from .held_out_adam import adam_with_held_out, held_out_count, starting_leaves
from .mixed_scores import mixed_scores
from .products import CollaborativeFactors

# Adam's step, as a share of each tensor's typical entry, and what one step sees. Measured on all-MiniLM-L6-v2,
# 300 Brown documents, rank 192/96, cosine on 500 held-out documents (benchmarks/calibration_documents.py):
# 4e-3 0.9944/0.9872 and 0.9797/0.9380; 1e-2 0.9944/0.9868 and 0.9802/0.9428; 3e-2 worse (0.9923 at 192).
# 4 sequences x 64 query rows per step match 8 x 32 (0.9945/0.9874, 0.9798/0.9440) at 10% less time: half
# the keys to project per step for as many attention rows.
LEARNING_RATE = 1.5e-2
BATCH_SEQUENCES, QUERY_ROWS = 4, 64
# A held-out check scores every held-out sequence at this many fixed rows, as many sequences at a time as a step
# sees: in one batch of 25 its float32 temporaries (16 MB each) outgrew the reused heap's top and were faulted in
# page by page at every check, 55 ms a check on MiniLM, a quarter of the refining stage.
HELD_OUT_ROWS, CHECK_SEQUENCES = 64, BATCH_SEQUENCES
# The attention-weighted key metric's batches, one held at a time: 4 sequences (16 ran no faster, and held 70-86 MB
# of float32 temporaries at GPT-2-medium's width: the CP fitting stage's peak on a Xeon, docs/benchmarks.md)
METRIC_SEQUENCES = 4
# Rows the packing projects at a time (_projected): at 4,096 its three float32 temporaries were 16 MB each at
# GPT-2-medium's width, kept by the steps' reused heap
PROJECTED_ROWS = 1024


# Added to the scores of keys a query may not see: finite, so that 0 x log 0 terms stay 0 without a NaN pass,
# and far enough down that exp() of it is exactly 0 in float32.
MASKED = -1e9


def _mask_to_add(key_mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(key_mask.shape, device=key_mask.device).masked_fill_(~key_mask, MASKED)


@dataclass
class RefineResult:
    factors: CollaborativeFactors
    content_bias: torch.Tensor
    kl_before: float
    kl_after: float
    steps: int


@dataclass
class _Batch:
    """Padded inputs of a few sequences and the original attention they should reproduce."""

    x: torch.Tensor  # (B, n, D) query-side inputs
    y: torch.Tensor  # (B, m, D) key-side inputs
    mask: torch.Tensor  # (B, 1 | H, n | 1, m): 0 where a query may see a key, MASKED elsewhere (+ position bias)
    rows: int  # real (sequence, head, query) rows
    target_p: torch.Tensor  # (B, H, n, m) the original attention, times each head's weight; padding rows all 0
    entropy: float  # sum of target_p x log target_p: the KL's constant part (0 where only gradients are wanted)

    @classmethod
    def of(cls, x, y, mask, row_weights, original_scores, rows: int, entropy: bool = True) -> "_Batch":
        """`row_weights` (B, H, n, 1): 0 on padding rows, else the head's weight (1 when heads weigh alike)."""
        scores = original_scores.add_(mask)  # the scores are this batch's own: added in place
        if not entropy:  # the probabilities alone (a step's target, the key metric): one pass, not two
            return cls(x, y, mask, rows, torch.softmax(scores, dim=-1).mul_(row_weights), 0.0)
        target = torch.log_softmax(scores, dim=-1)
        target_p = target.exp().mul_(row_weights)
        return cls(x, y, mask, rows, target_p, float((target_p * target).sum()))


def product_in(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """left @ right computed in `dtype`, returned in float32."""
    if dtype == torch.float32:
        return left @ right
    return (left.to(dtype) @ right.to(dtype)).float()


def _collaborative_kl(parameters, batch: _Batch, scaling: float, products: torch.dtype = torch.float32) -> torch.Tensor:
    """Mean KL(original || collaborative) over the batch's real attention rows; the three matrix products run in
    `products` (devices.training_products), softmax and the KL in float32."""
    shared_query, shared_key, mixing, bias = parameters
    rank = mixing.shape[1]
    # The packed key [y W~_K, y r_1 .. y r_N] in one product; the heads score against the one shared key, never
    # a per-head copy of it, as the runtime does, and their per-head queries are made a few heads at a time
    # (mixed_scores). The scaling rides on the small factors, and the content bias joins the mask.
    packed = product_in(batch.y, torch.cat([shared_key, bias.T], 1), products)  # (B, m, R + H)
    scores = mixed_scores(product_in(batch.x, shared_query, products), mixing * scaling, packed[..., :rank], products)
    per_key = (packed[..., rank:] * scaling).transpose(1, 2).unsqueeze(2) + batch.mask  # (B, H, 1 | n, m)
    log_q = torch.log_softmax(scores + per_key, dim=-1)
    return (batch.entropy - (batch.target_p * log_q).sum()) / batch.rows


def drawn_rows(lengths: torch.Tensor, rows: int | None, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rows` positions of each sequence of `lengths`, at most the longest's (None: all), drawn without replacement
    and sorted; which are real), both (B, count), in one draw on the host generator (a seed picks the same rows on
    every device). Positions past a sequence's end come last: the caller masks them."""
    device, longest = lengths.device, int(lengths.max())
    count = longest if rows is None else min(rows, longest)
    draw = torch.rand(len(lengths), longest, generator=generator).to(device)
    draw[torch.arange(longest, device=device) >= lengths[:, None]] = 2.0
    picks = draw.argsort(dim=1)[:, :count].sort(dim=1).values
    return picks, torch.arange(count, device=device) < lengths.clamp(max=count)[:, None]


def _packed(sequences: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every row one after another (T, D) on `device` in the sequences' own dtype, each one's first row, lengths):
    no padding, so a mix of short and long sequences costs what its rows do."""
    lengths = torch.tensor([s.shape[0] for s in sequences], device=device)
    return torch.cat([s.to(device) for s in sequences]), torch.cumsum(lengths, 0) - lengths, lengths


def _projected(inputs: torch.Tensor, weight: torch.Tensor, bias, heads: int) -> torch.Tensor:
    """(T, H, d): inputs @ weight.T + bias, computed in float32 PROJECTED_ROWS rows at a time and stored in the
    inputs' dtype (float16 samples: half the memory), or float32 where that dtype cannot hold the result."""
    out = torch.empty(inputs.shape[0], weight.shape[0], dtype=inputs.dtype, device=inputs.device)
    for start in range(0, inputs.shape[0], PROJECTED_ROWS):
        chunk = inputs[start : start + PROJECTED_ROWS].float() @ weight.T + bias
        if out.dtype != torch.float32 and not torch.isfinite(chunk.to(out.dtype)).all():
            out = out.float()
        out[start : start + PROJECTED_ROWS] = chunk
    return out.view(out.shape[0], heads, -1)


def _rows(packed: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """packed[at] for a (B, n) index: by index_select on the flattened index, as the shared-key refinement gathers
    (4-9x faster than advanced indexing on a CPU)."""
    return packed.index_select(0, at.flatten()).view(*at.shape, *packed.shape[1:])


class _Packed:
    """Sequences packed once, with the original layer's per-head queries and keys on them: a minibatch gathers
    its sequences' query rows and keys by index (padding a few sequences anew at every step was a fifth of a
    MiniLM step). Inputs stay in the samples' precision (float16), and the queries and keys are stored so too:
    half the memory of float32 copies, with the targets' scores computed in float32."""

    @torch.no_grad()
    def __init__(self, queries, keys, query_weight, query_bias, key_weight, heads: int, device,
                 every_query: bool = True):
        """`every_query`: project every query row once (a refinement draws rows again at each step); False: only
        the rows a batch draws, when it draws them (the key metric draws each sequence's rows once)."""
        self.x, self.query_starts, self.query_lengths = _packed(queries, device)
        same = all(y is x for x, y in zip(queries, keys))  # self-attention samples: one tensor for both sides
        self.y, self.key_starts, self.key_lengths = (self.x, self.query_starts, self.query_lengths) if same \
            else _packed(keys, device)
        query_weight, key_weight = (w.to(device, torch.float32) for w in (query_weight, key_weight))
        bias = query_bias.to(device, torch.float32) if query_bias is not None else 0.0
        self.heads, self.query_weight, self.query_bias = heads, query_weight, bias
        self.queries = _projected(self.x, query_weight, bias, heads) if every_query else None
        self.keys = _projected(self.y, key_weight, 0.0, heads)

    def __len__(self) -> int:
        return len(self.query_lengths)

    @torch.no_grad()
    def batch(self, chosen: torch.Tensor, rows: int | None, scaling: float, causal: bool, generator,
              position_bias=None, head_weights=None, entropy: bool = True) -> _Batch:
        """Sequences `chosen` with `rows` query positions of each drawn without replacement (None: all of them),
        in order: the unbiased minibatch of the attention KL. `position_bias` (H, N, N): a relative position bias
        the layer adds to its scores; it rides in the mask, which both the original and the collaborative scores
        receive. `head_weights` (H,): each head's KL counts that many times (calibrated.head_weights)."""
        device = self.x.device
        chosen = chosen.to(device)
        lengths, key_lengths = self.query_lengths[chosen], self.key_lengths[chosen]
        width = int(key_lengths.max())
        picks, real = drawn_rows(lengths, rows, generator)
        # rows past a sequence's end read whatever follows it (kept in bounds): masked out below
        rows_at = (self.query_starts[chosen][:, None] + picks).clamp(max=self.x.shape[0] - 1)  # (B, rows)
        keys_at = (self.key_starts[chosen][:, None] + torch.arange(width, device=device)).clamp(
            max=self.y.shape[0] - 1)  # (B, m)
        x = _rows(self.x, rows_at).float()
        if self.queries is not None:
            q = _rows(self.queries, rows_at).float().transpose(1, 2)  # (B, H, rows, d)
        else:
            q = (x @ self.query_weight.T + self.query_bias).view(*rows_at.shape, self.heads, -1).transpose(1, 2)
        k = _rows(self.keys, keys_at).float().permute(0, 2, 3, 1)  # (B, H, d, m)
        key_mask = (torch.arange(width, device=device) < key_lengths[:, None])[:, None, None, :]
        if causal:
            key_mask = key_mask & (torch.arange(width, device=device) <= picks[:, :, None])[:, None]
        mask = _mask_to_add(key_mask)
        if position_bias is not None:
            mask = mask + position_bias[:, picks, :width].transpose(0, 1)
        heads = q.shape[1]
        weights = real[:, None, :, None].float()
        if head_weights is not None:
            weights = weights * head_weights.to(weights)[None, :, None, None]
        return _Batch.of(x, _rows(self.y, keys_at).float(), mask, weights, torch.matmul(q * scaling, k),
                         int(real.sum()) * heads, entropy)


def _original_attention(queries, keys, query_weight, query_bias, key_weight, num_heads, scaling, causal,
                        position_bias=None, rows: int | None = None, seed: int = 0, device=HOST,
                        head_weights=None, sequences: int = 32, entropy: bool = True) -> Iterator[_Batch]:
    """The original attention of every sequence, in batches of `sequences` of similar length, each made as it is
    asked for: at all query positions, or at `rows` of them per sequence, drawn once with `seed`."""
    # each sequence's rows are drawn once here: only those are projected
    packed = _Packed(queries, keys, query_weight, query_bias, key_weight, num_heads, device, every_query=False)
    order = sorted(range(len(packed)), key=lambda i: (queries[i].shape[0], keys[i].shape[0]))
    generator = torch.Generator().manual_seed(seed)
    if position_bias is not None:
        position_bias = position_bias.to(device)
    for start in range(0, len(order), sequences):
        yield packed.batch(torch.tensor(order[start:start + sequences]), rows, scaling, causal, generator,
                           position_bias, head_weights, entropy)


@torch.no_grad()
def attention_key_covariance(queries, keys, query_weight, query_bias, key_weight, num_heads: int, scaling: float,
                             causal: bool = False, position_bias=None, device=HOST, seed: int = 0) -> torch.Tensor:
    """The key-side inputs' covariance as the original attention sees them, (D, D) in float64: over the heads and
    the query rows (HELD_OUT_ROWS of each sequence), the covariance of y under each row's attention p,
    sum_k p_k y_k y_k^T - (sum_k p_k y_k)(sum_k p_k y_k)^T. To second order, the attention KL of a logit error
    e_k = x^T E y_k is half its variance under p: a key that gets no attention, or the one key a saturated row
    attends to, costs nothing, so whitening the key side with it fits the logits where the softmax listens
    (docs/how-it-works.md). Summed per sequence as Y^T (diag(column sums of P) - sum_i P_i^T P_i) Y: no product per
    head and row, and a shift common to a sequence's keys drops out (the rows of that matrix sum to 0). Each
    sequence's (D, D) part is added in turn (bit for bit a batched sum), not all at once: 64 MB at D = 1024, 1 GB
    at D = 4096."""
    total, rows = None, 0
    for batch in _original_attention(queries, keys, query_weight, query_bias, key_weight, num_heads, scaling, causal,
                                     position_bias, rows=HELD_OUT_ROWS, seed=seed, device=device,
                                     sequences=METRIC_SEQUENCES, entropy=False):
        p = batch.target_p.flatten(1, 2)  # (B, H rows, m): rows past a sequence's end are all 0
        # sum_i P_i^T P_i in one product over every head's rows: no (B, H, m, m) per head (201 MB at 512 tokens)
        spread = torch.diag_embed(p.sum(1)) - p.transpose(1, 2) @ p  # (B, m, m)
        part = None  # each sequence's (D, D) added in turn (see the docstring)
        for left, y in zip(batch.y.transpose(1, 2) @ spread, batch.y):
            part = left @ y if part is None else part.addmm_(left, y)
        total = part.double() if total is None else total + part.double()
        rows += batch.rows
    return (total / max(rows, 1)).to(HOST)  # beside the other statistics, wherever the attention ran


class AttentionTarget:
    """The original layer's attention on calibration sequences: what a refinement reproduces. A held-out slice
    of the sequences (a tenth, when there are at least ten) is kept apart to judge a refinement by. Its
    batches live on `device`, where the losses are computed; the samples may wait in host memory. With
    `head_weights` (H,) the KL is each head's weighted by them (mean 1)."""

    def __init__(self, queries: list[torch.Tensor], keys: list[torch.Tensor], query_weight: torch.Tensor,
                 query_bias: torch.Tensor | None, key_weight: torch.Tensor, num_heads: int, scaling: float,
                 causal: bool = False, position_bias: torch.Tensor | None = None, device=HOST,
                 head_weights: torch.Tensor | None = None):
        self.device = device = torch.device(device)
        if position_bias is not None:
            position_bias = position_bias.to(device)
        if head_weights is not None:
            head_weights = head_weights.to(device, torch.float32)
        held = held_out_count(len(queries))
        train = slice(0, len(queries) - held) if held else slice(None)
        check = slice(len(queries) - held, None) if held else slice(None)
        # each check sees HELD_OUT_ROWS fixed query positions of every held-out sequence, as many as a step sees:
        # the checks cost half as much on 128-token texts, and the mean KL they estimate is the same
        self.check_batches = list(_original_attention(
            queries[check], keys[check], query_weight, query_bias, key_weight, num_heads, scaling, causal,
            position_bias, rows=HELD_OUT_ROWS, device=self.device, head_weights=head_weights,
            sequences=CHECK_SEQUENCES))
        self.check_rows = sum(b.rows for b in self.check_batches)
        self.scaling, self.causal, self.position_bias = scaling, causal, position_bias
        self.head_weights = head_weights
        # the training sequences' original queries and keys, computed when a refinement first asks: judging a
        # fit (held_out_kl) needs only the held-out slice. The closure must not hold `self`: a cycle would keep
        # every layer's held-out attention alive until the cyclic collector ran (measured: a calibrated
        # 24-layer GPT-2-medium-shaped run peaked at 468 MB above its baseline instead of 245 MB)
        self._train = lambda: _Packed(queries[train], keys[train], query_weight, query_bias, key_weight, num_heads,
                                       device)
        self.train: _Packed | None = None
        self.products = training_products(device)  # the steps' products; held-out checks stay in float32

    @torch.no_grad()
    def held_out_kl(self, parameters) -> float:
        """Mean KL(original || collaborative) per attention row of the held-out sequences; `parameters`:
        (shared_query, shared_key, mixing, content_bias)."""
        parameters = [t.to(self.device, torch.float32) for t in parameters]
        return float(sum(_collaborative_kl(parameters, b, self.scaling) * b.rows for b in self.check_batches)
                     / self.check_rows)

    def minibatch_kl(self, parameters, generator, sequences: int, rows: int) -> torch.Tensor:
        """The KL of a fresh minibatch, less its constant part: what a step's gradient needs."""
        if self.train is None:
            self.train = self._train()
        chosen = torch.randperm(len(self.train), generator=generator)[:sequences]
        batch = self.train.batch(chosen, rows, self.scaling, self.causal, generator, self.position_bias,
                                 self.head_weights, entropy=False)
        return _collaborative_kl(parameters, batch, self.scaling, self.products)


def refine_attention(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    query_weight: torch.Tensor,
    query_bias: torch.Tensor | None,
    key_weight: torch.Tensor,
    factors: CollaborativeFactors,
    content_bias: torch.Tensor,
    num_heads: int,
    scaling: float,
    causal: bool = False,
    steps: int = 200,
    learning_rate: float = LEARNING_RATE,
    batch_sequences: int = BATCH_SEQUENCES,
    query_rows: int = QUERY_ROWS,
    seed: int = 0,
    on_check=None,
    position_bias: torch.Tensor | None = None,
    device: Device = HOST,
    head_weights: torch.Tensor | None = None,
    consume: bool = False,
) -> RefineResult:
    """Adam on the mean KL(original || collaborative) of every head's attention, stochastically: each step
    sees `batch_sequences` sequences and `query_rows` sampled query positions in each, so a step costs the same
    whatever the length and number of the calibration sequences. The held-out slice decides when to stop (no
    gain in five checks) and which parameters to keep; the start counts, so the result is never worse on it
    than the fit it started from. `on_check(step, loss)` hears each held-out check. `position_bias` (H, N, N):
    a relative position bias the layer adds to its scores, for sequences up to N long. `head_weights` (H,): each
    head's KL weighted (AttentionTarget). The steps run on `device`; the result comes back in host memory.
    `consume`: the starting tensors (the factors, the content bias) that are already float32 on `device` become the
    parameters themselves (changed in place), not copied."""
    target = AttentionTarget(queries, keys, query_weight, query_bias, key_weight, num_heads, scaling, causal,
                             position_bias, device, head_weights)
    start = (factors.shared_query, factors.shared_key, factors.mixing, content_bias)
    parameters = starting_leaves(start, target.device, consume)
    generator = torch.Generator().manual_seed(seed)
    best, initial, best_loss, taken = adam_with_held_out(
        parameters, lambda: target.minibatch_kl(parameters, generator, batch_sequences, query_rows),
        lambda: target.held_out_kl(parameters), steps, learning_rate, on_check=on_check)
    dtype = factors.shared_query.dtype
    refined = CollaborativeFactors(*best[:3]).to(HOST, dtype)
    return RefineResult(refined, best[3].to(HOST, content_bias.dtype), initial, best_loss, taken)
