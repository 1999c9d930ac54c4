"""Finding a config's family (families.py) in the form asked for, and how many tokens its positions take."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError
from ..format import COLLABORATIVE_FORM, MULTI_QUERY_FORM, SHARED_KEY_FORM
from .families import FAMILIES, POSITIONS_AFTER_PADDING, REFUSED, Family, FormOffer

# What `--form` asks for, in the words its errors use.
_ASKED = {SHARED_KEY_FORM: "the shared-key form (--form shared-key, --key-cache)",
          COLLABORATIVE_FORM: "the collaborative (CP) form (--form collaborative)",
          MULTI_QUERY_FORM: "the multi-query form (--form multi-query, --kv-cache)"}


def family_for(config: dict[str, Any], form: str = "auto") -> tuple[Family, FormOffer]:
    """The family of a config and the form it takes: the one asked for by name, or with "auto" its default."""
    family = _family_of(config)
    offer = family.offers[0] if form == "auto" else family.offer(form)
    if offer is None:
        why = dict(family.not_offered).get(form)
        if why:
            raise UnsupportedModelError(f"{family.name}: {why}")
        names = sorted({t for f in FAMILIES if f.offer(form) for t in f.model_types
                        if _admits(f.offer(form).requires, {"model_type": t})})
        raise UnsupportedModelError(f"{_ASKED.get(form, form)} is not offered for model_type "
                                    f"'{config.get('model_type')}' (offered for: {', '.join(names)})")
    _check_requirements(offer.requires, config)
    return family, offer


def forms_offered(config: dict[str, Any]) -> list[str]:
    """The forms a config's model can take, its default first."""
    forms = []
    for form in _family_of(config).forms:
        try:
            family_for(config, form)
        except UnsupportedModelError:
            continue
        forms.append(form)
    return forms


def family_named(name: str) -> Family:
    """The family a checkpoint's record names. Older records named the shared-key form of a family
    "<family>-shared-key"; the form is now the layer's own record."""
    name = name.removesuffix(f"-{SHARED_KEY_FORM}")
    for family in FAMILIES:
        if family.name == name:
            return family
    known = ", ".join(f.name for f in FAMILIES)
    raise UnsupportedModelError(f"unknown collaborative family '{name}' (known: {known})")


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def _admits(requires, config: dict[str, Any]) -> bool:
    """Whether a config passes the requirements on the keys it has (the others are not judged)."""
    return all(config.get(key) in allowed for key, allowed, _ in requires if key in config)


def _check_requirements(requires, config: dict[str, Any]) -> None:
    for key, allowed, reason in requires:
        if config.get(key) not in allowed:
            raise UnsupportedModelError(f"{key}={config.get(key)!r} is not supported: {reason}")


def _family_of(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise UnsupportedModelError(f"config.json's model_type {model_type!r} is not a name")
    if not model_type:
        raise UnsupportedModelError("config.json has no model_type, so the architecture cannot be recognised")
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model_type '{model_type}' is not supported: {REFUSED[model_type]}")
    for family in FAMILIES:
        if model_type in family.model_types:
            _check_requirements(family.requires, config)
            return family
    raise UnsupportedModelError(
        f"model_type '{model_type}' is not supported (supported: {', '.join(supported_model_types())})"
    )


def position_limit(config: dict[str, Any]) -> int | None:
    """The most tokens one input may have before the model's position embeddings run out (None: no limit
    stated). Rotary decoders state a trained length, which is a sensible limit for calibration too."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if config.get("model_type") in POSITIONS_AFTER_PADDING:
                value -= int(config.get("pad_token_id") or 0) + 1
            return max(value, 2)
    return None


def within_positions(config: dict[str, Any], max_length: int) -> int:
    """`max_length` tokens, or fewer where the model's position embeddings end (a longer input would index
    past them): the one cut every tokenization of text for a model goes through."""
    limit = position_limit(config)
    return min(max_length, limit) if limit is not None else max_length
