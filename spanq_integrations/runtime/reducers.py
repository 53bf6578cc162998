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

**Combining in code.** A small model asked to merge lists drops items; where the combine step is exact in code
the tree does not ask it to. A reducer with `combines_in_code` gives its leaf judges `leaf_instruction`, reads
each leaf's answer into a partial result (`read_leaf`), combines the partials (`combine`: deterministic and
order-stable) and renders the result as the combined answer's text (`render`); `verdict` turns it into the
verdict. The optimizer plans a `Combine` node over the leaf judges (`judge(..., combine="code")`):

| template | a leaf answers                               | combined in code                                  |
|----------|----------------------------------------------|---------------------------------------------------|
| `extract`| its items, one per line                      | the union, in order of appearance, deduplicated   |
| `select` | a score from 0 to 10 for each of its inputs  | the highest score; ties go to the lower label     |
| `count`  | how many of its texts match                  | the sum                                           |
| `vote`   | a short answer                               | the most frequent answer; ties by first appearance|
| `merge`  | (a merged text: needs judgement, model only)  | —                                                 |
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import regex
from pydantic import BaseModel

from spanq_integrations.query.errors import ReducerParseError
from spanq_integrations.query.ir import Assistant, Cross, Fragment, Node, System, User

log = logging.getLogger(__name__)

