"""CLI flags generated from the job options (options.py): a default or a help text is written once."""

from __future__ import annotations

import inspect
from typing import Optional, get_args

import typer


def cli_type(field):
    """The type the command line reads a field as: its `cli_type`, else its annotation (X | None -> Optional[X])."""
    declared = (field.json_schema_extra or {}).get("cli_type")
    if declared is not None:
        return Optional[declared] if field.default is None and not field.is_required() else declared
    args = [a for a in get_args(field.annotation) if a is not type(None)]
    if type(None) in get_args(field.annotation) and len(args) == 1:
        return Optional[args[0]]
    return field.annotation


def flags_of(name: str, field) -> list[str]:
    return (field.json_schema_extra or {}).get("flags") or [f"--{name.replace('_', '-')}"]


# Help panels, in the order --help shows them: what most runs set first, then the rest by purpose.
ESSENTIALS = "Essentials"
PANELS = {
    ESSENTIALS: {"output", "rank", "key_cache", "kv_cache", "form", "calibration", "ranks", "texts", "against",
                 "format", "dtype"},
    "Calibration and fitting": {"calibration_samples", "calibration_max_length", "calibration_tokens", "calibration_mix", "target_cosine",
                                "energy", "refine_steps", "refine_samples", "refine_together", "distill_steps",
                                "weight_only", "method"},
    "Fidelity gates (exit 1 when one fails)": {"min_cosine", "min_cosine_p01", "min_top1", "max_kl"},
}
MORE = "More options"
PANEL_ORDER = [*PANELS, MORE]


def panel_of(name: str) -> str:
    return next((panel for panel, names in PANELS.items() if name in names), MORE)


def with_options(options_model, after: str):
    """Give a command one CLI option per field of `options_model` (names, defaults and help from the model),
    placed after its parameter `after`. The command receives them as keyword arguments."""

    def decorate(function):
        own = list(inspect.signature(function).parameters.values())
        own = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        generated = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(... if field.is_required() else field.default, *flags_of(name, field),
                                     help=field.description, show_default=not field.is_required(),
                                     rich_help_panel=panel_of(name),
                                     metavar=(field.json_schema_extra or {}).get("metavar")),
                annotation=cli_type(field),
            )
            for name, field in sorted(options_model.model_fields.items(), key=_by_panel(options_model))
        ]
        position = next(i for i, p in enumerate(own) if p.name == after) + 1
        parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        function.__signature__ = inspect.Signature(parameters[:position] + generated + parameters[position:])
        return function

    return decorate


def _by_panel(options_model):
    """By help panel; within one, the model's own fields in the order it declares them, then the ones it inherits."""
    own = list(options_model.__annotations__)
    fields = list(options_model.model_fields)

    def key(item):
        name = item[0]
        return (PANEL_ORDER.index(panel_of(name)), (0, own.index(name)) if name in own else (1, fields.index(name)))

    return key


def build_options(options_model, values: dict):
    """The options model from CLI values; a value it refuses is a usage error naming the flag."""
    from pydantic import ValidationError

    try:
        return options_model(**values)
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        field = options_model.model_fields.get(name)
        hint = flags_of(name, field)[0] if field else None
        raise typer.BadParameter(first["msg"].removeprefix("Value error, "), param_hint=hint) from None
