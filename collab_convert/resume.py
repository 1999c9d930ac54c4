"""Work a killed run finished, kept in its staging folder for --resume (io/folders.StagedOutput)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .architectures.layouts import AttentionLayer
from .results import LayerReport


class FinishedLayers:
    """Each fitted layer's tensors and report, saved as it finishes (safetensors + JSON) in the staging folder,
    so that --resume after a killed run reuses them instead of fitting again: the costly part of a long
    calibrated run. Saved tensors are exactly what is written, so a resumed output is byte-identical."""

    def __init__(self, folder: Path | None, report_type: type = LayerReport):
        self.folder, self.report_type = folder, report_type  # the form's layer report, to read saved ones back

    def _paths(self, layer: AttentionLayer) -> tuple[Path, Path]:
        stem = layer.prefix.replace("/", "_")
        return self.folder / f"{stem}.safetensors", self.folder / f"{stem}.json"

    def has(self, layer: AttentionLayer) -> bool:
        return self.folder is not None and all(path.is_file() for path in self._paths(layer))

    def get(self, layer: AttentionLayer):
        if self.folder is None:
            return None
        tensors_path, report_path = self._paths(layer)
        if not (tensors_path.is_file() and report_path.is_file()):
            return None
        from safetensors.torch import load_file

        try:
            report = self.report_type(**json.loads(report_path.read_text(encoding="utf-8")))
            tensors = load_file(str(tensors_path))
            order = json.loads(report_path.with_suffix(".order").read_text(encoding="utf-8"))
            return report, {name: tensors[name] for name in order}
        except Exception:  # noqa: BLE001 - a half-saved layer (killed while saving) is fitted again
            return None

    def load_plan(self) -> dict[str, int] | None:
        """The refinement steps per layer a killed run had chosen, if it got that far."""
        path = self.folder / "refinement_steps.json" if self.folder else None
        if path is None or not path.is_file():
            return None
        try:
            return {str(k): int(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
        except (ValueError, AttributeError):
            return None

    def save_plan(self, steps: dict[str, int]) -> None:
        if self.folder is not None:
            path = self.folder / "refinement_steps.json"
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(steps), encoding="utf-8")
            partial.replace(path)

    def put(self, layer: AttentionLayer, report: LayerReport, tensors: dict[str, torch.Tensor]) -> None:
        if self.folder is None:
            return
        from safetensors.torch import save_file

        tensors_path, report_path = self._paths(layer)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tensors_path))
        report_path.with_suffix(".order").write_text(json.dumps(list(tensors)), encoding="utf-8")
        report_path.write_text(json.dumps(report.to_dict()), encoding="utf-8")  # last: marks the layer done
