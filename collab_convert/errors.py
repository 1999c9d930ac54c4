"""Errors a user can act on. The CLI prints their message as one line; nothing else reaches the terminal."""

from __future__ import annotations


class CollabError(Exception):
    """Base class: a problem with the user's input or environment, not a bug in the tool."""

    exit_code = 3


class BadInputError(CollabError):
    """The model, its files or an option cannot be used."""


class UnsupportedModelError(BadInputError):
    """The architecture is not one the collaborative form can represent (yet)."""


class OutputExistsError(BadInputError):
    """The output folder exists and is not empty, and --overwrite was not given."""
