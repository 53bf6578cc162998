"""`PrefixTokens`: the token ids of the documents of a prompt read in context before, so that a later prompt over
the same documents in the same order tokenizes only what follows them (its new question).

A span engine reads a set of documents it has read in context before as the stock prompt in the order it read them
(`SpanGenerator.seen_in_context`): stock canonical's computation. Everything up to the documents' end is the same
text as last time; tokenizing it again (the whole stock prompt: ~7 ms for 4k tokens of SmolLM2's tokenizer here,
most of what the span engine does before its request) is the one piece of work a stock engine must repeat and a
span engine need not: it knows where the documents end.

Exactness: the ids returned are always those `tokenizer.encode(text)` gives. A prefix is kept only with a cut `c`
at which the text it was learned from tokenizes as `encode(text[:c]) + encode(text[c:])` (checked when learned);
`c` is a space between two words, `MARGIN` characters or more before the documents' end, and a later text reuses
it only where it is the same text up to the documents' end. Tokenizers split text into words (pre-tokens) before
merging, by patterns that look at most a character ahead, and merge within a word: a word boundary well inside a
shared prefix is a boundary of every text with that prefix. A tokenizer where the check fails keeps nothing
(`refused` counts those), and so does a tokenizer that does not split words first (`splits_words`): every text is
then tokenized whole, as before.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

__all__ = ["PrefixTokens", "cut_before", "documents_end", "splits_words"]

# How far before the documents' end a cut lies, at least (characters): the shared text goes on past it, so nothing
# after the documents (a new question) reaches back across it.
MARGIN = 32


def cut_before(text: str, end: int) -> int | None:
    """The last space between two words in `text[: end - MARGIN]` (where the following word starts), or None."""
    at = text.rfind(" ", 0, end - MARGIN)
    while at > 0:
        if not text[at - 1].isspace() and at + 1 < len(text) and not text[at + 1].isspace():
            return at
        at = text.rfind(" ", 0, at)
    return None


def documents_end(text: str, texts: list[str]) -> int | None:
    """Where the documents `texts` end in `text`: the last end of any of them (a later copy, say in the question,
    only makes what follows shorter); None where one is not found as given (a template rewrote it)."""
    ends = [text.rfind(t) for t in texts]
    if not ends or min(ends) < 0:
        return None
    return max(at + len(t) for at, t in zip(ends, texts))


def splits_words(tokenizer: Any) -> bool:
    """Whether `tokenizer` splits text into words before merging (a fast tokenizer whose pre-tokenizer cuts "alpha
    beta" in two): what makes a word boundary of a prefix a boundary of every text that shares it. Not so (no
    pre-tokenizer: merges run over the whole text), `PrefixTokens` keeps nothing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None:
        return False
    try:
        return len(pre.pre_tokenize_str("alpha beta")) >= 2
    except Exception:  # noqa: BLE001  (a pre-tokenizer that cannot say: treated as one that does not split)
        return False


class PrefixTokens:
    """Token ids of prompt prefixes (documents read in context), by the prefix's text, least recently used out."""

    CAPACITY = 64  # prefixes kept at most
    MAX_CHARS = 16_000_000  # their texts' characters at most, in all

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.enabled = splits_words(tokenizer)
        self._by_prefix: OrderedDict[str, tuple[int, array]] = OrderedDict()  # text[:end] -> (cut, ids of text[:cut])
        self._chars = 0
        self.hits = 0
        self.refused = 0  # learned texts whose cut did not tokenize as the whole: nothing kept

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def ids(self, text: str, end: int) -> list[int] | None:
        """`encode(text)` from a prefix learned for `text[:end]` (the documents' end): its ids and the rest's; None
        where none is."""
        key = text[:end]
        entry = self._by_prefix.get(key)
        if entry is None:
            return None
        self._by_prefix.move_to_end(key)
        cut, head = entry
        self.hits += 1
        return [*head, *self._encode(text[cut:])]

    def learn(self, text: str, end: int, ids: list[int]) -> bool:
        """Keep the ids of `text`'s documents (up to `end`), given `ids` = `encode(text)`: whether they are kept."""
        if not self.enabled:
            return False
        key = text[:end]
        if key in self._by_prefix:
            return True
        cut = cut_before(text, end)
        if cut is None:
            return False
        head = self._encode(text[:cut])
        if head + self._encode(text[cut:]) != list(ids):
            self.refused += 1
            return False
        self._by_prefix[key] = (cut, array("l", head))
        self._chars += len(key)
        while self._by_prefix and (len(self._by_prefix) > self.CAPACITY or self._chars > self.MAX_CHARS):
            old, _ = self._by_prefix.popitem(last=False)
            self._chars -= len(old)
        return key in self._by_prefix

    def clear(self) -> None:
        self._by_prefix.clear()
        self._chars = 0
