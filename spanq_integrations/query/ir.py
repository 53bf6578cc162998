"""The span-query IR: immutable pydantic nodes, builder functions, tree traversal and a readable rendering.

A query is a side-effect-free expression tree. Leaves are messages (`System`, `User`, `Assistant`) and corpus
pieces (`Fragment`); `Cross` joins children whose order matters, `Plus` joins order-free children, and
`Generate` calls the model on its input; `Combine` combines the answers of the generates under it in code (the
exact combine step of a judge's reducer: a union, a count, a vote, the highest score). Executing a tree yields a
tree: a finished `Generate` (or `Combine`) becomes an `Assistant` whose `source` remembers the node (and so the
input) it came from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spanq_integrations.query.errors import QueryValidationError

__all__ = [
    "ANCHOR_POLICIES",
    "DEFAULT_TEMPERATURE",
    "EMPTY_STOP",
    "NODE_TYPES",
    "RECOMPUTE_POLICIES",
    "SPAN_ROLES",
    "AnchorPolicy",
    "Assistant",
    "Chat",
    "Combine",
    "Cross",
    "Fragment",
    "Generate",
    "Map",
    "Monad",
    "Node",
    "Plus",
    "Print",
    "Recompute",
    "Repeat",
    "Retrieve",
    "SpanRole",
    "System",
    "User",
    "assistant",
    "chat",
    "child_paths",
    "children_of",
    "combine",
    "cross",
    "fragment",
    "generate",
    "mixed_group",
    "plus",
    "recompute_in_range",
    "render",
    "repeat",
    "retrieve",
    "system",
    "transform",
    "user",
    "walk",
    "with_children",
]

DEFAULT_TEMPERATURE = 0.6  # spnl's default
MAX_TEMPERATURE = 2.0  # what OpenAI-compatible servers (vLLM included) accept
MAX_REPEAT = 1_000_000  # copies of one repeat, anywhere


class _Node(BaseModel):
    """A query node. Each class declares where its sub-queries are once, in `CHILD_FIELD`, and everything
    that walks a tree (`children_of`, `with_children`, `walk`, `render`, the JSON writer, the limits, the
    executor) reads that declaration instead of asking which class a node is.

    `CHILD_FIELD`: `(field, spelling)` — the field holding the node's sub-queries (one node, or a tuple of
    nodes), and where it sits in the node's spnl JSON under its tag (`"input"` in `{"g": {"input": ...}}`;
    `""` when the tag's value is the field itself, as in `{"plus": [...]}`): the paths `walk` yields, and every
    error names, are written from it. None: a leaf. An `Assistant`'s `source` is provenance, not a child."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    CHILD_FIELD: ClassVar[tuple[str, str] | None] = None

    @property
    def tag(self) -> str:
        """The key of the node in spnl JSON: its `kind`, or the spelling it was written with (`par`, `seq`)."""
        return getattr(self, "keyword", None) or self.kind  # type: ignore[attr-defined]

    def label(self) -> str:
        """One line describing the node itself (not its children), for `render`."""
        return type(self).__name__

    def __str__(self) -> str:  # a readable tree for people
        return render(self)  # type: ignore[arg-type]


class System(_Node):
    """A system message."""

    kind: Literal["system"] = "system"
    text: str

    def label(self) -> str:
        return f"system: {_clip(self.text)!r}"


class User(_Node):
    """A user message."""

    kind: Literal["user"] = "user"
    text: str

    def label(self) -> str:
        return f"user: {_clip(self.text)!r}"


class Assistant(_Node):
    """An assistant message; `source` is the `Generate` (or `Combine`) that produced it, when it was generated."""

    kind: Literal["assistant"] = "assistant"
    text: str
    source: Generate | Combine | None = None

    def label(self) -> str:
        return f"assistant{' (generated)' if self.source is not None else ''}: {_clip(self.text)!r}"


class Fragment(_Node):
    """A corpus piece (a retrieved document, a candidate): usually a child of a `Plus`."""

    kind: Literal["fragment"] = "fragment"
    text: str
    id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def label(self) -> str:
        ident = f" [{_clip(self.id)}]" if self.id else ""  # one line, whatever the id holds
        return f"fragment{ident}: {_clip(self.text)!r}"


