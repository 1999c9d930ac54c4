"""The shared-key capture computes each attention module's queries, keys and values once: its hook's projections
are handed back to the module's own forward, which then returns what it returns without the hook."""

import pytest
import torch

from collab_convert.architectures.source import open_model
from collab_convert.format import HeadCounts
from collab_convert.forms.shared_key.statistics import geometry_of
from collab_convert.integration.batches import CurrentBatch, SeenEverything
from collab_convert.integration.shared_key_capture import SharedKeyObserver

from fixtures.models import ROTARY_CASES, build_family, build_rotary, family_case

# llama: separate projections; qwen3: QK-norm between projection and RoPE; gpt2: one fused Conv1D for q, k and v
CASES = ["llama", "qwen3", "phi", "gpt2-shared-key"]


def _model_and_observer(name, folder, keep_samples=2):
    if name.endswith("-shared-key"):
        model = build_family(family_case(name.removesuffix("-shared-key")), folder)
    else:
        model = build_rotary(next(case for case in ROTARY_CASES if case.name == name), folder)
    source = open_model(str(folder), "shared-key")
    try:
        layers = {layer.prefix: (geometry_of(layer), HeadCounts(layer.shape.num_heads, layer.kv_heads), layer.causal)
                  for layer in source.layers}
        observer = SharedKeyObserver(source.layout, source.family.position_bias, layers, keep_samples,
                                     CurrentBatch(), value_moments=True)
    finally:
        source.close()
    return model.eval(), observer, list(layers)


def _count_projection_products(monkeypatch) -> dict:
    """Products each projection module computes, by module."""
    from transformers.pytorch_utils import Conv1D

    counts = {}
    for kind in (torch.nn.Linear, Conv1D):
        def counted(module, hidden, _forward=kind.forward):
            counts[module] = counts.get(module, 0) + 1
            return _forward(module, hidden)

        monkeypatch.setattr(kind, "forward", counted)
    return counts


@pytest.mark.parametrize("name", CASES)
def test_the_hooked_forward_computes_each_projection_once_and_returns_the_same(name, tmp_path, monkeypatch):
    model, observer, prefixes = _model_and_observer(name, tmp_path / name)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        expected = model(input_ids=input_ids)[0]
        counts = _count_projection_products(monkeypatch)
        handles = observer.attach(model, prefixes)
        observer.current.lengths = [11, 7]
        try:
            found = model(input_ids=input_ids)[0]
        finally:
            for handle in handles:
                handle.remove()
    assert torch.equal(found, expected)
    attention = [module for name_, module in model.named_modules() if name_.endswith(("self_attn", "attn"))]
    projections = [child for module in attention for child in module.children() if child in counts]
    assert projections, "no projection of an attention module ran"
    assert all(counts[child] == 1 for child in projections), {type(c).__name__: counts[c] for c in projections}
    assert all("forward" not in child.__dict__ for child in projections)  # every projection is itself again
    assert all(observer.found[prefix].statistics is not None for prefix in prefixes)


def test_a_pass_stopped_in_the_hook_leaves_no_projection_standing_in(tmp_path):
    """The last block's pass stops at its last observation (SeenEverything, raised by the hook): its kept
    projections are let go all the same, and an accelerate-style `forward` attribute is restored as it was."""
    model, observer, prefixes = _model_and_observer("llama", tmp_path / "llama")
    attention = next(module for name, module in model.named_modules() if name.endswith("self_attn"))
    own = attention.q_proj.forward
    attention.q_proj.forward = own  # an instance attribute, as accelerate's hooks leave one
    observer.current.observations = 1  # the first observation is the last one wanted
    handles = observer.attach(model, prefixes[:1])
    observer.current.lengths = [9]
    try:
        with torch.no_grad(), pytest.raises(SeenEverything):
            model(input_ids=torch.randint(3, 90, (1, 9)))
    finally:
        for handle in handles:
            handle.remove()
    assert attention.q_proj.__dict__["forward"] is own
    assert all("forward" not in child.__dict__ for child in (attention.k_proj, attention.v_proj, attention.o_proj))
    assert observer.replay.kept == {}
