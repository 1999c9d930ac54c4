"""Parameter, FLOP and key-cache cost of one attention layer's query/key block. Pure arithmetic.

Standard multi-head attention: W_Q, W_K are D_in x D_k with D_k = N_h d_k in total, so the block costs
2 D_in D_k (+ 2 D_k biases) whatever N_h is. The collaborative block costs 2 D_in R + N_h R (mixing) +
N_h D_in (content bias). Scores cost n^2 D_k multiply-adds originally and n^2 N_h (R + 1) collaboratively
(each head scores in R dimensions, plus the content-bias column): long sequences can cost more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

SEQUENCE_LENGTHS = (128, 512, 2048)


@dataclass(frozen=True)
class LayerShape:
    input_dim: int  # D_in
    num_heads: int  # N_h
    head_dim: int  # d_k

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class QueryKeyCost:
    rank: int | None  # None: the original layer
    parameters: int
    projection_flops_per_token: int  # multiply-adds to project one token to queries and keys
    score_flops: dict[int, int]  # sequence length -> multiply-adds for all heads' scores
    key_cache_per_token: int  # numbers cached per token for keys (decoders)

    @property
    def flops_per_token(self) -> dict[int, int]:
        """Multiply-adds of the query/key block per token at context length n: projecting the token, plus
        its scores against n keys. The number to compare: the projections shrink with R, the scores grow."""
        return {n: self.projection_flops_per_token + flops // n for n, flops in self.score_flops.items()}

    def cached(self, keys_cached: bool) -> "QueryKeyCost":
        """This cost, with no key cache for a layer whose keys are never cached (an encoder's)."""
        return self if keys_cached else replace(self, key_cache_per_token=0)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["score_flops"] = {str(k): v for k, v in self.score_flops.items()}
        data["flops_per_token"] = {str(k): v for k, v in self.flops_per_token.items()}
        return data


def original_cost(shape: LayerShape, has_bias: bool = True) -> QueryKeyCost:
    d, dk = shape.input_dim, shape.key_dim
    return QueryKeyCost(
        rank=None,
        parameters=2 * d * dk + (2 * dk if has_bias else 0),
        projection_flops_per_token=2 * d * dk,
        score_flops={n: n * n * dk for n in SEQUENCE_LENGTHS},
        key_cache_per_token=dk,
    )


def collaborative_cost(shape: LayerShape, rank: int, content_bias: bool = True) -> QueryKeyCost:
    """`content_bias` False: the layer has none (no query bias, no calibration), so neither its projection nor
    its cached numbers exist."""
    d, h = shape.input_dim, shape.num_heads
    bias = 1 if content_bias else 0
    return QueryKeyCost(
        rank=rank,
        parameters=2 * d * rank + h * rank + bias * d * h,
        # shared query and key, the mixing product, and the content-bias projection
        projection_flops_per_token=2 * d * rank + h * rank + bias * d * h,
        score_flops={n: n * n * h * (rank + bias) for n in SEQUENCE_LENGTHS},
        # one shared key of R numbers, plus one content-bias score per head
        key_cache_per_token=rank + bias * h,
    )


def candidate_ranks(shape: LayerShape) -> list[int]:
    """Full rank and its halvings down to one dimension per head."""
    ranks, rank = [], shape.key_dim
    while rank >= shape.num_heads and len(ranks) < 4:
        ranks.append(rank)
        rank //= 2
    return ranks


def break_even_length(before: QueryKeyCost, after: QueryKeyCost, shape: LayerShape) -> int | None:
    """The context length below which the collaborative query/key block costs fewer multiply-adds per token
    than the original (None: never cheaper). Projections save a fixed amount per token; each extra key in the
    context costs N_h (R + 1) - D_k more."""
    saved = before.projection_flops_per_token - after.projection_flops_per_token
    extra_per_key = shape.num_heads * (after.rank + 1) - shape.key_dim
    if saved <= 0:
        return None
    if extra_per_key <= 0:
        return 10**9  # cheaper at every length
    return saved // extra_per_key


@dataclass(frozen=True)
class SharedKeyShape:
    """A rotary attention layer's query/key block: per-head queries, grouped keys (kv_heads <= num_heads)."""

    input_dim: int
    num_heads: int
    kv_heads: int
    head_dim: int
    key_norm: bool = False  # QK-norm: the key projection stays, the shared key mixes its normalised output

    @property
    def key_width(self) -> int:
        return self.kv_heads * self.head_dim


def original_grouped_cost(shape: SharedKeyShape, has_bias: bool = False) -> QueryKeyCost:
    d, queries, keys = shape.input_dim, shape.num_heads * shape.head_dim, shape.key_width
    return QueryKeyCost(
        rank=None,
        parameters=d * (queries + keys) + ((queries + keys) if has_bias else 0),
        projection_flops_per_token=d * (queries + keys),
        score_flops={n: n * n * queries for n in SEQUENCE_LENGTHS},
        key_cache_per_token=keys,
    )


def shared_key_cost(shape: SharedKeyShape, width: int, complex_core: int | None = None, pass_core: int = 0,
                       has_bias: bool = False) -> QueryKeyCost:
    """Per-head queries kept, one shared key of `width` numbers per token, a per-head core onto it: two numbers
    per complex slot and head (`complex_core` in all; default every dimension complex, N_h x width), which cost
    two multiply-adds each per token, and head_dim per real pass-through dimension and head (`pass_core`), one."""
    d, queries = shape.input_dim, shape.num_heads * shape.head_dim
    key = d * shape.key_width + width * shape.key_width if shape.key_norm else d * width
    complex_core = shape.num_heads * width if complex_core is None else complex_core
    return QueryKeyCost(
        rank=width,
        parameters=d * queries + key + complex_core + pass_core + ((queries + width) if has_bias else 0),
        projection_flops_per_token=d * queries + key + 2 * complex_core + pass_core,
        score_flops={n: n * n * shape.num_heads * width for n in SEQUENCE_LENGTHS},
        key_cache_per_token=width,
    )


@dataclass(frozen=True, kw_only=True)
class AttentionCost(QueryKeyCost):
    """The whole attention block (query, key, value and output projections), where values change too: the
    multi-query form. Score flops count the scores and the weighted sum of values; the cache holds both."""

    value_cache_per_token: int

    def cached(self, keys_cached: bool) -> "AttentionCost":
        return self if keys_cached else replace(self, key_cache_per_token=0, value_cache_per_token=0)

    def as_dict(self) -> dict:
        data = super().as_dict()
        data["kv_cache_per_token"] = self.key_cache_per_token + self.value_cache_per_token
        return data


def attention_cost(shape: SharedKeyShape, width: int | None = None, has_bias: bool = False) -> AttentionCost:
    """The attention block of a grouped-query layer (width None: the original, G key/value heads of d), or of its
    multi-query form: one key/value head of `width`, each query head `width` wide."""
    d, heads = shape.input_dim, shape.num_heads
    head = shape.head_dim if width is None else width
    kv = shape.key_width if width is None else width
    projections = d * heads * head + 2 * d * kv + heads * head * d
    return AttentionCost(
        rank=width,
        parameters=projections + ((heads * head + 2 * kv) if has_bias else 0),
        projection_flops_per_token=projections,
        score_flops={n: 2 * n * n * heads * head for n in SEQUENCE_LENGTHS},
        key_cache_per_token=kv,
        value_cache_per_token=kv,
    )