RECOMPUTE_POLICIES: tuple[str, ...] = ("first", "last", "question", "first+question", "attention")
COLD_SPAN_POLICIES: tuple[str, ...] = ("auto", "context", "isolate")
ColdSpans = Literal["auto", "context", "isolate"]
"""How a span engine computes a call's documents it has not cached (docs/design.md, "Cold spans")."""
Recompute = float | Literal["first", "last", "question", "first+question", "attention"]
"""A recompute setting: a share of span blocks in [0, 1], a block of each span by name ("first", "last"), as
many blocks as spans, those the question shares most with ("question") or attends to most in the middle of the
model, read by a pass before the recompute round ("attention"), or both "first" and "question"'s blocks
("first+question": each span's first block and as many more, those the question shares most with)."""


class Generate(_Node):
    """A call to the model ("G"). `max_tokens=0` means the server's default."""

    CHILD_FIELD = ("input", "input")
    kind: Literal["g"] = "g"
    input: Node
    model: str = ""
    max_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=MAX_TEMPERATURE)
    n: int = Field(default=1, ge=1)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # samplers take 64 bits; vLLM reads -1 as no seed
    json_schema: str = ""
    """The answer is JSON: "" free text (the default); "{}" any JSON object (JSON mode); otherwise a JSON schema,
    as JSON text, that the answer matches (constrained decoding where the backend has it)."""
    recompute: Recompute | None = None
    """How much of each span a span engine computes again in context, for quality (docs/design.md, "Recompute"):
    0 (or "none") none, "first" / "last" each span's first / last KV block, "question" as many blocks as spans, those the text
    after the spans shares most with, "first+question" each span's first block and as many more, those the question
    shares most with, "attention" as many, those it attends to most (a pass of its own first), a share in (0, 1] of the span blocks (first blocks first, then those the text
    after the spans mentions most); None: the backend's default. Servers without spans ignore it."""
    cold_spans: ColdSpans | None = None
    """How a span engine computes the spans it has not cached (docs/design.md, "Cold spans"): "isolate" (each
    alone first: the answer is the one the same spans give warm, in any order), "context" (in context, as stock
    does; prepared alone afterwards), "auto" (isolate from a size); None: the backend's default. Judges set
    "isolate": a verdict must not depend on which candidate came first. Servers without spans ignore it."""

    @field_validator("recompute", mode="before")
    @classmethod
    def _none_is_zero(cls, value: object) -> object:
        return 0.0 if value == "none" else value  # as `spanq serve --recompute none` says it

    @field_validator("recompute")
    @classmethod
    def _a_share_or_a_policy(cls, value: Recompute | None) -> Recompute | None:
        return recompute_in_range(value)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):  # (what `generate` and the spnl reader refuse, a node built directly too)
            raise ValueError(EMPTY_STOP)
        return value

    @field_validator("json_schema")
    @classmethod
    def _a_json_object(cls, value: str) -> str:
        if not value:
            return value
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"json_schema must be a JSON object (a schema), not {type(parsed).__name__}")  # noqa: TRY004  (pydantic reads ValueError)
        return json.dumps(parsed, separators=(",", ":"))  # property order kept: it is the order written

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer matches ({} for any JSON object), or None for free text."""
        return json.loads(self.json_schema) if self.json_schema else None

    def label(self) -> str:
        opts = [f"model={_clip(self.model) or '(default)'}", f"max_tokens={self.max_tokens or '(default)'}",
                f"temperature={self.temperature:g}"]  # fmt: skip
        if self.n != 1:
            opts.append(f"n={self.n}")
        if self.stop:
            opts.append(f"stop={list(self.stop)}")
        if self.seed is not None:
            opts.append(f"seed={self.seed}")
        if self.json_schema:
            opts.append("json=any" if self.json_schema == "{}" else f"json_schema={_clip(self.json_schema, 40)}")
        if self.recompute is not None:
            opts.append(f"recompute={self.recompute!r}" if isinstance(self.recompute, str) else f"recompute={self.recompute:g}")
        if self.cold_spans is not None:
            opts.append(f"cold_spans={self.cold_spans}")
        return "generate(" + ", ".join(opts) + ")"


AnchorPolicy = Literal["template", "system", "prefix"]
ANCHOR_POLICIES: tuple[str, ...] = ("template", "system", "prefix")
SpanRole = Literal["user", "system"]
SPAN_ROLES: tuple[str, ...] = ("user", "system")


class Plus(_Node):
    """A commutative join: the children are independent and order-free. `keyword` keeps spnl's spelling.

    `anchor`: what each child's KV is computed after, on a span-aware backend (None: the backend's default,
    `"template"`). `"template"`: the chat template's opening only, so a child is reused after any question,
    conversation or transcript; `"system"`: the opening with the query's leading system messages; `"prefix"`:
    everything before the group, the most faithful and the least reusable.

    `role`: the message the children are content of (None: `"user"`); `"system"` for documents an application
    puts in its system prompt (LangChain's RAG template does), so the prompt keeps the application's roles."""

    CHILD_FIELD = ("children", "")
    kind: Literal["plus"] = "plus"
    children: tuple[Node, ...]
    keyword: Literal["plus", "par"] = "plus"
    anchor: AnchorPolicy | None = None
    role: SpanRole | None = None

    @field_validator("role")
    @classmethod
    def _user_is_the_default(cls, role: SpanRole | None) -> SpanRole | None:
        return None if role == "user" else role  # one spelling of the default: equal groups compare equal

    def label(self) -> str:
        role = ", in the system message" if self.role == "system" else ""
        anchor = f", anchor={self.anchor}" if self.anchor else ""
        return f"{self.keyword} (order-free, {len(self.children)}{role}{anchor})"


class Cross(_Node):
    """A non-commutative join: order carries meaning. `keyword` keeps spnl's spelling."""

    CHILD_FIELD = ("children", "")
    kind: Literal["cross"] = "cross"
    children: tuple[Node, ...]
    keyword: Literal["cross", "seq"] = "cross"

    def label(self) -> str:
        return f"{self.keyword} (ordered, {len(self.children)})"


class Chat(_Node):
    """Sugar: a chat turn over `messages`; the optimizer lowers it to `Generate(Cross(messages))`."""

    CHILD_FIELD = ("messages", "messages")
    kind: Literal["chat"] = "chat"
    messages: tuple[Node, ...]
    model: str = ""
    max_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=MAX_TEMPERATURE)

    def label(self) -> str:
        return f"chat(model={_clip(self.model) or '(default)'}, max_tokens={self.max_tokens})"


