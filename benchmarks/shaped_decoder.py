"""A 0.5B-class grouped-query decoder for timing runs, where none ships on PyPI: Qwen2-0.5B's shape (24 layers,
896 wide, 14 query heads in 2 key/value groups of 64, a 4,864-wide SwiGLU, RoPE theta 1e6, tied embeddings)
with SmolLM2's tokenizer and 49,152-word vocabulary, so 0.41B parameters, stored in bfloat16 as Qwen2 ships.

The weights are random (seed 0), drawn so that attention is peaked as a trained model's is (query and key
projections at 0.05 rather than the usual 0.02, which leaves every score near zero and attention uniform): the
costs of calibration, refinement and the fidelity check are then of the right shape, while the figures the run
reports (KL, top-1) say nothing of a trained model.

    python benchmarks/shaped_decoder.py [FOLDER]     (default: data/qwen2-0.5b-shape)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DEFAULT_FOLDER = Path(__file__).resolve().parent.parent / "data" / "qwen2-0.5b-shape"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")


def build(folder: Path = DEFAULT_FOLDER) -> Path:
    """The checkpoint in `folder`, built once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from collab_convert.io.folders import resolve_model

    tokenizer_folder = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    config = Qwen2Config(vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.normal_(0.0, 0.05)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, partial / name)
    partial.replace(folder)
    return folder


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER))
