"""Recovery without labels: refine collaborative factors against the original layer's attention.

The calibrated fit minimises the logit error over every (query, key) pair, but softmax only listens to the
keys that win. Layer by layer, this refines shared_query, shared_key, mixing and content_bias so that each
head's attention distribution on the calibration sequences matches the original's (mean KL divergence),
starting from the calibrated fit and keeping whichever is better. Pure torch math: no model, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..devices import HOST, Device, training_products
from .products import CollaborativeFactors

# Adam's step, as a share of each tensor's typical entry, and what one step sees. Measured on all-MiniLM-L6-v2,
# 300 Brown documents, rank 192/96, cosine on 500 held-out documents (benchmarks/calibration_documents.py):
# 4e-3 0.9944/0.9872 and 0.9797/0.9380; 1e-2 0.9944/0.9868 and 0.9802/0.9428; 3e-2 worse (0.9923 at 192).
# 4 sequences x 64 query rows per step match 8 x 32 (0.9945/0.9874, 0.9798/0.9440) at 10% less time: half
# the keys to project per step for as many attention rows.
LEARNING_RATE = 1e-2
BATCH_SEQUENCES, QUERY_ROWS = 4, 64
HELD_OUT_ROWS = 64


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


def _pad(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length, device = max(s.shape[0] for s in sequences), sequences[0].device
    padded = torch.zeros(len(sequences), length, sequences[0].shape[1], device=device)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool, device=device)
    for i, s in enumerate(sequences):
        padded[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = True
    return padded, mask


@dataclass
class _Batch:
    """Padded inputs of a few sequences and the original attention they should reproduce."""

    x: torch.Tensor  # (B, n, D) query-side inputs
    y: torch.Tensor  # (B, m, D) key-side inputs
    mask: torch.Tensor  # (B, 1, n | 1, m): 0 where a query may see a key, MASKED elsewhere
    rows: int  # real (sequence, head, query) rows
    target_p: torch.Tensor  # (B, H, n, m) the original attention; rows of padding queries are all 0
    entropy: float  # sum of target_p x log target_p: the KL's constant part

    @classmethod
    def of(cls, x, y, key_mask, x_mask, original_scores, heads: int, position_bias=None,
           head_weights=None) -> "_Batch":
        """`position_bias` (B | 1, H, n, m): a relative position bias the layer adds to its scores; it rides in the
        mask, which both the original and the collaborative scores receive. `head_weights` (H,): each head's KL
        counts that many times (calibrated.head_weights: how far its attention moves the output)."""
        mask = _mask_to_add(key_mask)
        if position_bias is not None:
            mask = mask + position_bias
        target = torch.log_softmax(original_scores + mask, dim=-1)
        target_p = target.exp() * x_mask[:, None, :, None]
        if head_weights is not None:
            target_p = target_p * head_weights.to(target_p)[None, :, None, None]
        return cls(x, y, mask, int(x_mask.sum()) * heads, target_p, float((target_p * target).sum()))


def product_in(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """left @ right computed in `dtype`, returned in float32."""
    if dtype == torch.float32:
        return left @ right
    return (left.to(dtype) @ right.to(dtype)).float()


def _collaborative_kl(parameters, batch: _Batch, scaling: float, products: torch.dtype = torch.float32) -> torch.Tensor:
    """Mean KL(original || collaborative) over the batch's real attention rows; the three matrix products run in
    `products` (devices.training_products), softmax and the KL in float32."""
    shared_query, shared_key, mixing, bias = parameters
    (size, n, _), m, (heads, rank) = batch.x.shape, batch.y.shape[1], mixing.shape
    # The packed key [y W~_K, y r_1 .. y r_N] in one product; every head scores against the one shared key in a
    # single batched product (heads x queries as rows), never a per-head copy of it: as the runtime does. The
    # scaling rides on the small factors, and the content bias joins the mask before the one full-size add.
    packed = product_in(batch.y, torch.cat([shared_key, bias.T], 1), products)  # (B, m, R + H)
    per_head_q = product_in(batch.x, shared_query, products).unsqueeze(1) * (mixing * scaling)[None, :, None, :]
    scores = product_in(per_head_q.reshape(size, heads * n, rank), packed[..., :rank].transpose(1, 2), products)
    per_key = (packed[..., rank:] * scaling).transpose(1, 2).unsqueeze(2) + batch.mask  # (B, H, 1 | n, m)
    log_q = torch.log_softmax(scores.view(size, heads, n, m) + per_key, dim=-1)
    return (batch.entropy - (batch.target_p * log_q).sum()) / batch.rows


@dataclass
class _Sequence:
    """One calibration sequence: inputs and the original layer's per-head queries and keys on them."""

    x: torch.Tensor  # (n, D)
    y: torch.Tensor  # (m, D)
    queries: torch.Tensor  # (n, H, d)
    keys: torch.Tensor  # (m, H, d)


