"""The span table: which token ranges of a request are spans, as it travels out of band with the request.

It rides in `SamplingParams.extra_args["spanq"]` (never in the token stream, so user text cannot forge it)
and is read by the block hasher in the scheduler. Every span starts and ends on a KV-block boundary. A
span's anchor is a prefix of the request: by default the whole prefix before the first span (`anchor_len`
tokens, block-aligned), so its cached KV is what it produces right after that prefix, on its own; a span
with anchor 0 stands alone (an inner generation's whole conversation, read again by an outer judge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EXTRA_ARGS_KEY", "SpanTable", "SpanTableError"]

EXTRA_ARGS_KEY = "spanq"


class SpanTableError(ValueError):
    """A span table that does not describe a valid request layout."""


@dataclass(frozen=True)
class SpanTable:
    block_size: int
    spans: tuple[tuple[int, int], ...]  # (start, end) token offsets, block-aligned, ascending, disjoint
    anchors: tuple[int, ...] | None = None  # per span: its anchor's length (the prefix, or 0); None: the prefix

    @property
    def anchor_len(self) -> int:
        """The shared anchor: the request's prefix before its first span."""
        return self.spans[0][0] if self.spans else 0

    def anchor_of(self, i: int) -> int:
        return self.anchors[i] if self.anchors is not None else self.anchor_len

    def validate(self, num_prompt_tokens: int) -> SpanTable:
        bs = self.block_size
        if bs <= 0:
            raise SpanTableError(f"block_size must be positive, got {bs}")
        if self.anchors is not None and (
            len(self.anchors) != len(self.spans) or any(a not in (0, self.anchor_len) for a in self.anchors)
        ):
            raise SpanTableError(f"anchors {self.anchors} must give each span 0 or the prefix ({self.anchor_len})")
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

    def to_extra_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": 1, "block_size": self.block_size, "spans": [list(s) for s in self.spans]}
        if self.anchors is not None:
            out["anchors"] = list(self.anchors)
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
                tuple(int(a) for a in anchors) if anchors is not None else None,
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise SpanTableError(f"malformed span table: {e}") from e
