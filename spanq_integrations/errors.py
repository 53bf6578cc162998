"""Typed errors of spanq: every failure a user can meet is one of these, and says what to do."""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ContextLengthError",
    "GenerationError",
    "ModelNotFoundError",
    "OptimizerError",
    "QueryParseError",
    "QueryValidationError",
    "ReducerParseError",
    "SpanQueryError",
]


class SpanQueryError(Exception):
    """Base class of every spanq error."""


class QueryParseError(SpanQueryError):
    """A query document (JSON) is malformed; `path` names the place inside the document."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class QueryValidationError(SpanQueryError):
    """A query tree is well-formed but cannot run as written (for example an empty `plus`)."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class OptimizerError(SpanQueryError):
    """An optimizer rule cannot be applied (for example a `Retrieve` without a registered retriever)."""


class BackendError(SpanQueryError):
    """The serving backend answered with an error."""


class BackendUnavailableError(BackendError):
    """The serving backend cannot be reached or dropped the connection."""


class ModelNotFoundError(BackendError):
    """The backend does not serve the requested model."""


class ContextLengthError(BackendError):
    """A prompt (or a single span) does not fit the model's context window."""


class GenerationError(SpanQueryError):
    """A `Generate` call inside a query failed; `path` names the node, `__cause__` the reason."""

    def __init__(self, path: str, cause: BaseException):
        self.path = path
        self.cause = cause
        super().__init__(f"{path}: {type(cause).__name__}: {cause}")


class ReducerParseError(SpanQueryError):
    """A tree-reduction step produced output that its reducer template cannot parse."""
