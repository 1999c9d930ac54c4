"""The model card (README.md) of a compressed checkpoint: front matter that says where it came from, and prose."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..format import CHECKPOINT_CODE
from ..io.folders import EMBEDDED_MODELS, readme_front_matter
from .summary import summary_lines

if TYPE_CHECKING:
    from ..results import CompressResult


@dataclass
class CardSource:
    """What the card needs to know about the source model: no loaded model, just metadata."""

    base_model: str | None  # a hub id, where one is known
    front_matter: dict[str, Any] = field(default_factory=dict)  # of the source's own model card
    license: str | None = None

    @classmethod
    def of(cls, model: str, folder: Path, config: dict[str, Any]) -> "CardSource":
        front = readme_front_matter(folder)
        return cls(_base_model_id(model, config), front, front.get("license") or config.get("license"))


CARRIED_CODE = (f"Without collab-convert, pass `trust_remote_code=True` (transformers' Auto classes, "
                "sentence-transformers, pipelines): the modeling code travels with the checkpoint "
                f"({CHECKPOINT_CODE}; it imports only torch and transformers). Without that flag transformers "
                "refuses the checkpoint, whose model_type is its own, rather than load it with random query and key "
                "weights; no other flag gets past that.")

# A form that needs our loader: what transformers alone does with it (format.MODEL_TYPE_PREFIX)
GUARDED = ("Without collab-convert, transformers refuses the checkpoint, whose model_type is its own, rather than "
           "load it with random weights where the attention was rewritten; with `trust_remote_code=True` the code it "
           f"carries ({CHECKPOINT_CODE}) refuses too, and says to install collab-convert.")

UNGUARDED = ("Without collab-convert, transformers loads the original model from it (every weight the rewrite uses "
             "beside the original's is ignored, and none was removed): import collab_convert to run the rewrite.")


def _without_us(card, folder: Path) -> list[str]:
    """What the card says of loading without collab-convert."""
    if not card.guarded:
        return []
    if not _has_guards(folder):
        return [UNGUARDED]
    return [CARRIED_CODE if _runs_in_carried_code(folder) else GUARDED]


def _runs_in_carried_code(folder: Path) -> bool:
    """Whether the code the checkpoint carries runs its form: its record then names the projections it replaces."""
    import json

    record = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    return (folder / CHECKPOINT_CODE).exists() and bool(record.get("projections"))


def _has_guards(folder: Path) -> bool:
    """Whether the written weights hold a load guard (a tensor of no numbers). A form that replaced no weight (a
    shared key read off QK-normed keys) has none: transformers alone then loads the original model."""
    from safetensors import safe_open

    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            if any(weights.get_slice(name).get_shape() == [0] for name in weights.keys()):
                return True
    return False


def write_model_card(result: "CompressResult", form, source: CardSource, folder: Path) -> list[str]:
    """README.md; `form` (forms/, the result's form) says what every layer became."""
    original = source.front_matter
    card = form.card
    front = {
        "base_model": source.base_model,
        # The Hub knows adapter/merge/quantized/finetune: a form that loads through a quantization config says
        # quantized; a stock checkpoint (the multi-query form) names no relation the Hub has
        **({"base_model_relation": card.relation} if card.relation else {}),
        "library_name": original.get("library_name", "transformers"),
        "tags": sorted(set((original.get("tags") or []) + list(card.tags) + ["collab-convert"])),
    }
    if source.license:
        front["license"] = source.license
    if original.get("pipeline_tag"):
        front["pipeline_tag"] = original["pipeline_tag"]
    import yaml

    command = " ".join(shlex.quote(a) for a in ["collab-convert", *sys.argv[1:]]) if _from_cli() else None
    body = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {source.base_model or result.model} with collaborative attention",
        "",
        f"Every attention layer of `{result.model}` was {form.what_it_does()[0]} by collab-convert "
        f"{result.tool_version}: {form.what_it_does()[1]}.",
        "",
        *summary_lines(result, form, texts=False),
        "",
        card.loading,
        *_without_us(card, folder),
        "Details per layer are in report.md.",
        "",
    ]
    if command:
        body += ["Produced by:", "", "```", command, "```", ""]
    (folder / "README.md").write_text("\n".join(body), encoding="utf-8")
    return ["README.md"]


def _from_cli() -> bool:
    return Path(sys.argv[0]).name in ("collab-convert", "collab_convert") or sys.argv[0].endswith("__main__.py")


def _base_model_id(model: str, config: dict[str, Any]) -> str | None:
    if model in EMBEDDED_MODELS or (not Path(model).expanduser().exists() and "/" in model):
        return model
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name and not Path(name).is_absolute() else None