class Retrieve(_Node):
    """Sugar: the top-k fragments a named retriever returns for `query`; lowered to a `Plus` of fragments."""

    kind: Literal["retrieve"] = "retrieve"
    query: str
    k: int = Field(default=4, ge=1)
    retriever: str = "default"

    def label(self) -> str:
        return f"retrieve(k={self.k}, retriever={_clip(self.retriever)}): {_clip(self.query)!r}"


class Repeat(_Node):
    """Bulk: `n` independent runs of the same generate."""

    CHILD_FIELD = ("query", "")  # spnl writes the generate's body under the repeat: {"repeat": {"n", "g"}}
    kind: Literal["repeat"] = "repeat"
    # Each copy is a node of the plan: 10^9 of them filled memory for minutes before anything ran (a server's
    # bound is far lower: `--max-bulk`).
    n: int = Field(ge=1, le=MAX_REPEAT)
    query: Generate

    def expand(self) -> tuple[Generate, ...]:
        """The `n` generate calls it stands for: distinct (equal) objects, so nothing downstream can mistake
        them for one call."""
        return tuple(self.query.model_copy() for _ in range(self.n))

    def label(self) -> str:
        return f"repeat(n={self.n})"


class Map(_Node):
    """Bulk: one generate per input string, with shared settings. Built by its class (it has no builder): a bad
    setting is a `QueryValidationError` naming it, as a builder's is."""

    kind: Literal["map"] = "map"
    inputs: tuple[str, ...]
    model: str = ""
    max_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=MAX_TEMPERATURE)

    def __init__(self, **fields: Any) -> None:
        inputs = fields.get("inputs")
        if isinstance(inputs, str):  # (pydantic's "a valid tuple" said nothing of what to write)
            raise QueryValidationError("Map(inputs)", f"expected a list of input texts, got one: {inputs!r}")
        if isinstance(inputs, Iterable):
            fields["inputs"] = inputs = tuple(inputs)  # (read once: a generator's items are checked, then kept)
            for i, text in enumerate(inputs):
                _unicode(text, f"Map(inputs)[{i}]")
        _check_fields(Map, "Map", fields)
        try:
            super().__init__(**fields)
        except ValidationError as e:
            raise _refused(e, "Map", fields) from e  # (the JSON reader names the path from pydantic's error)

    def expand(self) -> tuple[Generate, ...]:
        """The generate calls it stands for: one per input, each the input as a user message."""
        return tuple(
            Generate(input=User(text=t), model=self.model, max_tokens=self.max_tokens, temperature=self.temperature)
            for t in self.inputs
        )

    def label(self) -> str:
        return f"map({len(self.inputs)} inputs, model={_clip(self.model) or '(default)'})"


