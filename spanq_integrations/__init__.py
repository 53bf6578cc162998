"""spanq: span queries for LLM applications — say which parts of a prompt are order-free.

Build a query with the builder functions, optimize it, and execute it on a backend. Importing this package
imports neither torch nor vLLM; the embedded span-aware engine is loaded on first use.
"""

from __future__ import annotations

from spanq_integrations.backends import (
    Backend,
    BackendCapabilities,
    CallMetrics,
    Completion,
    default_backend,
    resolve_backend,
)
from spanq_integrations.backends.protocol import Usage
from spanq_integrations.optimizer import TreeReduction, optimize
from spanq_integrations.query.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ContextLengthError,
    GenerationError,
    ModelNotFoundError,
    OptimizerError,
    QueryParseError,
    QueryValidationError,
    ReducerParseError,
    RequestRejectedError,
    SpanQueryError,
)
from spanq_integrations.query.ir import (
    Assistant,
    Chat,
    Combine,
    Cross,
    Fragment,
    Generate,
    Map,
    Monad,
    Node,
    Plus,
    Print,
    Repeat,
    Retrieve,
    System,
    User,
    assistant,
    chat,
    combine,
    cross,
    fragment,
    generate,
    plus,
    render,
    repeat,
    retrieve,
    system,
    user,
)
from spanq_integrations.query.spnl_json import dumps, from_json, load_file, loads, to_json
from spanq_integrations.runtime.executor import ExecutionResult, aexecute, execute
from spanq_integrations.runtime.judge import JudgeResult, ajudge, judge

__version__ = "0.1.0"

__all__ = [  # noqa: RUF022  (grouped by topic)
    # builder
    "system",
    "user",
    "assistant",
    "fragment",
    "plus",
    "cross",
    "generate",
    "repeat",
    "retrieve",
    "chat",
    "combine",
    "render",
    # spnl JSON (spnl's own format: read and written the way spnl does)
    "loads",
    "dumps",
    "load_file",
    "from_json",
    "to_json",
    # IR
    "Node",
    "System",
    "User",
    "Assistant",
    "Fragment",
    "Generate",
    "Plus",
    "Cross",
    "Chat",
    "Retrieve",
    "Repeat",
    "Map",
    "Combine",
    "Monad",
    "Print",
    # judges (tree reduction on any server)
    "judge",
    "ajudge",
    "JudgeResult",
    # optimizer and execution
    "optimize",
    "TreeReduction",
    "aexecute",
    "execute",
    "ExecutionResult",
    "Backend",
    "BackendCapabilities",
    "CallMetrics",
    "Usage",
    "Completion",
    "default_backend",
    "resolve_backend",
    # errors
    "SpanQueryError",
    "QueryParseError",
    "QueryValidationError",
    "OptimizerError",
    "BackendError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "ModelNotFoundError",
    "ContextLengthError",
    "GenerationError",
    "ReducerParseError",
    "RequestRejectedError",
    "__version__",
]
