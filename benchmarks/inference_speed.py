"""Forward and decode speed of collaborative models against their originals, measured side by side.

    python benchmarks/inference_speed.py [--quick] [--parts encoder,onnx,decoder] [--prompt-length N] [--loaded]

- Encoder: all-MiniLM-L6-v2 (the embedded default), batch 32 x 128 tokens, forward pass, at ranks 192 and 96.
- ONNX: the same encoders exported (`collab-convert export`) and run in onnxruntime, against the original's
  export.
- Decoder: an OPT-125m-shaped model (12 layers, D=768, 12 heads, random weights: speed does not depend on the
  values), a 2048-token prompt, then one greedy decode step with the KV cache, at rank D/2 = 384 in the CP form
  and in the shared-key form (--form shared-key --key-cache 0.5); plus the bytes of the cache after the prompt.

The models are timed interleaved (A B C A B C ...) in one process and the medians compared, so machine noise
hits every model alike. Ratios are compressed / original: below 1 is faster. CPU threads: torch's default.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import collab_convert  # noqa: E402,F401 - registers the loader with transformers
from collab_convert import CompressOptions, compress  # noqa: E402
from collab_convert.integration.runtime import interleaved  # noqa: E402
from collab_convert.io.folders import DEFAULT_MODEL, resolve_model  # noqa: E402
from neighbour import busy_neighbour  # noqa: E402


@torch.inference_mode()
def encoder(scratch: Path, repeats: int) -> None:
    from transformers import AutoModel

    source = resolve_model(DEFAULT_MODEL)
    models = {"original": AutoModel.from_pretrained(source).eval()}
    for rank in (192, 96):
        compress(str(source), CompressOptions(rank=rank, output=scratch / f"minilm-{rank}"))
        models[f"rank {rank}"] = AutoModel.from_pretrained(scratch / f"minilm-{rank}").eval()
    ids = torch.randint(1000, 20000, (32, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    medians = interleaved({name: (lambda m=m: m(input_ids=ids, attention_mask=mask)) for name, m in models.items()},
                          repeats)
    print("Encoder: all-MiniLM-L6-v2, batch 32 x 128, forward pass (median of", repeats, "interleaved runs)")
    for name, seconds in medians.items():
        print(f"  {name:10s} {seconds * 1000:8.1f} ms   {seconds / medians['original']:.3f}x")


def opt_shaped(folder: Path) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       ffn_dim=3072, max_position_embeddings=4096, word_embed_proj_dim=768)
    OPTForCausalLM(config).eval().save_pretrained(folder)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def decoder(scratch: Path, repeats: int, prompt_length: int) -> None:
    from transformers import AutoModelForCausalLM

    opt_shaped(scratch / "opt")
    compress(str(scratch / "opt"), CompressOptions(rank=384, output=scratch / "opt-384"))
    # the shared-key form at the same key budget: per-head queries kept, R numbers per token cached, no content bias
    compress(str(scratch / "opt"), CompressOptions(form="shared-key", key_cache=0.5, output=scratch / "opt-key-384"))
    models = {"original": AutoModelForCausalLM.from_pretrained(scratch / "opt").eval(),
              "rank 384": AutoModelForCausalLM.from_pretrained(scratch / "opt-384").eval(),
              "shared key 384": AutoModelForCausalLM.from_pretrained(scratch / "opt-key-384").eval()}
    prompt = torch.randint(3, 50000, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    for model in models.values():
        model.generation_config.pad_token_id = model.config.pad_token_id
    caches, nexts = {}, {}
    for name, model in models.items():
        out = model(input_ids=prompt, use_cache=True)
        caches[name], nexts[name] = out.cache, out.logits[:, -1:].argmax(-1)

    def step(name):
        cache = caches[name]
        models[name](input_ids=nexts[name], cache=cache, use_cache=True)
        cache.crop(-1)  # back to the prompt, so every timed step is the same step

    sizes = {name: cache_bytes(cache) for name, cache in caches.items()}
    medians = interleaved({name: (lambda n=name: step(n)) for name in models}, repeats)
    print(f"Decoder: OPT-125m-shaped, {prompt_length}-token prompt, one greedy decode step with the KV cache")
    for name, seconds in medians.items():
        print(f"  {name:14s} {seconds * 1000:8.1f} ms   {seconds / medians['original']:.3f}x   "
              f"cache {sizes[name] / 2**20:7.1f} MiB   {sizes[name] / sizes['original']:.3f}x")


def onnx(scratch: Path, repeats: int) -> None:
    """The encoders exported with `collab-convert export` (ONNX), run in onnxruntime: compressed against the
    original's export, as sentence-embedding deployments run them."""
    from collab_convert.exporting import export
    from collab_convert.integration.onnx_export import onnx_session
    from collab_convert.options import ExportOptions

    source = resolve_model(DEFAULT_MODEL)
    folders = {"original": source, **{f"rank {r}": scratch / f"minilm-{r}" for r in (192, 96)}}
    sessions, checks = {}, {}
    for name, folder in folders.items():
        result = export(str(folder), ExportOptions(output=scratch / f"onnx-{name.replace(' ', '-')}"))
        sessions[name], checks[name] = onnx_session(Path(result.output) / "model.onnx"), result.max_abs_difference
    ids = torch.randint(1000, 20000, (32, 128), generator=torch.Generator().manual_seed(0)).numpy()
    feeds = {"input_ids": ids, "attention_mask": ids * 0 + 1, "token_type_ids": ids * 0}
    medians = interleaved({name: (lambda s=s: s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()}))
                           for name, s in sessions.items()}, repeats)
    print("ONNX (onnxruntime, CPU): all-MiniLM-L6-v2, batch 32 x 128 (median of", repeats, "interleaved runs)")
    for name, seconds in medians.items():
        print(f"  {name:10s} {seconds * 1000:8.1f} ms   {seconds / medians['original']:.3f}x   "
              f"onnxruntime vs PyTorch max |diff| {checks[name]:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 interleaved runs (5 decode steps), 512-token prompt")
    parser.add_argument("--parts", default="encoder,onnx,decoder", help="which comparisons to run, comma-separated")
    parser.add_argument("--loaded", action="store_true", help="a second job runs beside the measurement")
    parser.add_argument("--block-numbers", type=int, default=None,
                        help="numbers per block of CPU inference (modeling/attention.py BLOCK_NUMBERS), to compare")
    parser.add_argument("--prompt-length", type=int, default=None, help="decoder prompt (default 2048; 512 quick)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if args.block_numbers:
        from collab_convert.modeling import attention

        attention.BLOCK_NUMBERS = args.block_numbers
        print(f"Blocks of {args.block_numbers:,} numbers.")
    prompt_length = args.prompt_length or (512 if args.quick else 2048)
    with tempfile.TemporaryDirectory() as scratch, busy_neighbour(args.loaded):
        if args.loaded:
            print("A second job (one thread of float32 matrix products) runs beside the whole measurement.")
        if "encoder" in parts or "onnx" in parts:
            encoder(Path(scratch), 3 if args.quick else 9)
        if "onnx" in parts:
            onnx(Path(scratch), 3 if args.quick else 9)
        if "decoder" in parts:
            decoder(Path(scratch), 5 if args.quick else 21, prompt_length)


if __name__ == "__main__":
    main()
