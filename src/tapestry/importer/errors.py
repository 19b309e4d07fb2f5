"""The importer's one error type (its own module, so capture and the capture-time rewrites both raise it)."""
from __future__ import annotations


class TorchImportError(ValueError):
    """A module that cannot be imported: the message says why, and where when it is one op."""
