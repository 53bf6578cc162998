"""A prompt as messages of text and order-free pieces, and finding documents in it: what both adapters send.

`PromptMessage`s hold text and `SpanPiece`s (a retrieved document, a candidate); `query_input` turns them into a
`Generate` input (each run of adjacent pieces one `plus` of fragments on a span-aware backend, plain messages
elsewhere). `split_at_documents` finds documents verbatim in an ordinary prompt and cuts it around them, where
that is safe, or says why not: how LangChain's and LlamaIndex's unchanged chains get their documents sent as
spans with only the LLM swapped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from spanq_integrations.query.errors import QueryValidationError
from spanq_integrations.query.flatten import BLOCK_SEPARATOR
from spanq_integrations.query.ir import AnchorPolicy, Assistant, Cross, Fragment, Node, Plus, System, User

__all__ = [
    "PromptMessage",
    "Role",
    "SpanCandidate",
    "SpanPiece",
    "prompt_from_text",
    "query_input",
    "span_count",
    "split_at_documents",
    "with_instruction",
]

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class SpanPiece:
    """An order-free piece of a message: a retrieved document, a candidate."""

    text: str
    id: str | None = None


@dataclass
class PromptMessage:
    """One message of the prompt: its role and its pieces, text and spans, in order."""

    role: Role
    parts: list[str | SpanPiece] = field(default_factory=list)


@dataclass(frozen=True)
class SpanCandidate:
    """A text that may be found verbatim in a prompt and cut out as a span (a document, formatted or not)."""

    text: str
    id: str | None = None

    @property
    def label(self) -> str:
        if self.id:
            return repr(self.id)
        clipped = " ".join(self.text.split())
        return repr(clipped if len(clipped) <= 40 else clipped[:39] + "…")


def with_instruction(prompt: list[PromptMessage], text: str) -> list[PromptMessage]:
    """`prompt` with `text` at the end of its first system message (one is added first where there is none:
    many chat templates take one system message only, at the start)."""
    if prompt and prompt[0].role == "system":
        first = PromptMessage("system", [*prompt[0].parts, "\n\n" + text])
        return [first, *prompt[1:]]
    return [PromptMessage("system", [text]), *prompt]


def prompt_from_text(text: str) -> list[PromptMessage]:
    """The prompt of a completion-style (`SpanQueryLLM`) call: the text as one user turn."""
    return [PromptMessage("user", [text])]


def span_count(prompt: Sequence[PromptMessage]) -> int:
    return sum(isinstance(p, SpanPiece) for m in prompt for p in m.parts)


# --------------------------------------------------------------------------------------------- to the IR

_NODE = {"system": System, "user": User, "assistant": Assistant}


def query_input(prompt: Sequence[PromptMessage], *, span_aware: bool, anchor: AnchorPolicy | None = None) -> Node:
    """The `Generate` input for `prompt`.

    Span-aware backends get each run of adjacent spans as one `plus` of fragments (whitespace between spans
    does not break a run), content of the message it was found in (a system message's documents stay there). Any other backend gets plain messages: each message's pieces joined (spans
    separated from their neighbours by a blank line), so an ordinary server receives nothing it could reject.
    """
    nodes: list[Node] = []
    for m in prompt:
        make = _NODE[m.role]
        if not span_aware:
            text = ""
            for i, part in enumerate(m.parts):
                piece = part.text if isinstance(part, SpanPiece) else part
                if i and (isinstance(part, SpanPiece) or isinstance(m.parts[i - 1], SpanPiece)):
                    text = text.rstrip() + BLOCK_SEPARATOR + piece.lstrip()
                else:
                    text += piece
            if text.strip():
                nodes.append(make(text=text))
            continue
        run: list[Node] = []
        role = "system" if m.role == "system" else None  # documents in a system prompt stay system content
        for part in m.parts:
            if isinstance(part, SpanPiece):
                if part.text.strip():
                    run.append(Fragment(text=part.text, id=part.id))
                continue
            if not part.strip():
                continue
            if run:
                nodes.append(Plus(children=tuple(run), anchor=anchor, role=role))
                run = []
            nodes.append(make(text=part))
        if run:
            nodes.append(Plus(children=tuple(run), anchor=anchor, role=role))
    if not nodes:
        raise QueryValidationError("messages", "every message is empty: nothing to send to the model")
    return Cross(children=tuple(nodes))


# --------------------------------------------------------------------------------------------- documents


def _boundary_before(text: str) -> bool:
    head = text.rstrip(" \t")
    return not head or head.endswith(("\n", ":"))


def _boundary_after(text: str) -> bool:
    tail = text.lstrip(" \t")
    return not tail or tail.startswith("\n")


LANGCHAIN_FIX = "format them with format_docs_as_spans"


def split_at_documents(
    prompt: Sequence[PromptMessage], candidates: Sequence[SpanCandidate], fix: str = LANGCHAIN_FIX
) -> tuple[list[PromptMessage] | None, str | None]:
    """Cut `prompt` around the candidates' texts, found verbatim; or say why that is not safe.

    Returns `(new_prompt, None)` when it worked; `(None, reason)` when documents were given but cannot be used
    as spans; `(None, None)` when there was nothing to look for. Documents found next to each other, with only
    whitespace between them, form a group (one `plus`); a prompt may hold several groups — an agent's
    transcript holds each step's tool results, a conversation the documents of each turn — in any system or
    user messages. It is safe when each group starts at the start of a line (or after a colon) and ends at the
    end of one, and no document appears twice in one group (one may appear again in another group: the
    backend reads a repeat as context). Longer candidates are looked for first; a text inside a longer one's
    match does not count. Candidates not found at all are ignored (a chain may drop some documents). Nothing of
    the prompt's text is dropped: only the whitespace around the documents changes.
    """
    unique: dict[str, SpanCandidate] = {}
    for c in candidates:
        text = c.text.strip()
        if text and text not in unique:
            unique[text] = SpanCandidate(text, c.id)
    if not unique:
        return None, None
    claimed: dict[tuple[int, int], list[tuple[int, int, SpanCandidate]]] = {}
    for cand in sorted(unique.values(), key=lambda c: len(c.text), reverse=True):
        for mi, message in enumerate(prompt):
            if message.role == "assistant":
                continue
            for pj, part in enumerate(message.parts):
                if not isinstance(part, str):
                    continue
                taken = claimed.setdefault((mi, pj), [])
                start = part.find(cand.text)
                while start != -1:
                    end = start + len(cand.text)
                    if not any(s < end and start < e for s, e, _ in taken):
                        taken.append((start, end, cand))
                    start = part.find(cand.text, end)
    claimed = {k: v for k, v in claimed.items() if v}
    if not claimed:
        return None, (
            f"none of the {len(unique)} retrieved documents appears verbatim in the prompt ({fix})"
        )
    new_prompt = [PromptMessage(m.role, list(m.parts)) for m in prompt]
    for (mi, pj), found in sorted(claimed.items(), reverse=True):  # later parts first: indices stay valid
        text = prompt[mi].parts[pj]
        assert isinstance(text, str)
        pieces, reason = _cut_groups(text, sorted(found, key=lambda f: f[0]), fix)
        if reason is not None:
            return None, reason
        new_prompt[mi].parts[pj : pj + 1] = pieces
    return new_prompt, None


def _cut_groups(
    text: str, found: list[tuple[int, int, SpanCandidate]], fix: str
) -> tuple[list[str | SpanPiece], str | None]:
    """One message part cut into text and groups of documents (`found`: the documents' places, in order)."""
    groups: list[list[tuple[int, int, SpanCandidate]]] = [[found[0]]]
    for (_, end, _), hit in itertools.pairwise(found):
        gap = text[end : hit[0]]
        if not gap.strip():
            groups[-1].append(hit)
        elif _boundary_after(gap) and _boundary_before(gap):
            groups.append([hit])  # text on lines of its own between two groups
        else:
            return [], (
                f"text other than whitespace separates the documents ({gap.strip()[:40]!r}); {fix}"
            )
    pieces: list[str | SpanPiece] = []
    pos = 0
    for gi, group in enumerate(groups):
        seen: dict[str, int] = {}
        for _, _, c in group:
            seen[c.text] = seen.get(c.text, 0) + 1
        for doc, k in seen.items():
            if k > 1:
                label = next(c for _, _, c in group if c.text == doc).label
                return [], f"the text of document {label} appears {k} times in one group of documents"
        before = text[pos : group[0][0]]
        after_end = groups[gi + 1][0][0] if gi + 1 < len(groups) else len(text)
        after = text[group[-1][1] : after_end]
        if not _boundary_before(before) or not _boundary_after(after):
            return [], (
                f"the documents do not start and end on line boundaries of the prompt; {fix}"
            )
        if before.strip():
            pieces.append(before.strip() if gi else before.rstrip())
        pieces.extend(SpanPiece(c.text, c.id) for _, _, c in group)
        pos = group[-1][1]
    tail = text[pos:]
    if tail.strip():
        pieces.append(tail.lstrip())
    return pieces, None
