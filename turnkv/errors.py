"""Errors a user can cause (bad file, bad value): printed as one line by the CLI, 4xx by the server."""

from __future__ import annotations


def user_errors() -> tuple[type[BaseException], ...]:
    from .engine.engine import ContextLengthError
    from .loading.errors import ModelLoadError
    return (ModelLoadError, ContextLengthError, ValueError, FileNotFoundError)