__all__ = [
    "REDUCERS",
    "CountReducer",
    "ExtractReducer",
    "MergeReducer",
    "Reducer",
    "SelectReducer",
    "Selection",
    "Vote",
    "VoteReducer",
    "parse_error",
    "reducer_from_combine",
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

    # ----------------------------------------------------------------------------- combining in code

    combines_in_code: ClassVar[bool] = False
    """Whether the answers of several judges combine exactly in code (then a tree needs model calls only at
    its leaves). A reducer that sets it implements `read_leaf`, `combine`, `render` and `verdict`."""

    def leaf_instruction(self, task: str) -> str:
        """The user instruction of the leaf judges when their answers are combined in code."""
        return self.instruction(task)

    def read_leaf(self, output: str, *, path: str, shown: Sequence[str]) -> Any:
        """A leaf judge's partial result; `shown` are the texts it read, as presented. Raises
        `ReducerParseError` when the answer cannot be read (the leaf then adds nothing to the combine)."""
        raise NotImplementedError

    def combine(self, partials: Sequence[Any]) -> Any:
        """The partial results of the leaves (in the candidates' order) combined; None when none is usable."""
        raise NotImplementedError

    def render(self, combined: Any) -> str:
        """The combined result as the text of the combined answer ("" for None)."""
        raise NotImplementedError

    def verdict(self, combined: Any, *, path: str, candidates: Sequence[str]) -> Any:
        """The verdict of a combined result; raises `ReducerParseError` when there is none (`combined` None)."""
        if combined is None:
            raise parse_error(path, self.name, "", "no judge below gave an answer this reducer can read")
        return combined

    def options(self) -> dict[str, Any]:
        """The settings that rebuild this reducer by name (`REDUCERS[name](**options)`): its dataclass fields."""
        import dataclasses

        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


# --------------------------------------------------------------------------------------------- extract

# A list marker is followed by a space: "3.14", "J. K. Rowling" keep their numbers and initials (a letter marker is
# lower case: "a) ...", "b. ...").
_LIST_MARKER = re.compile(r"^\s*(?:[-*•·]+(?=\s|$)|\d+[.)](?=\s)|[a-z][.)](?=\s))\s*")
# "Names: Ada" reads as "Ada": a short label without digits, a colon and a space ("10:30", "https://..." stay).
_LABELLED = re.compile(r"^\s*[^\W\d][^\d:]{0,30}:\s+(?=\S)")
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

    # A pattern is the caller's: it runs on the model's answers under a time limit (one that backtracks without
    # end is stopped, and the answer read as a list), and only if it compiles, which is checked when it is given.
    PATTERN_MAX_CHARS: ClassVar[int] = 512
    PATTERN_TIMEOUT_S: ClassVar[float] = 0.5

    def __post_init__(self) -> None:
        if self.item_pattern is None:
            return
        if not isinstance(self.item_pattern, str):
            raise TypeError(f"item_pattern must be a string (a regular expression), got {type(self.item_pattern).__name__}")
        if len(self.item_pattern) > self.PATTERN_MAX_CHARS:
            raise ValueError(f"item_pattern is {len(self.item_pattern)} characters, over {self.PATTERN_MAX_CHARS}")
        try:
            regex.compile(self.item_pattern)
        except regex.error as e:
            raise ValueError(f"item_pattern is not a regular expression: {e}") from None

    def instruction(self, task: str) -> str:
        # Ending on an open list primes small models to list; "already lists" is what lets a judge above the
        # leaves keep the items its inputs carry.
        return f"{task} Keep the items of texts that are already lists. Answer with a list, one item per line:\n- "

    def parse(self, output: str, *, path: str, candidates: Sequence[str] = ()) -> list[str]:
        """Items, in order of appearance, deduplicated (case-insensitively), never an error:

        1. with `item_pattern`: every match (group 0) in the answer;
        2. a JSON array of strings (or of one-field objects), possibly in a code fence, is read as such;
        3. otherwise the answer is split at newlines, commas and semicolons; list markers (`-`, `*`, `1.`),
           quotes, brackets and surrounding punctuation are dropped, and an item led by a short label keeps
           what follows it (`Names: Ada` → `Ada`; `10:30`, `https://...`, `3.14`, `J. K. Rowling` stay whole);
        4. an empty answer, or an item reading `NONE`, is no item.
        """
        if self.item_pattern is not None:
            try:
                return _dedupe([m.group(0) for m in regex.finditer(self.item_pattern, output,
                                                                   timeout=self.PATTERN_TIMEOUT_S)])
            except TimeoutError:
                log.warning("%s: item_pattern ran past %.1f s on an answer of %d characters; the answer is read "
                            "as a list", path, self.PATTERN_TIMEOUT_S, len(output))
        body = _strip_fences(output)
        from_json = _json_items(body)
        if from_json is not None:
            return _dedupe([s.strip() for s in from_json if s.strip().casefold() not in _NO_ITEMS])
        items: list[str] = []
        for piece in re.split(r"[\n,;]", body):
            piece = _LABELLED.sub("", _LIST_MARKER.sub("", piece), count=1)
            piece = piece.strip(_EDGE_JUNK)
            if piece and piece.casefold() not in _NO_ITEMS:
                items.append(piece)
        return _dedupe(items)

    combines_in_code: ClassVar[bool] = True

    def read_leaf(self, output: str, *, path: str, shown: Sequence[str] = ()) -> list[str]:
        return self.parse(output, path=path)

    def combine(self, partials: Sequence[Any]) -> list[str]:
        """The union of the leaves' items, in order of appearance, deduplicated as `parse` dedupes."""
        return _dedupe([item for items in partials if items for item in items])

    def render(self, combined: Any) -> str:
        return "\n".join(combined or ())


# --------------------------------------------------------------------------------------------- select


class Selection(BaseModel):
    """The verdict of `select`: which candidate won (its index among the inputs) and its text."""

    index: int
    text: str


_LABEL = re.compile(r"\[(\d+)\]")
_SCORE_LINE = re.compile(r"^\s*[-*]?\s*\[\s*(\d+)\s*\]\s*(?:[:=\-–]|score\s*[:=]?)?\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_MAX_SCORE = 10
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

    # Scored mode (combined in code): each leaf rates the candidates it reads; the highest score wins.

    combines_in_code: ClassVar[bool] = True

    def leaf_instruction(self, task: str) -> str:
        return (
            f"{task}\nRate every candidate from 0 (bad) to 10 (best). Answer one line per candidate: its label "
            "(its number in square brackets), then its score. Nothing else.\n["
        )

    def read_leaf(self, output: str, *, path: str, shown: Sequence[str]) -> dict[int, float]:
        """`{label: score}` for the candidates this leaf read (a score for a label it did not read is
        ignored; the first score given to a label counts). The instruction ends on `[`, so the answer may open
        with a bare `3] 7` — or, from a chat model that starts a fresh turn, with the whole `[3] 7`."""
        labels = {int(m.group(1)) for text in shown for m in [_LABEL.match(text)] if m}
        scores: dict[int, float] = {}
        opened = output.lstrip()
        for line in (opened if opened.startswith("[") else "[" + output).splitlines():
            m = _SCORE_LINE.match(line)
            if m is None:
                continue
            label, score = int(m.group(1)), float(m.group(2))
            if label in labels and label not in scores and 0 <= score <= _MAX_SCORE:
                scores[label] = score
        if not scores:
            raise parse_error(path, self.name, output, f"no score for any of the labels {sorted(labels)}")
        return scores

    def combine(self, partials: Sequence[Any]) -> int | None:
        """The label with the highest score over every leaf; ties go to the lowest label (the first in order)."""
        scores: dict[int, float] = {}
        for partial in partials:
            for label, score in (partial or {}).items():
                scores.setdefault(int(label), float(score))
        if not scores:
            return None
        return min(scores, key=lambda label: (-scores[label], label))

    def render(self, combined: Any) -> str:
        return "" if combined is None else _label(combined)

    def verdict(self, combined: Any, *, path: str, candidates: Sequence[str]) -> Selection:
        if combined is None or not 0 <= combined < len(candidates):
            raise parse_error(path, self.name, "", "no judge below gave a score this reducer can read")
        return Selection(index=combined, text=candidates[combined])


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


# --------------------------------------------------------------------------------------------- count

_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class CountReducer(Reducer):
    """How many of the candidates match the task (mention a cat, answer yes…): each judge counts the texts it
    reads; counts combine by addition. The verdict is an `int`."""

    name: ClassVar[str] = "count"
    carries: ClassVar[str] = "a count; combined in code it is the sum, by a model the next judge adds counts"

    system_prompt: str = "You count texts."

    def instruction(self, task: str) -> str:
        # One instruction at every level, as extract's and merge's: in a tree of model calls the judges above the
        # leaves read counts (the root was told to count the texts that match, and the leaves to add counts up).
        return (f"{task}\nCount the texts that match; a text that is a count from an earlier reader (a number "
                "alone) adds that number. Answer with one number, the total, and nothing else:\n")

    def parse(self, output: str, *, path: str, candidates: Sequence[str] = ()) -> int:
        """The first whole number in the answer (negative counts are errors)."""
        m = _NUMBER.search(output)
        if m is None or int(m.group(0)) < 0:
            raise parse_error(path, self.name, output, "no count (a whole number >= 0) in it")
        return int(m.group(0))

    combines_in_code: ClassVar[bool] = True

    def read_leaf(self, output: str, *, path: str, shown: Sequence[str] = ()) -> int:
        count = self.parse(output, path=path)
        if count > len(shown) and shown:
            raise parse_error(path, self.name, output, f"a count of {count} for {len(shown)} texts")
        return count

    def combine(self, partials: Sequence[Any]) -> int | None:
        counts = [int(p) for p in partials if p is not None]
        return sum(counts) if counts else None

    def render(self, combined: Any) -> str:
        return "" if combined is None else str(combined)


# --------------------------------------------------------------------------------------------- vote


class Vote(BaseModel):
    """The verdict of `vote`: the most frequent answer and how many judges gave each answer."""

    answer: str
    counts: dict[str, int]


def _vote_key(answer: str) -> str:
    return " ".join(answer.split()).strip(_EDGE_JUNK).casefold()


@dataclass(frozen=True)
class VoteReducer(Reducer):
    """A short answer (yes/no, a class, a name) decided by majority: each judge answers from the texts it reads
    and the most frequent answer wins (ties: the answer given first). Answers are compared case-insensitively
    without surrounding punctuation. The verdict is a `Vote`."""

    name: ClassVar[str] = "vote"
    carries: ClassVar[str] = "a short answer; combined in code, the votes are counted"

    system_prompt: str = "You read texts and answer a question about them in a word or two."

    def instruction(self, task: str) -> str:
        return f"{task}\nAnswer in a word or two, nothing else:\n"

    def parse(self, output: str, *, path: str, candidates: Sequence[str] = ()) -> Vote:
        first = next((line for line in output.splitlines() if _vote_key(line)), "")
        key = _vote_key(first)
        if not key:
            raise parse_error(path, self.name, output, "the answer is empty")
        return Vote(answer=key, counts={key: 1})

    combines_in_code: ClassVar[bool] = True

    def read_leaf(self, output: str, *, path: str, shown: Sequence[str] = ()) -> str:
        return self.parse(output, path=path).answer

    def combine(self, partials: Sequence[Any]) -> Vote | None:
        counts: dict[str, int] = {}
        for answer in partials:
            if answer:
                counts[answer] = counts.get(answer, 0) + 1
        if not counts:
            return None
        best = max(counts.values())
        winner = next(a for a, c in counts.items() if c == best)  # dicts keep first appearance
        return Vote(answer=winner, counts=counts)

    def render(self, combined: Any) -> str:
        return "" if combined is None else combined.answer


REDUCERS: dict[str, type[Reducer]] = {
    ExtractReducer.name: ExtractReducer,
    SelectReducer.name: SelectReducer,
    MergeReducer.name: MergeReducer,
    CountReducer.name: CountReducer,
    VoteReducer.name: VoteReducer,
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


def reducer_from_combine(
    name: str, options: dict[str, Any], path: str, known: Mapping[str, Reducer] | None = None
) -> Reducer:
    """The reducer a `Combine` node names: the instance `known` gives for that name, else the built-in one
    built from `options`; a clear error for an unknown name, a reducer that cannot combine in code, or options
    it does not take."""
    from spanq_integrations.query.errors import QueryValidationError

    reducer: Reducer | type[Reducer] | None = (known or {}).get(name) or REDUCERS.get(name)
    if reducer is None:
        raise QueryValidationError(
            f"{path}.combine.reducer", f"unknown reducer {name!r}: one of {', '.join(sorted(REDUCERS))}"
        )
    if not reducer.combines_in_code:
        raise QueryValidationError(
            f"{path}.combine.reducer", f"the {name} reducer needs a model to combine answers, not code"
        )
    if isinstance(reducer, Reducer):
        return reducer
    try:
        return reducer(**options)
    except (TypeError, ValueError) as e:
        raise QueryValidationError(f"{path}.combine.options", f"not options of the {name} reducer: {e}") from None
