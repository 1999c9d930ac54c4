"""The language-model fidelity check runs each model's body on a batch of texts at once (an offloaded model reloads
every block per batch) and its head one text at a time through the model's own forward: the figures are those of
plain per-text forward passes, whatever the model does after its body."""

import pytest
import torch

import collab_convert.integration.batches as batches
from collab_convert.integration.fidelity import _batches, compare_language_models, head_logits
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
    batched = _batches(texts, 40)
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
    passes, trims = [], []
    body = fidelity.body_output
    monkeypatch.setattr(fidelity, "body_output", lambda *args: passes.append(1) or body(*args))
    monkeypatch.setattr(cpu, "_libc", lambda: type("Libc", (), {"malloc_trim": lambda self, pad: trims.append(pad)})())
    compare_language_models(model, base, tokenizer, TEXTS)
    assert len(passes) > 2 and trims == [0] * (1 + len(passes))
