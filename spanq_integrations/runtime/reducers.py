"""Reducer templates for judges over many candidates: what each judge is told, what its answer carries to the
next level of a tree reduction, and how the final answer is parsed into a verdict.

A judge over N candidates reads `cross(system, plus(candidates), user(instruction))`. Under tree reduction
(`judge(..., k=2)`) the intermediate judges' answers become the candidates of the next level, so every template
asks for an answer that is at the same time its result and a valid input of the next judge:

| template  | an intermediate answer carries                         | verdict                         |
|-----------|--------------------------------------------------------|---------------------------------|
| `extract` | every item found so far, one per line                  | `list[str]`, in order, deduped  |
| `select`  | the winner's label and its full text, `[3] text…`      | `Selection(index, text)`        |
| `merge`   | the merged text                                        | `str`                           |

Parsing, and what happens when an answer does not follow the format:
- `extract` never fails: a JSON array is read as such, anything else line by line (see `ExtractReducer.parse`);
  an empty answer or `NONE` is no items.
- `select` reads the first `[i]` label naming a candidate (or a number opening the answer); without one, the
  one candidate whose text (else whose first eight words) the answer quotes; otherwise `ReducerParseError`.
- `merge` takes the answer as it is; an empty answer is a `ReducerParseError`.

A lone candidate needs no call for `select` and `merge` (it is the winner, it is the merge); `extract` still
reads it once, since extracting is work on the text itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from spanq_integrations.query.errors import ReducerParseError
from spanq_integrations.query.ir import Assistant, Cross, Fragment, Node, System, User

__all__ = [
    "REDUCERS",
    "ExtractReducer",
    "MergeReducer",
    "Reducer",
    "SelectReducer",
    "Selection",
    "parse_error",
    "resolve_reducer",
]

_TEXT_NODES = (System, User, Assistant, Fragment)


def parse_error(path: str, reducer: str, output: str, why: str) -> ReducerParseError:
    """A `ReducerParseError` naming the call's path and showing (the start of) the output it could not parse."""
    shown = output if len(output) <= 400 else output[:399] + "…"
    error = ReducerParseError(
        f"{path}: the {reducer} reducer cannot parse this judge's output ({why}): {shown!r}. "
        "Raise max_tokens if the answer was cut short, use a stronger model, or pass a reducer whose "
        "parse() accepts this format"
    )
    error.path = path  # type: ignore[attr-defined]
    error.output = output  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class Reducer:
    """A judge template. Subclass it for a custom reducer: set `name` and `carries`, override `instruction`
    (and `intermediate_instruction` when inner judges need another one), `parse` and, if candidates must be
    told apart, `present` and `candidate_text`."""

    name: ClassVar[str] = "reducer"
    carries: ClassVar[str] = ""
    """What an intermediate answer carries to the next level (documentation, shown in `spanq` docs)."""

    system_prompt: str = "You read texts and answer about them."

    def instruction(self, task: str) -> str:
        """The user instruction of the root judge, built around the caller's `task`."""
        return task

    def intermediate_instruction(self, task: str) -> str:
        """The user instruction of the judges below the root (same as the root's unless overridden)."""
        return self.instruction(task)

    def present(self, index: int, candidate: Node) -> Node:
        """How candidate `index` appears to the judges (as given, unless the template labels candidates)."""
        return candidate

    def candidate_text(self, index: int, presented: Node) -> str:
        """The text of candidate `index` from its closed, presented form (the inverse of `present`)."""
        from spanq_integrations.query.flatten import block_text

        return block_text(presented)

    reads_a_lone_candidate: ClassVar[bool] = True
    """Whether a single candidate still needs a judge call (extract: yes); if not, `lone` gives the verdict."""

    def lone(self, text: str) -> Any:
        """The verdict over a single candidate without any call (when `reads_a_lone_candidate` is False)."""
        raise NotImplementedError

    def parse(self, output: str, *, path: str, candidates: Sequence[str]) -> Any:
        """The verdict a judge's `output` stands for; raises `ReducerParseError` (see `parse_error`)."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------- extract

_LIST_MARKER = re.compile(r"^\s*(?:[-*•·]+|\d+[.)]|[a-z][.)](?=\s))\s*", re.IGNORECASE)
_EDGE_JUNK = " \t\"'`“”‘’()[]{}<>.,;:!?"
_NO_ITEMS = {"none", "no items", "n/a", "nothing", "null", "[]"}


def _strip_fences(text: str) -> str:
    match = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    return match.group(1) if match else text


def _json_items(text: str) -> list[str] | None:
    """Items of a JSON array of strings (or of objects with one string field), or None if it is not one."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        return None
    try:
        value = json.loads(text[start : end + 1])
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    items: list[str] = []
    for v in value:
        if isinstance(v, str):
            items.append(v)
        elif isinstance(v, dict) and len(v) >= 1 and all(isinstance(x, str) for x in v.values()):
            items.append(next(iter(v.values())))
        else:
            return None
    return items


