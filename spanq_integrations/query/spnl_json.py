"""spnl-compatible JSON for span queries: `to_json` / `from_json`, and `dumps` / `loads` / `load_file` for text.

The format is spnl's externally tagged one (`{"g": {...}}`, `{"plus": [...]}`, `{"user": "..."}`, bulk `repeat`
and `map`, `zip`, `monad`, `print`): every node spnl 0.22 parses is read (`zip` expanded into the tree it
stands for; the optional `augment` refused by name), and `repeat` is written in spnl 0.22's `{"n", "g"}` form; spanq's own nodes (`fragment`, `chat`, `retrieve`, an
`assistant` that remembers the `g` it came from) follow the same style. Reading checks every field and names the
JSON path of the first problem (`$.g.input.cross[2]: unknown node "usr" ...`) in a `QueryParseError`.
Writing is lossless: `from_json(to_json(q)) == q` for every tree whose joins and chats are non-empty.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from spanq_integrations.query.errors import QueryParseError, QueryValidationError
from spanq_integrations.query.ir import (
    ANCHOR_POLICIES,
    COLD_SPAN_POLICIES,
    DEFAULT_TEMPERATURE,
    EMPTY_STOP,
    RECOMPUTE_POLICIES,
    SPAN_ROLES,
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
    child_paths,
    children_of,
    mixed_group,
)

__all__ = ["dumps", "from_json", "load_file", "loads", "refuse_a_string", "to_json"]

# ------------------------------------------------------------------------------------------------- writing


def to_json(node: Node) -> dict[str, Any]:
    """The spnl JSON document of a query (a plain dict, ready for `json.dumps`)."""
    return _write(node, "$")


def dumps(node: Node, indent: int | None = 2) -> str:
    """The spnl JSON text of a query."""
    return json.dumps(to_json(node), indent=indent, ensure_ascii=False)


def _write_settings(model: str, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature}


def _write_children(node: Node, path: str) -> list[dict[str, Any]]:
    return [_write(child, child_path) for child_path, child in child_paths(node, path)]


def _write_generate_body(g: Generate, path: str) -> dict[str, Any]:
    """The body of a `g` at `path` (the path of the `g` node itself)."""
    body = _write_settings(g.model, g.max_tokens, g.temperature)
    if g.n != 1:
        body["n"] = g.n
    if g.stop:
        body["stop"] = list(g.stop)
    if g.seed is not None:
        body["seed"] = g.seed
    if g.json_schema:
        body["json_schema"] = g.schema  # spanq's own key: spnl has no structured output
    if g.recompute is not None:
        body["recompute"] = g.recompute  # spanq's own key
    if g.cold_spans is not None:
        body["cold_spans"] = g.cold_spans  # spanq's own key
    (body["input"],) = _write_children(g, path)
    return body


def _write_assistant(node: Assistant, path: str) -> dict[str, Any]:
    if node.source is None:
        return {"assistant": node.text}
    return {"assistant": {"text": node.text, "source": _write(node.source, f"{path}.assistant.source")}}


def _write_fragment(node: Fragment, path: str) -> dict[str, Any]:
    if node.id is None and not node.metadata:
        return {"fragment": node.text}
    body: dict[str, Any] = {"text": node.text}
    if node.id is not None:
        body["id"] = node.id
    if node.metadata:
        body["metadata"] = _json_object(node.metadata, f"{path}.fragment.metadata")
    return {"fragment": body}


def _write_join(node: Plus | Cross, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {node.tag: _write_children(node, path)}
    if getattr(node, "anchor", None) is not None:
        out["anchor"] = node.anchor  # type: ignore[union-attr]  # spanq's extension: a sibling key of the join
    if getattr(node, "role", None) is not None:
        out["role"] = node.role  # type: ignore[union-attr]  # the same
    return out


def _write_chat(node: Chat, path: str) -> dict[str, Any]:
    if not node.messages:
        raise QueryValidationError(path, "a chat with no messages cannot be written")
    settings = _write_settings(node.model, node.max_tokens, node.temperature)
    return {"chat": {**settings, "messages": _write_children(node, path)}}


def _write_combine(node: Combine, path: str) -> dict[str, Any]:
    (written,) = _write_children(node, path)
    body: dict[str, Any] = {"reducer": node.reducer, "input": written}
    if node.options:
        body["options"] = _json_object(node.options, f"{path}.combine.options")
    return {"combine": body}


def _json_object(value: dict[str, Any], path: str) -> dict[str, Any]:
    """A node's free-form object (metadata, options) as written, or what JSON cannot hold in it named at `path` (an
    object, NaN: Python's json wrote a bare NaN, which no JSON reader takes)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise QueryValidationError(path, f"cannot be written as JSON: {e}") from None
    return dict(value)


