"""Which engines run a head of a given width, and the width a KV-cache share gives: the multi-query form's one
head_dim must be a size the serving engines take.

Read in the engines' sources (docs/serving.md gives the files):
- vLLM's FlashAttention backend takes head sizes that are multiples of 8 up to 256
  (vllm/v1/attention/backends/flash_attn.py, FlashAttentionBackend.supports_head_size);
- its FlashInfer backend takes 64, 128 and 256 (vllm/v1/attention/backends/flashinfer.py,
  FlashInferBackend.get_supported_head_sizes);
- llama.cpp on the CPU and transformers take any even width.
"""

from __future__ import annotations

ENGINES = {
    "transformers": lambda width: True,
    "llama.cpp": lambda width: True,
    "vLLM FlashAttention": lambda width: width % 8 == 0 and width <= 256,
    "vLLM FlashInfer": lambda width: width in (64, 128, 256),
}
MULTIPLE = 8  # widths are chosen in steps of this (vLLM's FlashAttention), where the budget allows


def serving_width(exact: float, full: int) -> int:
    """The head width for a budget of `exact` numbers per token and layer (keys, and values alike): the largest
    multiple of 8 within it, so that the cache never exceeds the share asked for; the full width where the budget
    reaches it; below 8, the largest even width (RoPE turns pairs)."""
    if exact >= full:
        return full
    width = int(exact // MULTIPLE) * MULTIPLE
    return width if width >= MULTIPLE else max(2, int(exact) // 2 * 2)


def engines_taking(width: int) -> dict[str, bool]:
    return {name: takes(width) for name, takes in ENGINES.items()}


def engines_sentence(width: int) -> str:
    """Which engines run a head of `width`, in a line; what to do where vLLM's backends do not."""
    taking = engines_taking(width)
    shown = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in taking.items())
    if not taking["vLLM FlashAttention"]:
        shown += ("; vLLM's FlashAttention and FlashInfer backends refuse it (head sizes: multiples of 8 up to 256): "
                  "run it in llama.cpp or transformers, or give a --kv-cache that fits 256")
    return f"head size {width}: {shown}"
