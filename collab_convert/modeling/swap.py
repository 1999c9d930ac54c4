"""Swapping a loaded model's attention modules for the forms its checkpoint records: each layer's record says
its form, and the form's module maker (collaborative.py, shared_key.py) turns the module into it in place, before
the weights load by name."""

from __future__ import annotations

from torch import nn

from ..format import COLLABORATIVE_FORM, SHARED_KEY_FORM, layer_form
from .attention import register_attention_function
from .collaborative import make_collaborative, strip_prefix
from .shared_key import make_shared_key

# form -> maker(module, the family's offer of that form, the layer's record)
MODULE_MAKERS = {COLLABORATIVE_FORM: make_collaborative, SHARED_KEY_FORM: make_shared_key}


def collaborate_model(model: nn.Module, family, layers: dict[str, dict], base_prefix: str | None) -> list[str]:
    """Swap every attention module recorded in `layers` (checkpoint prefix -> its config.json record) for the form
    its record names, as `family` (architectures/families.py) offers that form; the names of the modules swapped.

    Checkpoint prefixes and module names may differ by the base-model prefix (a BertModel checkpoint loaded
    into BertForSequenceClassification gains "bert."), so both sides are compared without it.
    """
    register_attention_function()
    wanted = {strip_prefix(name, base_prefix): entry for name, entry in layers.items()}
    converted = []
    for name, module in list(model.named_modules()):
        entry = wanted.get(strip_prefix(name, base_prefix))
        if entry is None or getattr(module, "is_collaborative", False):
            continue
        form = layer_form(entry)
        offer = family.offer(form)
        if offer is None or form not in MODULE_MAKERS:
            raise ValueError(f"the checkpoint records {name} in the {form} form, which {family.name} does not take")
        MODULE_MAKERS[form](module, offer, entry)
        converted.append(name)
    if len(converted) != len(wanted):
        missing = sorted(set(wanted) - {strip_prefix(n, base_prefix) for n in converted})
        raise ValueError(f"attention modules recorded in the checkpoint were not found in the model: {missing[:3]}")
    return converted
