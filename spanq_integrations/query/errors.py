"""Typed errors of spanq: every failure a user can meet is one of these, and says what to do."""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "BackendError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "ContextLengthError",
    "GenerationError",
    "ModelNotFoundError",
    "OptimizerError",
    "QueryParseError",
    "QueryValidationError",
    "ReducerParseError",
    "RequestRejectedError",
    "SpanQueryError",
    "check_fan_in",
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


class ArgumentTypeError(QueryValidationError, TypeError):
    """An adapter was given an argument of the wrong type (`path` names the call and the argument): a spanq error
    and, as Python and LangChain raise for it, a `TypeError`."""


class ArgumentValueError(QueryValidationError, ValueError):
    """An adapter was given an argument it cannot use (`path` names the call and the argument): a spanq error and,
    as Python and LangChain raise for it, a `ValueError`."""


class OptimizerError(SpanQueryError):
    """An optimizer rule cannot be applied (for example a `Retrieve` without a registered retriever)."""


class BackendError(SpanQueryError):
    """The serving backend answered with an error."""


class BackendUnavailableError(BackendError):
    """The serving backend cannot be reached or dropped the connection."""


class BackendTimeoutError(BackendUnavailableError, TimeoutError):
    """The backend did not answer within a time limit (a call's `timeout`, the backend's): a spanq error and, as
    asyncio and LangChain's retry helpers expect of one, a `TimeoutError`."""


class ModelNotFoundError(BackendError):
    """The backend does not serve the requested model."""


class ContextLengthError(BackendError):
    """A prompt (or a single span) does not fit the model's context window. `field` is the call's own field to
    blame where the prompt is not at fault (`.g.max_tokens`: more tokens asked for than the window holds)."""

    field: str = ""


class RequestRejectedError(BackendError):
    """The engine refused a request's parameters (a client's mistake, not the server's)."""


class GenerationError(SpanQueryError):
    """A `Generate` call inside a query failed; `path` names the node, `__cause__` the reason."""

    def __init__(self, path: str, cause: BaseException):
        self.path = path
        self.cause = cause
        super().__init__(f"{path}: {type(cause).__name__}: {cause}")


class ReducerParseError(SpanQueryError):
    """A tree-reduction step produced output that its reducer template cannot parse."""


def check_fan_in(k: object, name: str = "k", reads: str = "inputs", *, none: str | None = None) -> None:
    """The one check of a tree's fan-in: an integer >= 2 (each judge or call reads at most `k` of its `reads`).
    `none`: where `None` is allowed, how to ask for it and what it means, said after the error (else `None` is
    refused too)."""
    if k is None and none is not None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        hint = f"; {none}" if none is not None else ""
        raise QueryValidationError(name, f"{name} must be an integer >= 2 (each reads at most {name} {reads}), "
                                         f"got {k!r}{hint}")
