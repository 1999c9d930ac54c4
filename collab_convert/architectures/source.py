"""A source checkpoint opened for compression: its folder, config, family, lazy tensors and attention layers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInputError
from ..format import is_collaborative
from ..io.folders import read_config, resolve_model
from ..io.reader import TensorReader
from .families import Family, family_for
from .layouts import AttentionLayer, Projections, natural_key
from .naming import model_renamer
from .shared_key import rotary_dim_of


@dataclass
class SourceModel:
    source: str  # what the user named: a folder or a hub id
    folder: Path
    config: dict[str, Any]
    family: Family
    reader: TensorReader
    layers: list[AttentionLayer]

    @property
    def width(self) -> int:
        """The widest attention input: the hidden size that sizes activation batches."""
        return max(layer.shape.input_dim for layer in self.layers)

    def read_projections(self, layer: AttentionLayer) -> Projections:
        return self.family.layout.read(self.reader, layer)

    def close(self) -> None:
        self.reader.close()


def open_model(model: str, form: str = "auto") -> SourceModel:
    """Open a checkpoint for the form asked for ("auto", "collaborative" or "shared-key", families.family_for)."""
    folder = resolve_model(model)
    config = read_config(folder)
    if is_collaborative(config):
        raise BadInputError(f"{model} is already collaborative; compress the original model instead")
    family = family_for(config, form)
    reader = TensorReader(folder, rename=model_renamer(folder, config))
    layers = find_attention_layers(reader, family, config)
    if not layers:
        raise BadInputError(f"{model}: no {family.name} attention layers found among its weights")
    return SourceModel(model, folder, config, family, reader, layers)


def find_attention_layers(reader: TensorReader, family: Family, config: dict[str, Any]) -> list[AttentionLayer]:
    """Every attention module of the family's sites, from tensor headers alone (nothing is loaded)."""
    suffix = f".{family.layout.marker}.weight"
    layers = []
    for name in reader.names():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        site = family.site_of(prefix)
        if site is None:
            continue
        heads = family.heads(config, site)
        if family.takes_shared_key:
            layer = family.layout.find(reader, prefix, heads, site.causal, family.layout.keeps_key_projection(config))
            layer.shared_key = True
            layer.rotary_dim = 0 if family.absolute_positions else rotary_dim_of(config, layer.shape.head_dim)
        else:
            layer = family.layout.find(reader, prefix, heads, site.causal)
        layer.caches_keys = family.caches_keys(site)
        layers.append(layer)
    return sorted(layers, key=lambda layer: natural_key(layer.prefix))