@torch.no_grad()
def _sequences(queries, keys, query_weight, query_bias, key_weight, heads: int, device) -> list[_Sequence]:
    """Each sequence on `device` in float32 (samples wait in host memory, maybe in half precision)."""
    d_k = query_weight.shape[0] // heads
    query_weight, key_weight = (w.to(device, torch.float32) for w in (query_weight, key_weight))
    bias = query_bias.to(device, torch.float32) if query_bias is not None else 0.0
    pool = []
    for x, y in zip(queries, keys):
        same = y is x  # self-attention samples are one tensor for both sides: one float copy
        x = x.to(device, torch.float32)
        y = x if same else y.to(device, torch.float32)
        pool.append(_Sequence(x, y, (x @ query_weight.T + bias).view(-1, heads, d_k),
                              (y @ key_weight.T).view(-1, heads, d_k)))
    return pool


@torch.no_grad()
def _sampled_batch(chosen: list[_Sequence], rows: int | None, scaling: float, causal: bool, generator,
                   position_bias=None, head_weights=None) -> _Batch:
    """A few sequences with `rows` sampled query positions each (None: all of them): the unbiased minibatch of
    the attention KL."""
    device = chosen[0].x.device
    # drawn on the host generator, so a seed picks the same rows on every device
    picks = [(torch.arange(s.x.shape[0]) if rows is None else
              torch.randperm(s.x.shape[0], generator=generator)[:rows].sort().values).to(device) for s in chosen]
    bias = None
    if position_bias is not None:  # each sequence's sampled query rows of the bias, padded like the rows
        width = max(s.y.shape[0] for s in chosen)
        bias = torch.zeros(len(chosen), position_bias.shape[0], max(len(p) for p in picks), width, device=device)
        for index, p in enumerate(picks):
            bias[index, :, : len(p)] = position_bias[:, p, :width]
    x, x_mask = _pad([s.x[p] for s, p in zip(chosen, picks)])
    y, y_mask = _pad([s.y for s in chosen])
    q, _ = _pad([s.queries[p].flatten(1) for s, p in zip(chosen, picks)])
    k, _ = _pad([s.keys.flatten(1) for s in chosen])
    heads = chosen[0].queries.shape[1]
    q = q.view(*q.shape[:2], heads, -1).transpose(1, 2)
    k = k.view(*k.shape[:2], heads, -1).transpose(1, 2)
    key_mask = y_mask[:, None, None, :]
    if causal:
        positions, _ = _pad([p[:, None].float() for p in picks])  # (B, rows, 1)
        key_mask = key_mask & (torch.arange(y.shape[1], device=device)[None, None, :] <= positions)[:, None]
    return _Batch.of(x, y, key_mask, x_mask, torch.matmul(q, k.transpose(-1, -2)) * scaling, heads, bias,
                     head_weights)


