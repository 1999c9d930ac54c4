"""The language-model fidelity check runs each model's body on a batch of texts at once (an offloaded model reloads
every block per batch) and its head one text at a time through the model's own forward: the figures are those of
plain per-text forward passes, whatever the model does after its body."""

import pytest
import torch

import collab_convert.integration.batches as batches
from collab_convert.integration.batches import _consecutive
from collab_convert.integration.fidelity import compare_language_models, head_logits
from fixtures.models import ROTARY_CASES, save_tiny_tokenizer

TEXTS = [f"the {w} was on the {v} and it is {w} again" for w in "abcd" for v in "ij"] + ["it", "the a", "a " * 20]


def case(name: str):
    return next(c for c in ROTARY_CASES if c.name == name)


def twin_models(config_of, model_class: str):
    """(model, base): one architecture with two random initialisations, so every figure is far from perfect."""
    import transformers

    made = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        made.append(getattr(transformers, model_class)(config_of()).eval())
    return made


MODELS = {
    "llama": lambda: twin_models(case("llama").config, "LlamaForCausalLM"),
    # the head's output is soft-capped (tanh) by the model's forward, after its lm_head
    "gemma2 with soft-capped logits": lambda: twin_models(
        lambda: case("gemma2").config().__class__(**{**case("gemma2").config().to_dict(),
                                                     "final_logit_softcapping": 2.0}), "Gemma2ForCausalLM"),
    "gpt2": lambda: twin_models(lambda: __import__("transformers").GPT2Config(
        vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
        "GPT2LMHeadModel"),
}


@torch.no_grad()
def per_text_figures(model, base, tokenizer, texts):
    """(top-1 agreement, mean KL(base || model), embeddings of each) from whole forward passes, one text at a time."""
    agree, total, kl, pooled = 0, 0, 0.0, {"model": [], "base": []}
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        logits = {}
        for name, which in (("base", base), ("model", model)):
            logits[name] = which(ids).logits[0].float()
            states = getattr(which, which.base_model_prefix)(input_ids=ids).last_hidden_state[0]
            pooled[name].append(torch.nn.functional.normalize(states.float().mean(0), dim=-1))
        p, q = torch.log_softmax(logits["base"], -1), torch.log_softmax(logits["model"], -1)
        agree, total = agree + int((p.argmax(-1) == q.argmax(-1)).sum()), total + p.shape[0]
        kl += float((p.exp() * (p - q)).sum())
    cosines = torch.nn.functional.cosine_similarity(torch.stack(pooled["base"]).double(),
                                                    torch.stack(pooled["model"]).double(), dim=-1)
    return agree / total, kl / total, cosines


@pytest.mark.parametrize("name", list(MODELS))
def test_batched_bodies_and_per_text_heads_give_the_figures_of_whole_forward_passes(name, tmp_path, monkeypatch):
    model, base = MODELS[name]()
    model.save_pretrained(tmp_path)  # for the tokenizer's vocabulary size
    save_tiny_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    # a few texts to a batch, so batches of different lengths and padding are crossed
    monkeypatch.setattr(batches, "batch_tokens", lambda width: 48)
    found = compare_language_models(model, base, tokenizer, TEXTS)
    top1, kl, cosines = per_text_figures(model, base, tokenizer, TEXTS)
    assert found.top1_agreement == pytest.approx(top1)
    assert found.kl_mean == pytest.approx(kl, rel=1e-4) and found.kl_mean > 1e-3
    assert found.cosine.mean == pytest.approx(float(cosines.mean()), abs=1e-5)
    assert [i for i, _ in found.cosine.worst] == torch.argsort(cosines)[:5].tolist()


def test_offloaded_models_give_the_figures_of_models_held_in_memory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_convert.integration.layerwise import load_offloaded

    model, base = MODELS["llama"]()
    for folder, which in (("model", model), ("base", base)):
        which.save_pretrained(tmp_path / folder)
    save_tiny_tokenizer(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    in_memory = compare_language_models(model, base, tokenizer, TEXTS)
    offloaded = compare_language_models(load_offloaded(tmp_path / "model", AutoModelForCausalLM),
                                        load_offloaded(tmp_path / "base", AutoModelForCausalLM), tokenizer, TEXTS)
    assert offloaded.top1_agreement == in_memory.top1_agreement
    assert offloaded.kl_mean == pytest.approx(in_memory.kl_mean, rel=1e-5)
    assert offloaded.cosine.mean == pytest.approx(in_memory.cosine.mean, abs=1e-6)


def test_texts_are_batched_in_order_within_the_padded_token_budget():
    texts = [[1] * 10, [1] * 10, [1] * 30, [1] * 5, [1] * 5, [1] * 5, [1] * 50]
    batched = _consecutive(texts, 40)
    assert [len(ids) for batch in batched for ids in batch] == [len(ids) for ids in texts]
    assert [[len(ids) for ids in batch] for batch in batched] == [[10, 10], [30], [5, 5, 5], [50]]
    assert all(len(batch) * max(map(len, batch)) <= 40 for batch in batched if len(batch) > 1)


def test_a_model_whose_forward_does_not_read_its_body_is_refused_not_mismeasured():
    class Elsewhere(torch.nn.Module):
        """Logits that do not come from the body's states."""

        base_model_prefix = "body"

        def __init__(self):
            super().__init__()
            self.body = torch.nn.Identity()

        def forward(self, input_ids, attention_mask=None):
            return type("Output", (), {"logits": torch.zeros(*input_ids.shape, 7)})()

    with pytest.raises(RuntimeError, match="does not compute its logits from its body"):
        head_logits(Elsewhere(), (torch.zeros(1, 3, 4),), torch.zeros(1, 3, dtype=torch.long))


def test_each_pass_hands_its_freed_heap_back(tmp_path, monkeypatch):
    """Before the first pass and after each model's pass on a batch, glibc trims its heap: an offloaded pass frees
    many small blocks between long-lived ones, and untrimmed they piled up pass after pass (cpu.return_freed_heap)."""
    from transformers import AutoTokenizer

    from collab_convert import cpu
    from collab_convert.integration import fidelity

    model, base = MODELS["llama"]()
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    monkeypatch.setattr(batches, "batch_tokens", lambda width: 48)
    from fixtures.libc import RecordingLibc

    passes, libc = [], RecordingLibc()
    body = fidelity.body_output
    monkeypatch.setattr(fidelity, "body_output", lambda *args: passes.append(1) or body(*args))
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    compare_language_models(model, base, tokenizer, TEXTS)
    # up to the heads' heap (trimmed on its way in too): one trim before the passes, one after each
    bodies = libc.calls[: libc.calls.index(("mallopt", cpu.HEAP_THRESHOLD)) - 1]
    assert len(passes) > 2 and bodies == [("trim", 0)] * (1 + len(passes))


def attention_prefixes(model) -> list[str]:
    return [name for name, module in model.named_modules() if type(module).__name__.endswith("Attention")]


def saved_twins(name: str, folder, monkeypatch):
    """(the base, its tokenizer): the two models of MODELS[name] saved under `folder` ("model", "base"), with a
    few texts to a batch of bodies."""
    from transformers import AutoTokenizer

    model, base = MODELS[name]()
    for place, which in (("model", model), ("base", base)):
        which.save_pretrained(folder / place)
    save_tiny_tokenizer(folder / "base")
    monkeypatch.setattr(batches, "batch_tokens", lambda width: 48)  # several batches
    return base, AutoTokenizer.from_pretrained(folder / "base")


def offloaded_check(folder, tokenizer, monkeypatch, prefixes, kept=None):
    """(the figures, the blocks loaded) of the check on the offloaded models saved under `folder`."""
    from accelerate.hooks import AlignDevicesHook
    from transformers import AutoModelForCausalLM

    from collab_convert.integration.layerwise import load_offloaded

    loads, onload = [], AlignDevicesHook._onload_weights
    with monkeypatch.context() as patched:
        patched.setattr(AlignDevicesHook, "_onload_weights",
                        lambda hook, module: loads.append(type(module).__name__) or onload(hook, module))
        found = compare_language_models(load_offloaded(folder / "model", AutoModelForCausalLM),
                                        load_offloaded(folder / "base", AutoModelForCausalLM), tokenizer, TEXTS,
                                        prefixes=prefixes, kept=kept)
    return found, [load for load in loads if load.endswith(("Block", "DecoderLayer"))]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_offloaded_bodies_run_a_block_at_a_time_load_each_block_once_and_give_the_same_figures(
        name, tmp_path, monkeypatch):
    """Where the models are one stack of blocks, each block runs on every batch with its weights loaded once
    (a pass per batch loaded every block once per batch), and the body's own forward then runs around blocks
    standing in: the figures are those of the passes per batch."""
    base, tokenizer = saved_twins(name, tmp_path, monkeypatch)
    prefixes = attention_prefixes(base)

    per_batch, per_batch_loads = offloaded_check(tmp_path, tokenizer, monkeypatch, None)
    by_block, by_block_loads = offloaded_check(tmp_path, tokenizer, monkeypatch, prefixes)
    assert len(per_batch_loads) > 2 * len(prefixes)  # every block, once per batch of each model
    assert len(by_block_loads) == 2 * len(prefixes)  # every block, once for each model
    assert by_block.top1_agreement == per_batch.top1_agreement
    assert by_block.kl_mean == pytest.approx(per_batch.kl_mean, rel=1e-6) and by_block.kl_mean > 1e-3
    assert by_block.cosine.mean == pytest.approx(per_batch.cosine.mean, abs=1e-7)
    assert by_block.cosine.worst == pytest.approx(per_batch.cosine.worst)


def test_the_blocks_stand_in_only_for_the_pass_that_needs_them():
    """After a check by blocks, the model's own blocks are back in place."""
    from collab_convert.integration.bodies import standing_in

    model, _ = MODELS["llama"]()
    layers = list(model.model.layers)
    with standing_in(model.model, ["layers.0", "layers.1"], torch.zeros(1, 2, 3), as_tuple=False):
        assert [type(block).__name__ for block in model.model.layers] == ["_Passed", "_Passed"]
    assert list(model.model.layers) == layers


def test_the_heads_run_on_one_bounded_heap(tmp_path, monkeypatch):
    """Text after text, the logits and distributions are the same few sizes: they come from one heap, trimmed past
    its bound. The heads' weights load for each text, one head at a time (held for all the texts, two heads of a
    large vocabulary would weigh more than the check)."""
    from accelerate.hooks import AlignDevicesHook
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_convert import cpu
    from collab_convert.integration.layerwise import load_offloaded
    from fixtures.libc import RecordingLibc

    model, base = twin_models(lambda: __import__("transformers").GPT2Config(  # an untied head: its own weights
        vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False), "GPT2LMHeadModel")
    for folder, which in (("model", model), ("base", base)):
        which.save_pretrained(tmp_path / folder)
    save_tiny_tokenizer(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    libc, loads = RecordingLibc(), []
    monkeypatch.setattr(cpu, "glibc", lambda: libc)
    onload = AlignDevicesHook._onload_weights
    monkeypatch.setattr(AlignDevicesHook, "_onload_weights",
                        lambda hook, module: loads.append(type(module).__name__) or onload(hook, module))
    compare_language_models(load_offloaded(tmp_path / "model", AutoModelForCausalLM),
                            load_offloaded(tmp_path / "base", AutoModelForCausalLM), tokenizer, TEXTS)
    assert loads.count("Linear") == 2 * len(TEXTS)  # each model's head, once a text
    assert ("mallopt", cpu.HEAP_THRESHOLD) in libc.calls
    assert [call for call in libc.calls if call[0] == "mallopt"][-1] == ("mallopt", cpu.MMAP_THRESHOLD)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_states_the_calibration_pass_kept_spare_the_check_the_originals_blocks(name, tmp_path, monkeypatch):
    """The calibration pass runs the held-out texts through each of the original's blocks as it holds them
    (unobserved, after its own batches) and keeps what the last block gives: the check then loads and runs the
    compressed model's blocks alone, and its figures are those of running both."""
    from collab_convert.architectures.source import open_model
    from collab_convert.format import HeadCounts
    from collab_convert.forms.shared_key.statistics import geometry_of
    from collab_convert.integration.capture import collect_statistics
    from collab_convert.integration.shared_key_capture import collect_shared_key_statistics
    from collab_convert.integration.model_runs import KeptStates, ParkedStates, keeping_states

    _, tokenizer = saved_twins(name, tmp_path, monkeypatch)
    source = open_model(str(tmp_path / "base"))
    try:
        prefixes = [layer.prefix for layer in source.layers]
        with keeping_states(KeptStates(TEXTS, 128)) as kept:  # the capture of the model's own form
            if source.form == "shared-key":
                layers = {layer.prefix: (geometry_of(layer), HeadCounts(layer.shape.num_heads, layer.kv_heads),
                                         layer.causal) for layer in source.layers}
                collect_shared_key_statistics(source.folder, source.layout, source.family.position_bias, layers,
                                              TEXTS[:6], max_length=24, scratch=tmp_path / "scratch")
            else:
                collect_statistics(source.folder, source.layout, source.family.position_bias, prefixes, TEXTS[:6],
                                   max_length=24, scratch=tmp_path / "scratch")
    finally:
        source.close()
    assert kept.states is not None and len(kept.states) > 1
    # between the pass and the check the states wait in the scratch folder, not in memory
    assert isinstance(kept.states, ParkedStates) and kept.states.path.parent == tmp_path / "scratch"
    kept_file = kept.states.path

    both, both_loads = offloaded_check(tmp_path, tokenizer, monkeypatch, prefixes)
    reused, reused_loads = offloaded_check(tmp_path, tokenizer, monkeypatch, prefixes, kept)
    assert len(both_loads) == 2 * len(prefixes) and len(reused_loads) == len(prefixes)
    assert reused.top1_agreement == both.top1_agreement
    assert reused.kl_mean == pytest.approx(both.kl_mean, rel=1e-6) and reused.kl_mean > 1e-3
    assert reused.cosine.mean == pytest.approx(both.cosine.mean, abs=1e-7)
    assert reused.cosine.worst == pytest.approx(both.cosine.worst)
    # states kept for other texts, or another cut, are not taken for these
    other = offloaded_check(tmp_path, tokenizer, monkeypatch, prefixes,
                            KeptStates(TEXTS[1:], 128, kept.states, kept.as_tuple, kept.stack))[1]
    assert len(other) == 2 * len(prefixes)
    # fetched back into memory before the scratch folder goes, they serve the check as before
    kept.fetch()
    kept_file.unlink()
    assert isinstance(kept.states, list)
    fetched = offloaded_check(tmp_path, tokenizer, monkeypatch, prefixes, kept)[0]
    assert fetched.kl_mean == reused.kl_mean and fetched.top1_agreement == reused.top1_agreement
