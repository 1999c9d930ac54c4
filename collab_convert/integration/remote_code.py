"""The modeling code a CP checkpoint carries, so that it loads without collab-convert where the user opts in.

An encoder's CP form is no stock architecture, so it ships the way the ecosystem ships custom ones: the code
travels with the checkpoint (checkpoint_code.py, copied as `collaborative_modeling.py`) and config.json's
`auto_map` names a class of it for each Auto class that loads the model. transformers runs it only with
`trust_remote_code=True`; without that flag it loads its own class, and the checkpoint's load guards refuse.
`model_type` and `architectures` stay the original's, so collab-convert's own loader needs no flag.
"""

from __future__ import annotations

from pathlib import Path

from ..format import CHECKPOINT_CODE

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
    """Write collaborative_modeling.py for a checkpoint of the model `config` describes; returns config.json's
    `auto_map` for it (empty, and nothing written, where transformers knows no class to build: the checkpoint then
    keeps its load guards alone)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = config.get("model_type", "")
    architectures = [a for a in (config.get("architectures") or []) if hasattr(transformers, a)]
    base = MODEL_MAPPING_NAMES.get(model_type)
    auto_map, classes = {}, []
    for architecture in dict.fromkeys([*(b for b in [base] if isinstance(b, str)), *architectures]):
        for auto in _auto_classes(model_type, architecture):
            auto_map.setdefault(auto, f"{CHECKPOINT_CODE[:-3]}.Collaborative{architecture}")
            classes.append(architecture)
    if not auto_map:
        return {}
    code = _TEMPLATE.read_text(encoding="utf-8")
    code += "\n\n# The model classes config.json's auto_map names: the library's own, loaded in the CP form.\n"
    for architecture in dict.fromkeys(classes):
        code += (f"\n\nclass Collaborative{architecture}(transformers.{architecture}):\n"
                 f'    """transformers\' {architecture}; the quantizer above swaps its attention into the CP form."""\n')
    (folder / CHECKPOINT_CODE).write_text(code, encoding="utf-8")
    return auto_map
