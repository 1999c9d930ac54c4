"""A source checkpoint opened for compression: its folder, config, family, lazy tensors and attention layers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cpu import ask_for_huge_pages
from ..errors import BadInputError, CollabError
from ..format import is_collaborative
from ..io.folders import read_config, resolve_model
from ..io.reader import TensorReader
from .agreement import check_agreement, check_readable
from .families import Family, FormOffer
from .layouts import AttentionLayer, HeadOutputs, Projections, natural_key
from .lookup import family_for
from .naming import model_renamer


@dataclass
class SourceModel:
    source: str  # what the user named: a folder or a hub id
    folder: Path
    config: dict[str, Any]
    family: Family
    offer: FormOffer  # the form the layers are compressed into, and the family's layout in it
    reader: TensorReader
    layers: list[AttentionLayer]

    @property
    def form(self) -> str:
        return self.offer.form

    @property
    def layout(self):
        return self.offer.layout

    @property
    def width(self) -> int:
        """The widest attention input: the hidden size that sizes activation batches."""
        return max(layer.shape.input_dim for layer in self.layers)

    def shard_by_shard(self):
        """The layers in order, every input shard but the one holding the next layer's weights unmapped before it
        is yielded: a loop that reads each layer's weights then holds one shard's pages, not the pages of every
        shard it has read (the rank spread's reads held three 100 MB shards of a GPT-2-medium-shaped checkpoint)."""
        for layer in self.layers:
            self.reader.release_all_but(layer.anchor)
            yield layer

    def read_projections(self, layer: AttentionLayer) -> Projections:
        return self.layout.read(self.reader, layer)

    def weighs_heads(self, layer: AttentionLayer) -> bool:
        """Whether the family's layout names the layer's value and output weights and they split by head, from the
        headers (layouts.py): calibrated fits then weigh each head by how far its attention moves the output."""
        weighs = getattr(self.layout, "weighs_heads", None)
        return bool(weighs and weighs(self.reader, layer))

    def read_head_outputs(self, layer: AttentionLayer) -> HeadOutputs | None:
        """Each head's value rows and output columns, where weighs_heads; else None (the heads weigh alike)."""
        return self.layout.head_outputs(self.reader, layer) if self.weighs_heads(layer) else None

    def close(self) -> None:
        self.reader.close()


def open_model(model: str, form: str = "auto") -> SourceModel:
    """Open a checkpoint for the form asked for ("auto", "collaborative" or "shared-key", lookup.family_for)."""
    folder = resolve_model(model)
    config = read_config(folder)
    if is_collaborative(config):
        raise BadInputError(f"{model} is already collaborative; compress the original model instead")
    family, offer = family_for(config, form)
    reader = TensorReader(folder, rename=model_renamer(folder, config))
    layers = find_attention_layers(reader, family, offer.layout, config)
    if not layers:
        raise BadInputError(f"{model}: no {family.name} attention layers found among its weights")
    check_readable(config, reader, [layer.prefix for layer in layers])
    check_agreement(folder, config, reader, family, f".{offer.layout.marker}.weight")
    return SourceModel(model, folder, config, family, offer, reader, layers)


def form_taken(model: str, form: str = "auto") -> str | None:
    """The form open_model takes for `form`, from config.json alone, before anything loads: None where it is not
    known yet (a GGUF file not converted, or a model that open_model will refuse in its own words: one already
    collaborative, an unknown family)."""
    try:
        folder = resolve_model(model, convert=False)
        if not (folder / "config.json").is_file():
            return None
        config = read_config(folder)
        return None if is_collaborative(config) else family_for(config, form)[1].form
    except CollabError:
        return None


def ask_for_huge_pages_for(model: str, form: str) -> bool:
    """cpu.ask_for_huge_pages for the form a run on `model` takes: `form` as asked, or the family's where it is left
    to the family ("auto": a rotary decoder's is the shared key), which is known once the lookup has loaded torch.
    Called before torch allocates anything (the command line, before its job; benchmarks/memory.py, as it)."""
    return ask_for_huge_pages(form_taken(model) if form == "auto" else form)


def find_attention_layers(reader: TensorReader, family: Family, layout, config: dict[str, Any]) -> list[AttentionLayer]:
    """Every attention module of the family's sites, read in `layout`, from tensor headers alone (nothing is
    loaded)."""
    suffix = f".{layout.marker}.weight"
    layers = []
    for name in reader.names():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]
        site = family.site_of(prefix)
        if site is None:
            continue
        layer = layout.find(reader, prefix, family.heads(config, site), site.causal, config)
        layer.caches_keys = family.caches_keys(site)
        layers.append(layer)
    return sorted(layers, key=lambda layer: natural_key(layer.prefix))
