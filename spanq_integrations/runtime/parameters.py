"""The constructor parameters of spanq's framework models (LangChain's `ChatSpanQuery` and `SpanQueryLLM`,
LlamaIndex's `SpanQueryLLM`), checked by name: LangChain and LlamaIndex models ignore a keyword they do not know,
so code ported from another model (`ChatOpenAI(model_name=...)`, `base_url=`) would run silently on spanq's
defaults — another model, the embedded engine. `model_name` (ChatOpenAI's spelling) is read as `model`; any other
unknown keyword is refused, with the parameter it most resembles."""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["RENAMED", "checked_call_options", "checked_parameters"]

RENAMED = {"model_name": "model"}  # other frameworks' spellings of spanq's parameters


def checked_parameters(cls: Any, values: Any) -> Any:
    """`values` (a pydantic model's input, before validation) with other frameworks' spellings renamed; a
    `ValueError` naming each keyword `cls` has no field for."""
    if not isinstance(values, dict):
        return values
    fields = cls.model_fields
    values = dict(values)
    for other, ours in RENAMED.items():
        if other in values and other not in fields and ours in fields:
            given = values.pop(other)
            if values.get(ours) not in (None, "", given):
                raise ValueError(f"{other}={given!r} and {ours}={values[ours]!r} name two models: give one ({ours})")
            values[ours] = given
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    unknown = [k for k in values if k not in known]
    if unknown:
        raise ValueError(f"{cls.__name__} has no parameter {_named(unknown, known)}")
    return values


def _named(unknown: list[Any], known: set[str]) -> str:
    """Each unknown keyword, quoted, with the known one it most resembles."""
    named = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(named)


def checked_call_options(owner: str, options: dict[str, Any], known: frozenset[str],
                         renamed: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """A call's options (`invoke(..., **options)`, `bind(...)`) with other frameworks' spellings renamed (`renamed`:
    theirs to ours); an `ArgumentValueError` naming each option not in `known`. A LangChain model ignores an option
    it does not read, where ChatOpenAI sends it on: `bind(top_p=0.1)` or `max_completion_tokens=1` ran as if not
    given."""
    from spanq_integrations.query.errors import ArgumentValueError

    options = dict(options)
    for other, ours in renamed.items():
        if other in options:
            given = options.pop(other)
            if options.get(ours) not in (None, given):
                raise ArgumentValueError(f"{owner}({other}={given!r})",
                                         f"and {ours}={options[ours]!r} say two things: give one ({ours})")  # fmt: skip
            options[ours] = given
    unknown = [k for k in options if k not in known]
    if unknown:
        raise ArgumentValueError(f"{owner}({unknown[0]}=...)", f"not an option of a call: "
                                 f"{_named(unknown, set(known) | set(renamed))}; a call takes "
                                 f"{', '.join(sorted(k for k in known if not k.startswith('ls_')))}")  # fmt: skip
    return options