@torch.no_grad()
def _original_attention(queries, keys, query_weight, query_bias, key_weight, num_heads, scaling, causal,
                        position_bias=None, rows: int | None = None, seed: int = 0, device=HOST,
                        head_weights=None) -> list[_Batch]:
    """The original attention of every sequence, in batches of 32 of similar length (padding costs little in an
    n^2 score matrix): at all query positions, or at `rows` of them per sequence, drawn once with `seed`."""
    pool = _sequences(queries, keys, query_weight, query_bias, key_weight, num_heads, device)
    order = sorted(range(len(pool)), key=lambda i: (pool[i].x.shape[0], pool[i].y.shape[0]))
    generator = torch.Generator().manual_seed(seed)
    return [_sampled_batch([pool[i] for i in order[start:start + 32]], rows, scaling, causal, generator,
                           position_bias, head_weights) for start in range(0, len(order), 32)]


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
        held = max(len(queries) // 10, 1) if len(queries) >= 10 else 0
        train = slice(0, len(queries) - held) if held else slice(None)
        check = slice(len(queries) - held, None) if held else slice(None)
        # each check sees HELD_OUT_ROWS fixed query positions of every held-out sequence, as many as a step sees:
        # the checks cost half as much on 128-token texts, and the mean KL they estimate is the same
        self.check_batches = _original_attention(queries[check], keys[check], query_weight, query_bias, key_weight,
                                                 num_heads, scaling, causal, position_bias, rows=HELD_OUT_ROWS,
                                                 device=self.device, head_weights=head_weights)
        self.check_rows = sum(b.rows for b in self.check_batches)
        self.scaling, self.causal, self.position_bias = scaling, causal, position_bias
        self.head_weights = head_weights
        # the training sequences' original queries and keys, computed when a refinement first asks: judging a
        # fit (held_out_kl) needs only the held-out slice. The closure must not hold `self`: a cycle would keep
        # every layer's held-out attention alive until the cyclic collector ran (measured: a calibrated
        # 24-layer GPT-2-medium-shaped run peaked at 468 MB above its baseline instead of 245 MB)
        self._train = lambda: _sequences(queries[train], keys[train], query_weight, query_bias, key_weight, num_heads,
                                         device)
        self.train: list[_Sequence] | None = None
        self.products = training_products(device)  # the steps' products; held-out checks stay in float32

    @torch.no_grad()
    def held_out_kl(self, parameters) -> float:
        """Mean KL(original || collaborative) per attention row of the held-out sequences; `parameters`:
        (shared_query, shared_key, mixing, content_bias)."""
        parameters = [t.to(self.device, torch.float32) for t in parameters]
        return float(sum(_collaborative_kl(parameters, b, self.scaling) * b.rows for b in self.check_batches)
                     / self.check_rows)

    def minibatch_kl(self, parameters, generator, sequences: int, rows: int) -> torch.Tensor:
        if self.train is None:
            self.train = self._train()
        chosen = [self.train[i] for i in torch.randperm(len(self.train), generator=generator)[:sequences]]
        batch = _sampled_batch(chosen, rows, self.scaling, self.causal, generator, self.position_bias,
                               self.head_weights)
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
) -> RefineResult:
    """Adam on the mean KL(original || collaborative) of every head's attention, stochastically: each step
    sees `batch_sequences` sequences and `query_rows` sampled query positions in each, so a step costs the same
    whatever the length and number of the calibration sequences. The held-out slice decides when to stop (no
    gain in five checks) and which parameters to keep; the start counts, so the result is never worse on it
    than the fit it started from. `on_check(step, loss)` hears each held-out check. `position_bias` (H, N, N):
    a relative position bias the layer adds to its scores, for sequences up to N long. `head_weights` (H,): each
    head's KL weighted (AttentionTarget). The steps run on `device`; the result comes back in host memory."""
    target = AttentionTarget(queries, keys, query_weight, query_bias, key_weight, num_heads, scaling, causal,
                             position_bias, device, head_weights)
    start = (factors.shared_query, factors.shared_key, factors.mixing, content_bias)
    parameters = [t.to(target.device, torch.float32).clone().requires_grad_(True) for t in start]
    generator = torch.Generator().manual_seed(seed)
    best, initial, best_loss, taken = adam_with_held_out(
        parameters, lambda: target.minibatch_kl(parameters, generator, batch_sequences, query_rows),
        lambda: target.held_out_kl(parameters), steps, learning_rate, on_check=on_check)
    dtype = factors.shared_query.dtype
    refined = CollaborativeFactors(*(b.to(HOST, dtype) for b in best[:3]))
    return RefineResult(refined, best[3].to(HOST, content_bias.dtype), initial, best_loss, taken)


def share_steps(losses: list[float], total: int, most: float = 3.0, least: int = 20) -> list[int]:
    """Split `total` refinement steps over layers in proportion to each one's loss before refinement: the
    steps go where the error is. No layer gets more than `most` times the even share; a layer with any loss
    gets at least `least` (one held-out check)."""
    if not losses:
        return []
    even = total / len(losses)
    weights = [max(loss, 0.0) for loss in losses]
    if sum(weights) <= 0:
        return [round(even)] * len(losses)
    shares = [min(total * w / sum(weights), most * even) for w in weights]
    spare = total - sum(shares)  # what the cap took from the largest, spread over the rest by loss
    room = [w if share < most * even else 0.0 for w, share in zip(weights, shares)]
    if spare > 0 and sum(room) > 0:
        shares = [min(share + spare * r / sum(room), most * even) for share, r in zip(shares, room)]
    return [max(int(round(share)), least if w > 0 else 0) for share, w in zip(shares, weights)]


@dataclass
class _Progress:
    best: list
    best_loss: float
    stale: int = 0


def adam_with_held_out(parameters: list[torch.Tensor], minibatch_loss, held_out_loss, steps: int,
                       learning_rate: float, check_every: int = 20, patience: int = 5, on_check=None):
    """Adam on `minibatch_loss()`, checked on `held_out_loss()` every `check_every` steps: stops after
    `patience` checks without a gain and returns (the best parameters seen, the start's held-out loss, the best,
    steps taken). The start counts as a candidate, so the result is never worse on the held-out data.

    Adam steps are scale-free per parameter: each tensor moves by `learning_rate` times its typical entry."""
    # fused: one kernel per step for all the tensors, where torch has one (CPU and CUDA); on SmolLM2's shared-key
    # layers Adam's own step was a tenth of a refinement step
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters)
    optimizer = torch.optim.Adam(
        [{"params": [p], "lr": learning_rate * float(p.detach().abs().mean().clamp_min(1e-8))} for p in parameters],
        fused=fused or None,
    )
    initial = held_out_loss()
    state, taken = _Progress([p.detach().clone() for p in parameters], initial), 0
    for taken in range(1, steps + 1):
        optimizer.zero_grad()
        minibatch_loss().backward()
        optimizer.step()
        if taken % check_every == 0 or taken == steps:
            loss = held_out_loss()
            if on_check is not None:
                on_check(taken, loss)
            if loss < state.best_loss:
                state = _Progress([p.detach().clone() for p in parameters], loss)
            else:
                state.stale += 1
                if state.stale >= patience:
                    break
    return state.best, initial, state.best_loss, taken