def _dedupe(items: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        key = " ".join(item.split()).casefold()
        if key and key not in seen:
            seen.add(key)
            out.append(" ".join(item.split()))
    return out


@dataclass(frozen=True)
class ExtractReducer(Reducer):
    """Keep every item that matches the task (names, dates, claims…): the union over all candidates.

    `item_pattern` (a regular expression), when set, defines an item: the verdict is every match in the answer,
    whatever its layout. Without it the answer is read as a list, see `parse`.
    """

    name: ClassVar[str] = "extract"
    carries: ClassVar[str] = (
        "every item found so far, one per line; the next judge reads those lists like any text and keeps "
        "their items, so the union survives every level"
    )

    system_prompt: str = "You extract items from texts."
    item_pattern: str | None = None

    def instruction(self, task: str) -> str:
        # Ending on an open list primes small models to list; "already lists" is what lets a judge above the
        # leaves keep the items its inputs carry.
        return f"{task} Keep the items of texts that are already lists. Answer with a list, one item per line:\n- "

    def parse(self, output: str, *, path: str, candidates: Sequence[str] = ()) -> list[str]:
        """Items, in order of appearance, deduplicated (case-insensitively), never an error:

        1. with `item_pattern`: every match (group 0) in the answer;
        2. a JSON array of strings (or of one-field objects), possibly in a code fence, is read as such;
        3. otherwise the answer is split at newlines, commas and semicolons; list markers (`-`, `*`, `1.`),
           quotes, brackets and surrounding punctuation are dropped, and an item with a colon keeps what
           follows it (`Names: Ada` → `Ada`);
        4. an empty answer, or an item reading `NONE`, is no item.
        """
        if self.item_pattern is not None:
            return _dedupe([m.group(0) for m in re.finditer(self.item_pattern, output)])
        body = _strip_fences(output)
        from_json = _json_items(body)
        if from_json is not None:
            return _dedupe([s.strip() for s in from_json if s.strip().casefold() not in _NO_ITEMS])
        items: list[str] = []
        for piece in re.split(r"[\n,;]", body):
            piece = _LIST_MARKER.sub("", piece)
            if ":" in piece:
                piece = piece.rsplit(":", 1)[1]
            piece = piece.strip(_EDGE_JUNK)
            if piece and piece.casefold() not in _NO_ITEMS:
                items.append(piece)
        return _dedupe(items)


# --------------------------------------------------------------------------------------------- select


class Selection(BaseModel):
    """The verdict of `select`: which candidate won (its index among the inputs) and its text."""

    index: int
    text: str


_LABEL = re.compile(r"\[(\d+)\]")
_QUOTED_OPENING_WORDS = 8  # an answer that quotes a candidate's first 8 words (cut short, say) names it
_OPENING_NUMBER = re.compile(r"\s*[\[#]?\s*(\d+)\s*(?:\]|$|[\s.:)])")


def _label(index: int) -> str:
    return f"[{index}]"


@dataclass(frozen=True)
class SelectReducer(Reducer):
    """Pick the best candidate. Candidates are shown with a label, `[0] text`; the verdict names the winner."""

    name: ClassVar[str] = "select"
    carries: ClassVar[str] = (
        "the winner's label and its full text, `[3] text`, exactly as the leaves show candidates; the next "
        "judge compares texts, and the label still names the original candidate at the root"
    )

    system_prompt: str = (
        "You compare candidates. Each candidate starts with its label: its number in square brackets."
    )

    def instruction(self, task: str) -> str:
        # No example label ("[0]"): small models copy it whatever they read. The open bracket primes the label.
        return (
            f"{task}\nAnswer with the label of the best candidate (its number in square brackets) and nothing "
            "else:\n["
        )

    def intermediate_instruction(self, task: str) -> str:
        return (
            f"{task}\nAnswer with the label of the best candidate (its number in square brackets) followed by "
            "its text, exactly as given. Nothing else."
        )

    def present(self, index: int, candidate: Node) -> Node:
        if isinstance(candidate, _TEXT_NODES):
            return candidate.model_copy(update={"text": f"{_label(index)} {candidate.text}"})
        return Cross(children=(User(text=_label(index)), candidate))

    def candidate_text(self, index: int, presented: Node) -> str:
        from spanq_integrations.query.flatten import block_text

        if isinstance(presented, Cross) and presented.children[:1] == (User(text=_label(index)),):
            return block_text(presented.model_copy(update={"children": presented.children[1:]}))
        text = block_text(presented)
        return text.removeprefix(f"{_label(index)} ")

    reads_a_lone_candidate: ClassVar[bool] = False

    def lone(self, text: str) -> Selection:
        return Selection(index=0, text=text)

    def parse(self, output: str, *, path: str, candidates: Sequence[str]) -> Selection:
        """The first `[i]` label that names a candidate (or a bare number opening the answer, `2]`, `#2`:
        the answer to an instruction that ends on `[`); else the one candidate whose text, or else whose first
        eight words, the answer quotes."""
        labels = [m.group(1) for m in _LABEL.finditer(output)]
        opening = _OPENING_NUMBER.match(output)
        for label in ([opening.group(1)] if opening else []) + labels:
            index = int(label)
            if 0 <= index < len(candidates):
                return Selection(index=index, text=candidates[index])
        answer = " ".join(output.split()).casefold()
        contained: list[int] = []
        for words in (None, _QUOTED_OPENING_WORDS):  # the whole text, else its opening words
            contained = [
                i for i, c in enumerate(candidates) if c.split() and " ".join(c.split()[:words]).casefold() in answer
            ]
            if len(contained) == 1:
                return Selection(index=contained[0], text=candidates[contained[0]])
        why = (
            f"no label [0]…[{len(candidates) - 1}] and {len(contained)} candidates' texts in it"
            if candidates
            else "there are no candidates to select from"
        )
        raise parse_error(path, self.name, output, why)


# --------------------------------------------------------------------------------------------- merge


@dataclass(frozen=True)
class MergeReducer(Reducer):
    """Merge the candidates into one text (a summary, a combined answer)."""

    name: ClassVar[str] = "merge"
    carries: ClassVar[str] = "the merged text; the next judge merges merged texts"

    system_prompt: str = "You merge texts into one text."

    def instruction(self, task: str) -> str:
        return (
            f"{task}\nSome of the texts may already be merges of earlier texts. "
            "Answer with the merged text only."
        )

    reads_a_lone_candidate: ClassVar[bool] = False

    def lone(self, text: str) -> str:
        return text

    def parse(self, output: str, *, path: str, candidates: Sequence[str] = ()) -> str:
        text = output.strip()
        if not text:
            raise parse_error(path, self.name, output, "the answer is empty")
        return text


REDUCERS: dict[str, type[Reducer]] = {
    ExtractReducer.name: ExtractReducer,
    SelectReducer.name: SelectReducer,
    MergeReducer.name: MergeReducer,
}
"""The built-in templates by name."""


def resolve_reducer(reducer: Reducer | str) -> Reducer:
    """A reducer instance for a template name (`extract`, `select`, `merge`) or an instance."""
    if isinstance(reducer, Reducer):
        return reducer
    if isinstance(reducer, str) and reducer in REDUCERS:
        return REDUCERS[reducer]()
    from spanq_integrations.query.errors import QueryValidationError

    raise QueryValidationError(
        "judge(reducer)",
        f"unknown reducer {reducer!r}: use one of {', '.join(sorted(REDUCERS))} or a Reducer instance",
    )
