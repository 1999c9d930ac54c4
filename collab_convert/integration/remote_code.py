"""The modeling code a guarded checkpoint carries, so that transformers alone refuses it loudly or, where the user
opts in, loads it right.

A guarded checkpoint (the CP form; the shared-key form where it replaces a projection) is no stock architecture,
so it ships the way the ecosystem ships custom ones: it declares a model_type of its own (format.MODEL_TYPE_PREFIX),
the code travels with it (checkpoint_code.py, copied as `collaborative_modeling.py`) and config.json's `auto_map`
names a class of it for AutoConfig and for each Auto class that loads the model. Without `trust_remote_code=True`
transformers refuses the unknown model_type and says to pass that flag; no flag makes it build its own class around
the collaborative tensors. With it, the code runs the CP form of the families it knows, and refuses the others
with a line that says to install collab-convert. Where collab-convert is installed its own loader takes over, and
no flag is needed. `architectures` stays the original's.
"""

from __future__ import annotations

from pathlib import Path

from ..format import CHECKPOINT_CODE, guarded_model_type

_TEMPLATE = Path(__file__).with_name("checkpoint_code.py")


def _auto_classes(model_type: str, architecture: str) -> list[str]:
    """The Auto classes that build `architecture` for `model_type` (AutoModel for BertModel, AutoModelForMaskedLM
    for BertForMaskedLM, ...), as transformers' own mappings say."""
    from transformers.models.auto import modeling_auto

    found = []
    for name in dir(modeling_auto):
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        names = getattr(mapping, "_model_mapping", None)
        if name.startswith("AutoModel") and isinstance(names, dict):
            classes = names.get(model_type)
            if architecture == classes or (isinstance(classes, (tuple, list)) and architecture in classes):
                found.append(name)
    return sorted(found)


def write_checkpoint_code(folder: Path, config: dict) -> dict[str, str]:
    """Write collaborative_modeling.py for a guarded checkpoint of the model `config` describes (the original's
    config.json); returns config.json's `auto_map` for it: its config class, and its model classes for the Auto
    classes transformers' mappings name. Empty, and nothing written, where transformers knows no config class for
    the model_type (the checkpoint then keeps its load guards alone)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = config.get("model_type", "")
    config_class = CONFIG_MAPPING_NAMES.get(model_type)
    if not config_class or not hasattr(transformers, config_class):
        return {}
    module = CHECKPOINT_CODE[:-3]
    auto_map, classes = {"AutoConfig": f"{module}.Collaborative{config_class}"}, []
    architectures = [a for a in (config.get("architectures") or []) if hasattr(transformers, a)]
    base = MODEL_MAPPING_NAMES.get(model_type)
    for architecture in dict.fromkeys([*(b for b in [base] if isinstance(b, str)), *architectures]):
        for auto in _auto_classes(model_type, architecture):
            auto_map.setdefault(auto, f"{module}.Collaborative{architecture}")
            classes.append(architecture)
    code = _TEMPLATE.read_text(encoding="utf-8")
    code += ("\n\n# The classes config.json's auto_map names: the library's own, under this checkpoint's model_type;"
             "\n# the quantizer above swaps their attention into the recorded form.\n")
    code += (f"\n\nclass Collaborative{config_class}(transformers.{config_class}):\n"
             f"    model_type = {guarded_model_type(model_type)!r}\n")
    for architecture in dict.fromkeys(classes):
        code += (f"\n\nclass Collaborative{architecture}(transformers.{architecture}):\n"
                 f"    config_class = Collaborative{config_class}\n")
    (folder / CHECKPOINT_CODE).write_text(code, encoding="utf-8")
    return auto_map