def _write_repeat(node: Repeat, path: str) -> dict[str, Any]:
    ((generate_path, generate),) = child_paths(node, path)
    return {"repeat": {"n": node.n, "g": _write_generate_body(generate, generate_path)}}  # type: ignore[arg-type]


_WRITERS: dict[type, Callable[[Any, str], dict[str, Any]]] = {
    System: lambda node, path: {"system": node.text},
    User: lambda node, path: {"user": node.text},
    Assistant: _write_assistant,
    Fragment: _write_fragment,
    Generate: lambda node, path: {"g": _write_generate_body(node, path)},
    Plus: _write_join,
    Cross: _write_join,
    Chat: _write_chat,
    Retrieve: lambda node, path: {"retrieve": {"query": node.query, "k": node.k, "retriever": node.retriever}},
    Repeat: _write_repeat,
    Map: lambda node, path: {
        "map": {"metadata": _write_settings(node.model, node.max_tokens, node.temperature), "inputs": list(node.inputs)}
    },
    Combine: _write_combine,
    Monad: lambda node, path: {"monad": _write_children(node, path)[0]},
    Print: lambda node, path: {"print": node.text},
}
"""How each node class is written (its children through `child_paths`, so their paths are `walk`'s)."""


def _write(node: Node, path: str) -> dict[str, Any]:
    writer = _WRITERS.get(type(node))
    if writer is None:
        raise QueryValidationError(path, f"not a query node: {type(node).__name__}")
    return writer(node, path)


# ------------------------------------------------------------------------------------------------- reading


def from_json(doc: dict[str, Any] | str) -> Node:
    """The query of a spnl JSON document: a parsed object, or JSON text."""
    if isinstance(doc, str):
        return loads(doc)
    _check_text(doc)
    try:
        query = _read_node(doc, "$")
    except RecursionError:
        raise QueryParseError("$", "the document is nested too deeply to read") from None
    size = _tree_size(query)
    if size > MAX_QUERY_NODES:  # zips nested under each other stay under each one's limit, not under this
        raise QueryParseError("$", f"the query expands to {size} query nodes, over {MAX_QUERY_NODES}")
    return query


def loads(text: str | bytes) -> Node:
    """The query of a spnl JSON text."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise QueryParseError("$", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise QueryParseError("$", f"the text is not UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise QueryParseError("$", "the document is nested too deeply to read") from None
    refuse_a_string(doc, "write")
    return from_json(doc)


def refuse_a_string(doc: Any, verb: str) -> None:
    """A JSON document that is a string is no query node: refused by name, before `from_json`, which would read the
    string as JSON text again (a query encoded twice would pass as the query). `verb`: what the user does with the
    query's JSON ("write" a file, "send" a body)."""
    if isinstance(doc, str):
        raise QueryParseError("$", f"expected a query node (a JSON object), got a string: {verb} the query's JSON "
                              "itself, not a string that holds it")


def load_file(path: str | os.PathLike[str]) -> Node:
    """The query of a spnl JSON file."""
    with open(path, "rb") as f:
        return loads(f.read())


_Reader = Callable[[Any, str], Node]


def _check_text(doc: Any) -> None:
    """Refuse strings that are not Unicode text (a lone surrogate, which JSON's `\\ud800` escapes allow): no
    tokenizer reads them and no answer could carry them back. One walk, without recursion."""
    stack: list[tuple[Any, str]] = [(doc, "$")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise QueryParseError(path, f"not valid Unicode text (a lone surrogate at index {e.start})") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, f"{path}.{key}" if isinstance(key, str) else path))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _read_node(value: Any, path: str) -> Node:
    if not isinstance(value, dict):
        raise QueryParseError(
            path,
            f"expected a query node (an object with one key, one of: {_NODE_KEYS}), got {_json_type(value)}",
        )
    if 2 <= len(value) <= 3 and len({"plus", "par"} & set(value)) == 1 and set(value) - {"plus", "par"} <= {"anchor", "role"}:
        return _read_anchored_plus(value, path)
    if len(value) != 1:
        keys = ", ".join(json.dumps(k) for k in value)
        raise QueryParseError(
            path,
            f"a query node is an object with exactly one key naming its kind, got {len(value)} keys ({keys})",
        )
    ((key, body),) = value.items()
    reader = _READERS.get(key)
    if reader is None:
        raise QueryParseError(path, f"unknown node {json.dumps(key)} (expected one of: {_NODE_KEYS})")
    return reader(body, f"{path}.{key}")


