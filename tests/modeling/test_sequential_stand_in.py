"""Sequential calibration runs block k of the ORIGINAL model with layer k already compressed: the stand-in
(modeling/rotary.SharedKeyStandIn) must answer exactly as the compressed module in the written checkpoint
does, for every layout of queries and keys (biases, QK-norms, fused projections, partial rotary)."""

import json

import pytest
import torch

from collab_convert import CompressOptions, compress
from collab_convert.architectures.source import open_model
from collab_convert.decompose.rotary import KeyRanks, fit_shared_key
from collab_convert.format import HeadCounts
from collab_convert.integration.loading import load_model
from collab_convert.modeling.rotary import SharedKeyStandIn
from collab_convert.rotary_stages import geometry_of, weight_statistics
from fixtures.models import ROTARY_CASES, build_rotary

CASES = ["llama", "qwen2", "qwen3", "olmo2", "phi3", "phi", "gpt_neox"]


@pytest.mark.parametrize("case", [c for c in ROTARY_CASES if c.name in CASES], ids=lambda c: c.name)
def test_the_stand_in_answers_as_the_compressed_module(case, tmp_path):
    original = build_rotary(case, tmp_path / "in")
    compress(str(tmp_path / "in"), CompressOptions(key_cache=0.5, output=tmp_path / "out"))
    compressed = load_model(tmp_path / "out").eval()
    entries = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["layers"]
    source = open_model(str(tmp_path / "in"))
    hidden = torch.randn(2, 20, original.config.hidden_size, generator=torch.Generator().manual_seed(4))
    by_name, compressed_modules = dict(original.named_modules()), dict(compressed.named_modules())
    rotary_emb = next(module for name, module in by_name.items() if name.endswith("rotary_emb"))
    position_embeddings = rotary_emb(hidden, torch.arange(20)[None].expand(2, -1))
    for layer in source.layers:
        name = layer.prefix  # the checkpoint's names are the module names of the causal-LM class
        ranks = KeyRanks(tuple(entries[layer.prefix]["frequency_ranks"]), entries[layer.prefix]["pass_rank"])
        factors = fit_shared_key(weight_statistics(source, layer), geometry_of(layer), ranks)
        heads = HeadCounts(layer.shape.num_heads, layer.kv_heads)
        with torch.no_grad():
            expected, _ = compressed_modules[name](hidden, position_embeddings=position_embeddings,
                                                   attention_mask=None)
            with SharedKeyStandIn(by_name[name], source.family.layout, heads, factors.key_mixing,
                                  factors.query_core, factors.pass_core, ranks.frequency_ranks, layer.rotary_dim):
                stood_in, _ = by_name[name](hidden, position_embeddings=position_embeddings, attention_mask=None)
        assert float((stood_in - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
        assert "forward" not in vars(by_name[name])  # the context ended: the module's own forward again
    source.close()