class Combine(_Node):
    """Combine, in code, the answers of the generates in `input` (a `plus` of judges): the exact combine step
    of the reducer named `reducer` (`extract`: the union of the items, in order; `select`: the highest score;
    `count`: the sum; `vote`: the most frequent answer). `options` are the reducer's settings (say its
    `item_pattern`). No model call: executing it yields an `Assistant` whose text is the combined answer and whose
    `source` is the closed `Combine`. The optimizer's tree-reduction rule plans one when asked to combine in code.
    """

    CHILD_FIELD = ("input", "input")
    kind: Literal["combine"] = "combine"
    input: Node
    reducer: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    def label(self) -> str:
        opts = "".join(
            f", {k}={v!r}" for k, v in sorted(self.options.items()) if k != "system_prompt" and v is not None
        )
        return f"combine in code (reducer={_clip(self.reducer)}{_clip(opts, 200)})"


class Monad(_Node):
    """Run `query` for its effect (for example to warm the cache); it contributes nothing to the prompt."""

    CHILD_FIELD = ("query", "")
    kind: Literal["monad"] = "monad"
    query: Node

    def label(self) -> str:
        return "monad (run for effect)"


class Print(_Node):
    """Print `text` when executed; contributes nothing to the prompt."""

    kind: Literal["print"] = "print"
    text: str

    def label(self) -> str:
        return f"print: {_clip(self.text)!r}"


Node = Annotated[
    System
    | User
    | Assistant
    | Fragment
    | Generate
    | Plus
    | Cross
    | Chat
    | Retrieve
    | Repeat
    | Map
    | Combine
    | Monad
    | Print,
    Field(discriminator="kind"),
]

for _cls in (Assistant, Generate, Plus, Cross, Chat, Repeat, Combine, Monad):
    _cls.model_rebuild()

NODE_TYPES: tuple[type[_Node], ...] = (
    System, User, Assistant, Fragment, Generate, Plus, Cross, Chat, Retrieve, Repeat, Map, Combine, Monad, Print,
)  # fmt: skip
"""Every node class (the members of `Node`): a table that dispatches on a node's class covers each of them."""


# --------------------------------------------------------------------------------------------- builders


def _as_node(x: Any, where: str) -> Node:
    if isinstance(x, str):
        return _built(User, where, text=x)
    if isinstance(x, _Node):
        return x  # type: ignore[return-value]
    hint = ": join several with cross(...) (in order) or plus(...) (order-free)" if isinstance(x, (list, tuple)) else ""
    raise QueryValidationError(where, f"expected a query node or a string, got {type(x).__name__}{hint}")


_Model = TypeVar("_Model", bound=BaseModel)
_NUMBERS: tuple[Any, ...] = (int, float, int | None, float | None)


def _built(cls: type[_Model], builder: str, **fields: Any) -> _Model:
    """`cls(**fields)`, a value out of range or of the wrong type a `QueryValidationError` at `builder(field)`
    (what a `SpanQueryError` handler catches; pydantic's own error named the model's class and a web page)."""
    _check_fields(cls, builder, fields)
    try:
        return cls(**fields)
    except ValidationError as e:
        raise _refused(e, builder, fields) from None