def _object(value: Any, path: str, fields: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise QueryParseError(path, f"expected an object, got {_json_type(value)}")
    for key in value:
        if key not in fields:
            raise QueryParseError(path, f"unknown field {json.dumps(key)} (expected: {', '.join(fields)})")
    for key in required:
        if key not in value:
            raise QueryParseError(path, f'missing "{key}"')
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise QueryParseError(path, f"expected a string, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    """A JSON value's type, with the value itself when it is a short scalar."""
    if isinstance(value, (dict, list)) or value is None:
        return _json_type(value)
    shown = json.dumps(value, ensure_ascii=False)
    return f"{_json_type(value)} {shown}" if len(shown) <= 40 else _json_type(value)


def _integer(value: Any, path: str, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise QueryParseError(path, f"expected an integer, got {_describe(value)}")
    if minimum is not None and value < minimum:
        raise QueryParseError(path, f"must be >= {minimum}, got {value}")
    return value


def _number(value: Any, path: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QueryParseError(path, f"expected a number, got {_describe(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        finite = False
    if not finite:
        raise QueryParseError(path, f"must be a finite number no larger than {sys.float_info.max:g}, got {_describe(value)}")
    if value < minimum:
        raise QueryParseError(path, f"must be >= {minimum:g}, got {value:g}")
    return float(value)


def _array(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise QueryParseError(path, f"expected an array, got {_json_type(value)}")
    return value


def _settings(body: dict[str, Any], path: str) -> dict[str, Any]:
    """`model`, `max_tokens` and `temperature`, with spnl's defaults for absent fields.

    Here and below, an optional field that is null counts as absent: spnl writes its optional settings either way.
    """
    model, max_tokens, temperature = (body.get(k) for k in ("model", "max_tokens", "temperature"))
    if model is not None:
        model = _string(model, f"{path}.model")
    if max_tokens is not None:
        max_tokens = _integer(max_tokens, f"{path}.max_tokens", 0)
    if temperature is not None:
        temperature = _number(temperature, f"{path}.temperature", 0)
    return {
        "model": "" if model is None else model,
        "max_tokens": 0 if max_tokens is None else max_tokens,
        "temperature": DEFAULT_TEMPERATURE if temperature is None else temperature,
    }


def _build(cls: type[BaseModel], path: str, under: str = "", settings: tuple[str, ...] = (), **fields: Any) -> Node:
    """Construct a node; the checks above make a ValidationError unlikely, but one still becomes a parse error.
    `settings`: fields the JSON holds in the object `under` (a map's `metadata`), where the error points."""
    try:
        return cls(**fields)  # type: ignore[return-value]
    except (ValidationError, QueryValidationError) as refused:
        e = refused.__cause__ if isinstance(refused, QueryValidationError) else refused  # (Map's: pydantic's inside)
        if not isinstance(e, ValidationError):
            raise
        first = e.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        if first["loc"] and first["loc"][0] in settings:
            where = f".{under}{where}"
        raise QueryParseError(f"{path}{where}", first["msg"]) from None


def _children(value: Any, path: str, if_empty: str | None) -> tuple[Node, ...]:
    """The nodes of an array; none is `if_empty`'s error (None: allowed)."""
    items = _array(value, path)
    if not items and if_empty is not None:
        raise QueryParseError(path, if_empty)
    return tuple(_read_node(item, f"{path}[{i}]") for i, item in enumerate(items))


_G_FIELDS = (
    "model", "max_tokens", "temperature", "n", "stop", "seed", "json_schema", "recompute", "cold_spans", "input",
)


def _read_generate_body(value: Any, path: str) -> Generate:
    body = _object(value, path, _G_FIELDS, required=("input",))
    n, stop, seed = (body.get(k) for k in ("n", "stop", "seed"))
    # one stop string, as OpenAI's API also takes it, or an array of them (what spanq writes)
    stop_items = [] if stop is None else ([stop] if stop else []) if isinstance(stop, str) else _array(stop, f"{path}.stop")
    return _build(  # type: ignore[return-value]
        Generate,
        path,
        input=_read_node(body["input"], f"{path}.input"),
        **_settings(body, path),
        n=1 if n is None else _integer(n, f"{path}.n", 1),
        stop=tuple(_stop(s, f"{path}.stop[{i}]") for i, s in enumerate(stop_items)),
        seed=None if seed is None else _integer(seed, f"{path}.seed", None),
        json_schema=_json_schema(body.get("json_schema"), f"{path}.json_schema"),
        recompute=_recompute(body.get("recompute"), f"{path}.recompute"),
        cold_spans=_cold_spans(body.get("cold_spans"), f"{path}.cold_spans"),
    )


def _stop(value: Any, path: str) -> str:
    """One stop string of a list: a string, not empty (the engine refused it, naming the call)."""
    text = _string(value, path)
    if not text:
        raise QueryParseError(path, EMPTY_STOP)
    return text


def _cold_spans(value: Any, path: str) -> Any:
    if value is None:
        return None
    if value not in COLD_SPAN_POLICIES:
        raise QueryParseError(path, f"expected one of {list(COLD_SPAN_POLICIES)}, got {_describe(value)}")
    return value


def _recompute(value: Any, path: str) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        if value == "none":  # as `spanq serve --recompute none` says 0
            return 0.0
        if value not in RECOMPUTE_POLICIES:
            raise QueryParseError(path, f"expected a share between 0 and 1, 'none' or one of {list(RECOMPUTE_POLICIES)}, "
                                  f"got {value!r}")
        return value
    share = _number(value, path, 0)
    if share > 1:
        raise QueryParseError(path, f"a share of the span blocks is at most 1, got {share}")
    return share


def _json_schema(value: Any, path: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise QueryParseError(path, f"expected a JSON schema (an object), got {type(value).__name__}")
    return json.dumps(value)


def _read_g_node(value: Any, path: str) -> Generate:
    node = _read_node(value, path)
    if not isinstance(node, Generate):
        raise QueryParseError(path, f'expected a "g" node, got "{next(iter(value))}"')
    return node


def _read_join(cls: type[Plus | Cross], keyword: str) -> _Reader:
    return lambda value, path: _build(
        # an empty join is read, as spnl reads it (a RAG template whose retriever found nothing): it adds nothing
        cls, path, children=_children(value, path, None), keyword=keyword
    )


def _read_anchored_plus(value: dict[str, Any], path: str) -> Node:
    """`{"plus": [...], "anchor": "template", "role": "system"}`: spanq's extension of spnl's join, naming the
    anchor policy, the role of the message its children are content of, or both."""
    (key,) = {"plus", "par"} & set(value)
    update: dict[str, Any] = {}
    if "anchor" in value:
        anchor = _string(value["anchor"], f"{path}.anchor")
        if anchor not in ANCHOR_POLICIES:
            raise QueryParseError(f"{path}.anchor", f"unknown anchor policy {json.dumps(anchor)} (one of: {', '.join(ANCHOR_POLICIES)})")
        update["anchor"] = anchor
    if "role" in value:
        role = _string(value["role"], f"{path}.role")
        if role not in SPAN_ROLES:
            raise QueryParseError(f"{path}.role", f"unknown role {json.dumps(role)} for a plus (one of: {', '.join(SPAN_ROLES)})")
        update["role"] = None if role == "user" else role
    node = _read_join(Plus, key)(value[key], f"{path}.{key}")
    return _one_group(node.model_copy(update=update), f"{path}.{key}")


def _read_plain_plus(keyword: str) -> _Reader:
    return lambda value, path: _one_group(_read_join(Plus, keyword)(value, path), path)  # type: ignore[arg-type]


def _one_group(group: Plus, path: str) -> Plus:
    """`group`, unless a `plus` in it names a role or an anchor of its own (`ir.mixed_group`)."""
    mixed = mixed_group(group)
    if mixed is not None:
        raise QueryParseError(f"{path}[{mixed[0]}]", mixed[1])
    return group


def _read_message(cls: type[System | User]) -> _Reader:
    return lambda value, path: _build(cls, path, text=_string(value, path))


def _read_assistant(value: Any, path: str) -> Node:
    if isinstance(value, str):
        return Assistant(text=value)
    if not isinstance(value, dict):
        raise QueryParseError(
            path, f'expected a string or an object {{"text", "source"}}, got {_describe(value)}'
        )
    body = _object(value, path, ("text", "source"), required=("text",))
    source = body.get("source")
    return _build(
        Assistant,
        path,
        text=_string(body["text"], f"{path}.text"),
        source=None if source is None else _read_source(source, f"{path}.source"),
    )


def _read_source(value: Any, path: str) -> Generate | Combine:
    node = _read_node(value, path)
    if not isinstance(node, (Generate, Combine)):
        raise QueryParseError(path, f'expected a "g" or "combine" node, got "{next(iter(value))}"')
    return node


def _read_combine(value: Any, path: str) -> Node:
    """`{"reducer": "extract", "input": {...}, "options": {...}}`: spanq's code-side combine of judges."""
    body = _object(value, path, ("reducer", "input", "options"), required=("reducer", "input"))
    return _build(
        Combine,
        path,
        reducer=_string(body["reducer"], f"{path}.reducer"),
        input=_read_node(body["input"], f"{path}.input"),
        options=_optional_object(body.get("options"), f"{path}.options"),
    )


def _optional_object(value: Any, path: str) -> dict[str, Any]:
    """A free-form JSON object (metadata, options); absent is empty."""
    if value is not None and not isinstance(value, dict):
        raise QueryParseError(path, f"expected an object, got {_json_type(value)}")
    return dict(value or {})


def _read_fragment(value: Any, path: str) -> Node:
    if isinstance(value, str):
        return Fragment(text=value)
    if not isinstance(value, dict):
        expected = 'a string or an object {"text", "id", "metadata"}'
        raise QueryParseError(path, f"expected {expected}, got {_describe(value)}")
    body = _object(value, path, ("text", "id", "metadata"), required=("text",))
    ident = body.get("id")
    return _build(
        Fragment,
        path,
        text=_string(body["text"], f"{path}.text"),
        id=None if ident is None else _string(ident, f"{path}.id"),
        metadata=_optional_object(body.get("metadata"), f"{path}.metadata"),
    )


def _read_chat(value: Any, path: str) -> Node:
    body = _object(value, path, ("model", "max_tokens", "temperature", "messages"), required=("messages",))
    return _build(
        Chat,
        path,
        messages=_children(body["messages"], f"{path}.messages", "a chat needs at least one message"),
        **_settings(body, path),
    )


def _read_retrieve(value: Any, path: str) -> Node:
    body = _object(value, path, ("query", "k", "retriever"), required=("query",))
    k, retriever = body.get("k"), body.get("retriever")
    return _build(
        Retrieve,
        path,
        query=_string(body["query"], f"{path}.query"),
        k=4 if k is None else _integer(k, f"{path}.k", 1),
        retriever="default" if retriever is None else _string(retriever, f"{path}.retriever"),
    )


def _read_repeat(value: Any, path: str) -> Node:
    """`{"n", "g": {...}}` (spnl 0.22), `{"n", "query": {"g": {...}}}` (older spnl) or `{"n", "generate": {...}}`."""
    body = _object(value, path, ("n", "g", "query", "generate"), required=("n",))
    forms = [key for key in ("g", "query", "generate") if key in body]
    if len(forms) != 1:
        found = f"got {', '.join(json.dumps(f) for f in forms)}" if forms else "got none"
        raise QueryParseError(path, f'expected exactly one of "g", "query" or "generate" ({found})')
    (form,) = forms
    where = f"{path}.{form}"
    query = _read_g_node(body[form], where) if form == "query" else _read_generate_body(body[form], where)
    return _build(Repeat, path, n=_integer(body["n"], f"{path}.n", 1), query=query)


def _read_map(value: Any, path: str) -> Node:
    body = _object(value, path, ("metadata", "inputs"), required=("inputs",))
    metadata = body.get("metadata")
    if metadata is not None:
        metadata = _object(metadata, f"{path}.metadata", ("model", "max_tokens", "temperature"))
    settings = _settings(metadata or {}, f"{path}.metadata")
    inputs = _array(body["inputs"], f"{path}.inputs")
    texts = tuple(_string(s, f"{path}.inputs[{i}]") for i, s in enumerate(inputs))
    return _build(Map, path, "metadata", tuple(settings), inputs=texts, **settings)


ZIP_MAX_NODES = 1 << 16  # query nodes a zip may expand to
MAX_QUERY_NODES = 1 << 16  # query nodes a whole document may expand to (what every later walk of it visits)


def _tree_size(node: Node) -> int:
    """Nodes of the tree `node` is, a subtree shared by several parents counted once per parent (what a walk of
    the expanded tree visits), in time linear in the distinct nodes."""
    sizes: dict[int, int] = {}

    def size(n: Node) -> int:
        if id(n) not in sizes:
            sizes[id(n)] = 1 + sum(size(c) for c in children_of(n))
        return sizes[id(n)]

    return size(node)


def _generates(node: Node) -> bool:
    """Whether the tree holds a node that generates; a subtree shared by several parents (a zip's expansion) is
    looked at once."""
    seen: set[int] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, (Generate, Repeat, Map, Chat, Combine)):
            return True
        todo.extend(children_of(n))
    return False


def _read_zip(value: Any, path: str) -> Node:
    """`{"zip": {"first": A, "second": B}}` (spnl 0.22): A put before every item of B, read as the tree spnl's
    executor builds from it. B a join: each of its children gets A in front (`[A, b1, A, b2, ...]` in B's join;
    where A is a `plus`, each child joins A's group instead: `plus[...A, b_i]`); B a message or a `g`: A then B.
    The zip is expanded here, so it is written back expanded. spnl runs A once and copies its output; an
    expansion would run a `g` in A once per copy, so that is refused, as are B kinds spnl cannot zip either."""
    body = _object(value, path, ("first", "second"), required=("first", "second"))
    first = _read_node(body["first"], f"{path}.first")
    second = _read_node(body["second"], f"{path}.second")
    if isinstance(second, (Plus, Cross)):
        items = second.children
    elif isinstance(second, (System, User, Assistant, Generate, Fragment)):
        items = (second,)
    else:
        raise QueryParseError(
            f"{path}.second",
            f'cannot zip into a "{second.kind}" (expected a join, a message or a "g": the items A goes before)',
        )
    expanded = len(items) * (_tree_size(first) + 1)
    if expanded > ZIP_MAX_NODES:  # checked before anything is expanded (or walked): nesting zips doubles each time
        raise QueryParseError(path, f"the zip expands to {expanded} query nodes, over {ZIP_MAX_NODES}")
    if len(items) > 1 and _generates(first):
        raise QueryParseError(
            f"{path}.first",
            "a zip whose first part generates would run that generation once per item of the second "
            "(spnl runs it once and copies its answer); generate it in its own query and zip its answer",
        )
    if isinstance(first, Plus):
        spread: list[Node] = [first.model_copy(update={"children": (*first.children, b)}) for b in items]
    else:
        spread = [n for b in items for n in (first, b)]
    if isinstance(second, (Plus, Cross)):
        return second.model_copy(update={"children": tuple(spread)})
    return spread[0] if len(spread) == 1 else Cross(children=tuple(spread), keyword="seq")


def _read_augment(value: Any, path: str) -> Node:
    raise QueryParseError(
        path,
        '"augment" (spnl\'s optional rag feature: embed a document and retrieve from it) is not run by spanq; '
        'register a retriever and use {"retrieve": {"query", "k", "retriever"}} instead',
    )


_READERS: dict[str, _Reader] = {
    "g": _read_generate_body,
    "seq": _read_join(Cross, "seq"),
    "cross": _read_join(Cross, "cross"),
    "par": _read_plain_plus("par"),
    "plus": _read_plain_plus("plus"),
    "system": _read_message(System),
    "user": _read_message(User),
    "assistant": _read_assistant,
    "fragment": _read_fragment,
    "chat": _read_chat,
    "retrieve": _read_retrieve,
    "repeat": _read_repeat,
    "map": _read_map,
    "combine": _read_combine,
    "monad": lambda value, path: Monad(query=_read_node(value, path)),
    "print": lambda value, path: Print(text=_string(value, path)),
    "zip": _read_zip,
    "augment": _read_augment,
}
_NODE_KEYS = ", ".join(sorted(k for k in _READERS if k != "augment"))  # augment is read only to refuse it
