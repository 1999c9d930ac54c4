"""How close a compressed model stays to its base on real text: embedding cosines."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@torch.no_grad()
def sentence_embeddings(model, tokenizer, texts: list[str], batch_size: int = 64, max_length: int = 128):
    """Mean-pooled final hidden states over real tokens (the sentence-transformers recipe), L2-normalised."""
    model.eval()
    chunks = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        chunks.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(chunks)


@dataclass
class CosineStats:
    mean: float
    p01: float  # 1st percentile: the worst sentences
    minimum: float
    count: int


def cosine_stats(reference: torch.Tensor, candidate: torch.Tensor) -> CosineStats:
    cos = torch.nn.functional.cosine_similarity(reference.double(), candidate.double(), dim=-1)
    return CosineStats(
        mean=float(cos.mean()),
        p01=float(torch.quantile(cos, 0.01)),
        minimum=float(cos.min()),
        count=int(cos.numel()),
    )