def _check_fields(cls: type[BaseModel], builder: str, fields: dict[str, Any]) -> None:
    """What pydantic lets through: True as 1 and "0.5" as 0.5 (spnl JSON refuses both), and a text that is not
    Unicode (a lone surrogate, from a bad decode: it built, then failed in `to_json`)."""
    for name, value in fields.items():
        field = cls.model_fields.get(name)
        if isinstance(value, (bool, str, bytes)) and field is not None and field.annotation in _NUMBERS:
            kind = "an integer" if field.annotation in (int, int | None) else "a number"
            raise QueryValidationError(f"{builder}({name})", f"expected {kind}, got {value!r}")
    _unicode(fields.get("text"), f"{builder}(text)")


def _unicode(text: Any, where: str) -> None:
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise QueryValidationError(where, f"the text is not valid Unicode: {e.reason} at index {e.start}") from None


def _refused(error: ValidationError, builder: str, fields: dict[str, Any]) -> QueryValidationError:
    """pydantic's first complaint as a `QueryValidationError` at `builder(field)`."""
    first = error.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"][:1]) or "?"
    value = fields.get(field, first.get("input"))
    message = first["msg"].removeprefix("Value error, ")  # (our own validators' messages say what they got)
    if "got" not in message:
        message = f"{message[:1].lower()}{message[1:]}, got {value!r}"
    return QueryValidationError(f"{builder}({field})", message)


