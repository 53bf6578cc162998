"""What spnl 0.22 accepts, written down for the tests: a reader with the rules of spnl-core 0.22's serde types.

spnl's `Query` is an externally tagged enum (kebab-case: `seq`, `par`, `cross`, `plus`, `monad`, `g`, `print`,
`zip`, and `augment` with its optional rag feature), with two untagged members: bulk (`repeat`, `map`) and
messages (`user`, `system`, `assistant`, each a string). serde ignores unknown fields of a struct, requires every
field that has no default, and takes an absent `Option` as none. `Generate` flattens its metadata: `model` is
required, `max_tokens` / `temperature` are optional; `Repeat` is `{"n": u8, "g": Generate}`; `Map` is
`{"metadata": GenerateMetadata, "inputs": [str]}`; `Zip` is `{"first": Query, "second": Query}`.

`spnl_reads(doc)` raises `SpnlRejects` naming the path where spnl's parser would fail (the Rust sources are not
built here: no crates registry on this machine).
"""

from __future__ import annotations

import json
from typing import Any


class SpnlRejects(ValueError):
    pass


_JOINS = ("seq", "par", "cross", "plus")
_MESSAGES = ("user", "system", "assistant")


def spnl_reads(doc: Any, path: str = "$") -> None:
    if not isinstance(doc, dict) or len(doc) != 1:
        raise SpnlRejects(f"{path}: a query is an object with one key")
    ((key, body),) = doc.items()
    where = f"{path}.{key}"
    if key in _JOINS:
        if not isinstance(body, list):
            raise SpnlRejects(f"{where}: expected a list")
        for i, item in enumerate(body):
            spnl_reads(item, f"{where}[{i}]")
    elif key in _MESSAGES or key == "print":
        if not isinstance(body, str):
            raise SpnlRejects(f"{where}: expected a string")
    elif key == "monad":
        spnl_reads(body, where)
    elif key == "g":
        _generate(body, where)
    elif key == "zip":
        _struct(body, where, ("first", "second"))
        spnl_reads(body["first"], f"{where}.first")
        spnl_reads(body["second"], f"{where}.second")
    elif key == "repeat":
        _struct(body, where, ("n", "g"))
        n = body["n"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 255:
            raise SpnlRejects(f"{where}.n: expected a u8")
        _generate(body["g"], f"{where}.g")
    elif key == "map":
        _struct(body, where, ("metadata", "inputs"))
        _metadata(body["metadata"], f"{where}.metadata")
        if not isinstance(body["inputs"], list) or not all(isinstance(s, str) for s in body["inputs"]):
            raise SpnlRejects(f"{where}.inputs: expected a list of strings")
    else:
        raise SpnlRejects(f"{path}: unknown variant {key!r}")


def _struct(body: Any, path: str, required: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise SpnlRejects(f"{path}: expected an object")
    for field in required:
        if field not in body:
            raise SpnlRejects(f"{path}: missing field {field!r}")


def _metadata(body: Any, path: str) -> None:
    _struct(body, path, ("model",))
    if not isinstance(body["model"], str):
        raise SpnlRejects(f"{path}.model: expected a string")
    for field, kind in (("max_tokens", int), ("temperature", (int, float))):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise SpnlRejects(f"{path}.{field}: expected a number")


def _generate(body: Any, path: str) -> None:
    _metadata(body, path)
    _struct(body, path, ("input",))
    spnl_reads(body["input"], f"{path}.input")


# ------------------------------------------------------------------------------------------------ answers
# What spnl 0.22's client (spnl-run's `spnl` backend) reads back, with async-openai's types: required fields
# must be there with their types; `Option` fields may be absent or null; finish reasons are closed enums.

_COMPLETION_FINISH = (None, "stop", "length", "content_filter")
_CHAT_FINISH = (None, "stop", "length", "tool_calls", "content_filter", "function_call")


def _envelope(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise SpnlRejects("an answer is an object")
    for field, kind in (("id", str), ("object", str), ("model", str), ("choices", list)):
        if not isinstance(doc.get(field), kind):
            raise SpnlRejects(f"answer field {field!r} missing or not a {kind.__name__}")
    created = doc.get("created")
    if isinstance(created, bool) or not isinstance(created, int) or not 0 <= created < 2**32:
        raise SpnlRejects("answer field 'created' missing or not a u32")
    usage = doc.get("usage")
    if usage is not None:
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if not isinstance(usage.get(field), int):
                raise SpnlRejects(f"usage.{field} missing or not an integer")


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SpnlRejects("choice index missing or not a u32")
    return index


def read_completion(doc: Any) -> list[str]:
    """A `CreateCompletionResponse`: the choices' texts (spnl's non-streamed `map`)."""
    _envelope(doc)
    texts = []
    for choice in doc["choices"]:
        if not isinstance(choice.get("text"), str) or choice.get("finish_reason") not in _COMPLETION_FINISH:
            raise SpnlRejects(f"not a completion choice: {choice!r}")
        _index(choice)
        texts.append(choice["text"])
    return texts


def read_chat_completion(doc: Any) -> list[str]:
    """A `CreateChatCompletionResponse`: the choices' message contents (spnl's non-streamed `repeat` / `g`)."""
    _envelope(doc)
    texts = []
    for choice in doc["choices"]:
        message = choice.get("message")
        if (
            not isinstance(message, dict)
            or message.get("role") not in ("system", "user", "assistant", "tool", "function")
            or choice.get("finish_reason") not in _CHAT_FINISH
        ):
            raise SpnlRejects(f"not a chat completion choice: {choice!r}")
        _index(choice)
        if isinstance(message.get("content"), str):  # spnl keeps the choices that have content
            texts.append(message["content"])
    return texts


def read_completion_stream(body: bytes, n: int) -> list[str]:
    """The texts spnl's client assembles from a streamed answer: `data: ` lines, `[DONE]` skipped, each event
    read as a `CreateCompletionResponse` (one that does not parse is skipped, as spnl does), text appended per
    choice index below `n`."""
    texts = [""] * n
    for raw in body.split(b"\n"):
        line = raw.removesuffix(b"\r")
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            chunk = json.loads(line[len(b"data: "):])
            read_completion(chunk)
        except (ValueError, SpnlRejects):
            continue
        for choice in chunk["choices"]:
            if choice["index"] < n:
                texts[choice["index"]] += choice["text"]
    return texts
