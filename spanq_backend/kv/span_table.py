"""The span table: which token ranges of a request are spans, as it travels out of band with the request.

It rides in `SamplingParams.extra_args["spanq"]` (never in the token stream, so user text cannot forge it)
and is read by the block hasher in the scheduler. Every span starts and ends on a KV-block boundary. A
span's anchor is what its KV was computed after, on its own — its prepare request is `[anchor][span]`:
- a prefix of the request, by length: by default the whole prefix before the first span (`anchor_len`
  tokens, block-aligned); 0 makes the span stand alone (an inner generation's whole conversation, read again
  by an outer judge);
- or explicit tokens that need not appear in the request at all (a whole number of blocks), such as the chat
  template's opening: the span is then reused after any prefix, whatever question or conversation precedes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EXTRA_ARGS_KEY", "Anchor", "SpanTable", "SpanTableError"]

Anchor = int | tuple[int, ...]
"""A span's anchor: the length of the request's prefix it was computed after, or explicit anchor tokens."""

EXTRA_ARGS_KEY = "spanq"
MAX_ANCHOR_TOKENS = 1 << 14  # explicit anchors are a chat template's opening; a longer one is refused as stock


class SpanTableError(ValueError):
    """A span table that does not describe a valid request layout."""


@dataclass(frozen=True)
class SpanTable:
    block_size: int
    spans: tuple[tuple[int, int], ...]  # (start, end) token offsets, block-aligned, ascending, disjoint
    anchors: tuple[Anchor, ...] | None = None  # per span (see `Anchor`); None: every span after the prefix

    @property
    def anchor_len(self) -> int:
        """The request's prefix before its first span (the default anchor)."""
        return self.spans[0][0] if self.spans else 0

    def anchor_of(self, i: int) -> Anchor:
        return self.anchors[i] if self.anchors is not None else self.anchor_len

    def anchor_ids(self, i: int, token_ids: Sequence[int]) -> list[int]:
        """The tokens span i was computed after (its prepare request's first part)."""
        anchor = self.anchor_of(i)
        return list(token_ids[:anchor]) if isinstance(anchor, int) else list(anchor)

    def anchor_size(self, i: int) -> int:
        anchor = self.anchor_of(i)
        return anchor if isinstance(anchor, int) else len(anchor)

    def validate(self, num_prompt_tokens: int) -> SpanTable:
        bs = self.block_size
        if bs <= 0:
            raise SpanTableError(f"block_size must be positive, got {bs}")
        if self.anchors is not None:
            if len(self.anchors) != len(self.spans):
                raise SpanTableError(f"{len(self.anchors)} anchors for {len(self.spans)} spans")
            for i, a in enumerate(self.anchors):
                if isinstance(a, int) and a not in (0, self.anchor_len):
                    raise SpanTableError(f"anchor of span {i} ({a}) must be 0, the prefix ({self.anchor_len}) or tokens")
                if not isinstance(a, int) and (not a or len(a) % bs or len(a) > MAX_ANCHOR_TOKENS):
                    raise SpanTableError(
                        f"anchor tokens of span {i} must be a whole number of blocks of {bs}, at most "
                        f"{MAX_ANCHOR_TOKENS} tokens"
                    )
        prev_end = 0
        for i, (s, e) in enumerate(self.spans):
            if s % bs or e % bs:
                raise SpanTableError(f"span {i} ({s}, {e}) is not aligned to blocks of {bs} tokens")
            if not (prev_end <= s < e <= num_prompt_tokens):
                raise SpanTableError(f"span {i} ({s}, {e}) overlaps another or lies outside the prompt")
            prev_end = e
        return self

    def span_at(self, token: int) -> int | None:
        """Index of the span holding token offset `token`, or None if it is context."""
        for i, (s, e) in enumerate(self.spans):
            if s <= token < e:
                return i
        return None

    def truncated(self, end: int) -> SpanTable:
        """The table of the request's first `end` tokens: the spans that end by then."""
        keep = [i for i, (_, e) in enumerate(self.spans) if e <= end]
        anchors = None if self.anchors is None else tuple(self.anchors[i] for i in keep)
        return SpanTable(self.block_size, tuple(self.spans[i] for i in keep), anchors if keep else None)

    def to_extra_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": 1, "block_size": self.block_size, "spans": [list(s) for s in self.spans]}
        if self.anchors is not None:
            # One list for the spans that share an anchor (a 512-token lead-in before every document, say), not a
            # copy of it for each span.
            lists: dict[tuple[int, ...], list[int]] = {}
            for a in self.anchors:
                if not isinstance(a, int) and a not in lists:
                    lists[a] = list(a)
            out["anchors"] = [a if isinstance(a, int) else lists[a] for a in self.anchors]
        return out

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> SpanTable | None:
        if not extra_args or EXTRA_ARGS_KEY not in extra_args:
            return None
        raw = extra_args[EXTRA_ARGS_KEY]
        try:
            if raw.get("v") != 1:
                raise SpanTableError(f"unsupported span table version {raw.get('v')!r}")
            anchors = raw.get("anchors")
            return cls(
                int(raw["block_size"]),
                tuple((int(s), int(e)) for s, e in raw["spans"]),
                tuple(int(a) if isinstance(a, int) else _read_anchor(a) for a in anchors)
                if anchors is not None
                else None,
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise SpanTableError(f"malformed span table: {e}") from e


# Anchor token lists read lately (`from_extra_args`), by their values: a call's requests (its answer, each recompute
# run) carry the same anchors, 512-token lead-ins each where spans are read after one; looking one up costs a tenth
# of reading it again.
_READ_ANCHORS: dict[tuple[Any, ...], tuple[int, ...]] = {}
READ_ANCHOR_TOKENS = 1 << 17  # the tokens kept, at most (~36 bytes each: the key, the ints): then all are dropped
_read_anchor_tokens = 0


def _read_anchor(tokens: Any) -> tuple[int, ...]:
    """Anchor tokens as ints (`int` of each, as read before; a value equal to a kept one reads as it did)."""
    global _read_anchor_tokens
    key = tuple(tokens)
    if len(key) > MAX_ANCHOR_TOKENS:  # refused by `validate`: not kept (nor anything dropped for it)
        return tuple(map(int, key))
    found = _READ_ANCHORS.get(key)
    if found is None:
        found = tuple(map(int, key))
        if _read_anchor_tokens + len(key) > READ_ANCHOR_TOKENS:
            _READ_ANCHORS.clear()
            _read_anchor_tokens = 0
        _READ_ANCHORS[key] = found
        _read_anchor_tokens += len(key)
    return found
