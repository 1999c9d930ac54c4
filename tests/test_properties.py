"""Property tests: random small configurations across families never crash, stay exact at full rank and
finite at reduced rank, in float32 and bfloat16."""

import tempfile
from pathlib import Path

import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collab_convert import CompressOptions, compress

FAMILIES = {
    "bert": lambda h, d, n: (T.BertConfig(vocab_size=50, hidden_size=h * d, num_hidden_layers=n, num_attention_heads=h,
                                          intermediate_size=32, max_position_embeddings=32), T.AutoModel),
    "gpt2": lambda h, d, n: (T.GPT2Config(vocab_size=50, n_embd=h * d, n_layer=n, n_head=h, n_positions=32),
                             T.AutoModelForCausalLM),
    "t5": lambda h, d, n: (T.T5Config(vocab_size=50, d_model=16, d_kv=d, d_ff=32, num_layers=n, num_heads=h,
                                      decoder_start_token_id=0), T.AutoModelForSeq2SeqLM),
}


def run(model, ids):
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            out = model(input_ids=ids, decoder_input_ids=ids[:, :4])
        else:
            out = model(input_ids=ids)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 6]),
    layers=st.integers(1, 2),
    rank_share=st.floats(0.05, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_random_configurations(family, heads, head_dim, layers, rank_share, dtype, seed):
    config, auto = FAMILIES[family](heads, head_dim, layers)
    torch.manual_seed(seed)
    model = auto.from_config(config).to(dtype).eval()
    full = heads * head_dim
    rank = max(1, round(rank_share * full))
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model.save_pretrained(scratch / "model")
        compress(str(scratch / "model"), CompressOptions(rank=full, output=scratch / "full"))
        exact = auto.from_pretrained(scratch / "full", dtype=dtype).eval()
        expected, got = run(model, ids), run(exact, ids)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        assert float((expected - got).abs().max() / expected.abs().max().clamp_min(1e-6)) <= tolerance

        result = compress(str(scratch / "model"), CompressOptions(rank=rank, output=scratch / "reduced"))
        assert all(0 <= layer.relative_error <= 1 + 1e-6 for layer in result.layers)
        reduced = auto.from_pretrained(scratch / "reduced", dtype=dtype).eval()
        assert torch.isfinite(run(reduced, ids)).all()
