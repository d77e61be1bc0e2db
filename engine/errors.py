"""Errors the engine raises for bad input. Each is a ValueError so callers can catch one type."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad sampling params, prompt too long, ...).

    Raised before the request touches any engine state, so nothing else is disturbed.
    """


class ModelLoadError(ValueError):
    """A model path or architecture the engine cannot load."""
