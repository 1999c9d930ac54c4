"""The forms attention layers can be compressed into, by name: each one object (base.Form) that owns its plan,
statistics, fits, output, record, analysis and how its results read. A family (architectures/families.py) names
the forms it offers; the pipeline and the renderers ask the form.

    collaborative/   the CP form: one shared query and key, a mixing vector per head (the paper's)
    shared_key/      the shared-key form: per-head queries, one shared key (per RoPE frequency)
    multi_query/     the multi-query form: a stock checkpoint with one key/value head, keys and values compressed
"""

from __future__ import annotations

from ..errors import BadInputError
from .base import Form, FormPlan, Statistics
from .collaborative import FORM as COLLABORATIVE
from .multi_query import FORM as MULTI_QUERY
from .shared_key import FORM as SHARED_KEY

FORMS: dict[str, Form] = {form.name: form for form in (COLLABORATIVE, SHARED_KEY, MULTI_QUERY)}

__all__ = ["FORMS", "Form", "FormPlan", "Statistics", "form_named"]


def form_named(name: str) -> Form:
    if name not in FORMS:
        raise BadInputError(f"unknown form '{name}' (known: {', '.join(FORMS)})")
    return FORMS[name]