def _flatten_args(args: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def system(text: str) -> System:
    return _built(System, "system", text=text)


def user(text: str) -> User:
    return _built(User, "user", text=text)


def assistant(text: str) -> Assistant:
    return _built(Assistant, "assistant", text=text)


def fragment(text: str, id: str | None = None, metadata: dict[str, Any] | None = None, **more: Any) -> Fragment:
    """A document of a `plus`. Its metadata: `metadata` (a LangChain document's, say), and/or keywords."""
    if metadata is not None and not isinstance(metadata, dict):
        raise QueryValidationError("fragment(metadata)", f"expected a dict, got {type(metadata).__name__}")
    return _built(Fragment, "fragment", text=text, id=id, metadata=_as_json({**(metadata or {}), **more}))


def _as_json(value: dict[str, Any]) -> dict[str, Any]:
    """`value` as its JSON reads back (a tuple a list), so that the query writes to JSON and reads back equal; as
    it is where JSON cannot hold it (an object, NaN: running the query needs no JSON, writing it names the path)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return value


def plus(*children: Any, anchor: AnchorPolicy | None = None, role: SpanRole | None = None) -> Plus:
    """Order-free join. Strings become `Fragment`s; lists are spliced in. `anchor`, `role`: see `Plus`."""
    items = _flatten_args(children)  # (none: an empty group, as of a retriever that found nothing, adds nothing)
    if anchor is not None and anchor not in ANCHOR_POLICIES:
        raise QueryValidationError("plus(anchor)", f"unknown anchor policy {anchor!r} (one of {', '.join(ANCHOR_POLICIES)})")
    if role is not None and role not in SPAN_ROLES:
        raise QueryValidationError("plus(role)", f"unknown role {role!r} for a plus (one of {', '.join(SPAN_ROLES)})")
    nodes = [_built(Fragment, f"plus()[{i}]", text=c) if isinstance(c, str) else _as_node(c, f"plus()[{i}]")
             for i, c in enumerate(items)]
    group = Plus(children=tuple(nodes), anchor=anchor, role=None if role == "user" else role)
    mixed = mixed_group(group)
    if mixed is not None:
        raise QueryValidationError(f"plus()[{mixed[0]}]", mixed[1])
    return group


def mixed_group(group: Plus) -> tuple[int, str] | None:
    """The first `plus` directly in `group` whose own role or anchor differs from the group's, and why it is
    refused: a group's documents are one turn of one role under one anchor, so the inner one's could not be
    honoured (they were read as the outer group's, silently)."""
    for i, child in enumerate(group.children):
        if not isinstance(child, Plus):
            continue
        own = []
        if child.role != group.role:
            own.append(f"role {child.role or 'user'!r}")
        if child.anchor not in (None, group.anchor):
            own.append(f"anchor {child.anchor!r}")
        if own:
            return i, (f"a plus inside a plus is read as the outer group's documents, so its own {', '.join(own)} cannot be "
                       "honoured: give it a place of its own in the cross, as in cross(plus(..., role=\"system\"), "
                       "plus(...), user(question))")
    return None


def cross(*children: Any) -> Cross:
    """Ordered join. Strings become `User` messages; lists are spliced in."""
    items = _flatten_args(children)
    return Cross(children=tuple(_as_node(c, f"cross()[{i}]") for i, c in enumerate(items)))


def generate(
    input: Any,
    model: str = "",
    max_tokens: int = 0,
    temperature: float = DEFAULT_TEMPERATURE,
    n: int = 1,
    stop: Iterable[str] | None = None,
    seed: int | None = None,
    json_schema: dict[str, Any] | str | None = None,
    recompute: Recompute | None = None,
    cold_spans: ColdSpans | None = None,
) -> Generate:
    """A model call on `input`. `json_schema`: the answer is JSON matching this schema (`{}`: any JSON object).
    `recompute`: how much of each span a span engine computes again in context (see `Generate.recompute`);
    `cold_spans`: how it computes spans it has not cached (see `Generate.cold_spans`)."""
    if isinstance(model, _Node):  # generate(system(...), user(...)): the second message went into `model`
        raise QueryValidationError("generate(model)", f"got a {type(model).__name__} node: generate takes one input; "
                                   "join messages with cross(...), as in generate(cross(system(...), user(...)))")
    schema = json_schema if isinstance(json_schema, str) or json_schema is None else json.dumps(json_schema)
    return _built(
        Generate, "generate",
        input=_as_node(input, "generate().input"),
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        n=n,
        stop=_stops(stop, "generate(stop)"),
        seed=seed,
        json_schema=schema or "",
        recompute=_recompute(recompute, "generate(recompute)"),
        cold_spans=cold_spans,
    )


def _stops(stop: Any, where: str) -> tuple[str, ...]:
    """One stop string or several (a string is one, not its characters: "END" stopped at any E, N or D)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    try:
        stops = tuple(stop)
    except TypeError:
        raise QueryValidationError(where, f"expected a string or a list of strings, got {type(stop).__name__}") from None
    if not all(isinstance(x, str) for x in stops):
        raise QueryValidationError(where, f"expected a string or a list of strings, got {stop!r}")
    for i, x in enumerate(stops):  # (the engine refused it, naming the call, not the stop)
        if not x:
            raise QueryValidationError(f"{where}[{i}]", EMPTY_STOP)
    return stops


EMPTY_STOP = "an empty stop string (engines refuse it): leave it out"


def recompute_in_range(value: Any) -> Any:
    """`value` unless it is a share outside [0, 1] (a `ValueError`, as a pydantic validator raises): what
    `Generate.recompute` and the framework models' `recompute` accept of a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0.0 <= value <= 1.0:
        raise ValueError(f"recompute must be a share between 0 and 1, or one of {RECOMPUTE_POLICIES}; got {value}")
    return value


def _recompute(value: Any, where: str) -> Any:
    """A recompute setting as `Generate.recompute` takes it, refused here in one line (pydantic named both halves of
    its union, one of them "unable to parse string as a number"); True and False are not shares."""
    if value is None or value == "none":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
        isinstance(value, str) and value not in RECOMPUTE_POLICIES
    ):
        raise QueryValidationError(where, f"expected a share of the span blocks from 0 to 1, \"none\", or one of "
                                   f"{', '.join(RECOMPUTE_POLICIES)}; got {value!r}")
    return value


def combine(input: Any, reducer: str, **options: Any) -> Combine:
    """Combine the answers of the generates in `input` in code with the reducer named `reducer`."""
    return _built(Combine, "combine", input=_as_node(input, "combine().input"), reducer=reducer,
                  options=_as_json(options))


def repeat(query: Any, n: int) -> Repeat:
    """`n` independent runs of one generate call (spnl's `repeat`): a bulk query, each run an answer of its own
    (`ExecutionResult.answers`). One call on several inputs: `Map(inputs=(...), ...)`."""
    if not isinstance(query, Generate):
        got = type(query).__name__
        raise QueryValidationError("repeat(query)", f"expected a generate call, as repeat(generate(...), n), got {got}")
    return _built(Repeat, "repeat", n=n, query=query)


def retrieve(query: str, k: int = 4, retriever: str = "default") -> Retrieve:
    return _built(Retrieve, "retrieve", query=query, k=k, retriever=retriever)


def chat(
    *messages: Any, model: str = "", max_tokens: int = 0, temperature: float = DEFAULT_TEMPERATURE
) -> Chat:
    items = _flatten_args(messages)
    if not items:
        raise QueryValidationError("chat()", "a chat needs at least one message")
    return _built(
        Chat, "chat",
        messages=tuple(_as_node(m, f"chat()[{i}]") for i, m in enumerate(items)),
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
    )


# --------------------------------------------------------------------------------------------- traversal


def children_of(node: Node) -> tuple[Node, ...]:
    """The direct sub-queries of a node, as its class declares them (`CHILD_FIELD`)."""
    if node.CHILD_FIELD is None:
        return ()
    held = getattr(node, node.CHILD_FIELD[0])
    return held if isinstance(held, tuple) else (held,)


def with_children(node: Node, children: Iterable[Node]) -> Node:
    """A copy of `node` with its direct sub-queries replaced (the inverse of `children_of`); `node` itself when
    they are the same objects."""
    kids = tuple(children)
    if node.CHILD_FIELD is None:
        if kids:
            raise ValueError(f"{type(node).__name__} has no children")
        return node
    name = node.CHILD_FIELD[0]
    held = getattr(node, name)
    if isinstance(held, tuple):
        same = len(kids) == len(held) and all(k is h for k, h in zip(kids, held, strict=True))
        return node if same else node.model_copy(update={name: kids})
    if len(kids) != 1:
        raise ValueError(f"{type(node).__name__} has exactly one child ({name}), got {len(kids)}")
    return node if kids[0] is held else node.model_copy(update={name: kids[0]})


def child_paths(node: Node, path: str = "$") -> Iterator[tuple[str, Node]]:
    """The direct sub-queries of a node with their JSON-style paths (`$.g.input`, `$.plus[2]`)."""
    if node.CHILD_FIELD is None:
        return
    name, spelling = node.CHILD_FIELD
    base = f"{path}.{node.tag}" + (f".{spelling}" if spelling else "")
    held = getattr(node, name)
    if isinstance(held, tuple):
        for i, child in enumerate(held):
            yield f"{base}[{i}]", child
    else:
        yield base, held


def transform(node: Node, fn: Callable[[Node], Node]) -> Node:
    """Rebuild the tree bottom-up, applying `fn` to every node after its children."""
    kids = children_of(node)
    if kids:
        node = with_children(node, [transform(k, fn) for k in kids])
    return fn(node)


def walk(node: Node, path: str = "$") -> Iterator[tuple[str, Node]]:
    """Every node with its JSON-style path (the same paths errors name), parents first."""
    yield path, node
    for child_path, child in child_paths(node, path):
        yield from walk(child, child_path)


# --------------------------------------------------------------------------------------------- rendering


def _clip(text: str, width: int = 60) -> str:
    one = " ".join(text.split())
    return one if len(one) <= width else one[: width - 1] + "…"


def render(node: Node) -> str:
    """A readable, indented tree of the query, one node a line."""
    lines: list[str] = []

    def go(n: Node, prefix: str, last: bool, root: bool) -> None:
        lines.append(n.label() if root else f"{prefix}{'└─ ' if last else '├─ '}{n.label()}")
        kids = children_of(n)
        sub = "" if root else prefix + ("   " if last else "│  ")
        for i, k in enumerate(kids):
            go(k, sub, i == len(kids) - 1, False)

    go(node, "", True, True)
    return "\n".join(lines)
