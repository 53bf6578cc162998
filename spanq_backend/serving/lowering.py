"""Lowering: a closed `Generate` input → prompt token ids plus a span table, with the model's own chat template.

The input's messages are rendered through the tokenizer's chat template with a unique sentinel where each
`plus` child goes; the rendered text is split at the sentinels. Text between spans is tokenized as context;
each span is tokenized on its own (its text, then a blank-line separator), so its tokens do not depend on its
neighbours. The prefix before the first span and every span are padded with `pad_token_id` to a KV-block
boundary, so spans start on a block and their blocks can be shared; the padding is counted. A text span that
context follows (the last span, before the question; a span before text between two groups) is not padded: its
whole blocks are the span, its last partial block is context, computed by the request after everything before
it (a span shorter than a block is padded: it has no whole block to keep). A `plus` says its children's order
does not matter: a group of text spans is read in one order that depends only on which spans it holds
(`span_order`: by a digest of their text, the one with the shortest such tail last), so a set of documents read
again in another order finds its blocks where they are (nothing relocated) and the request computes as little of
the documents as the layout allows.

A span's anchor (what its KV is computed after, on its own) follows its `plus` group's policy: `"template"`
(the default) is the chat template's opening alone — the same tokens whatever precedes the group, so a
document is reused after any question, conversation or transcript; `"system"` adds the query's leading system
messages; `"prefix"` is the whole prompt before the first span (today's exact layout, reused only after the
same prefix). An anchor that is not the prompt's own prefix travels as explicit tokens in the span table. A `plus` child that is not text-like (for example a nested `plus`) is read as its text.
A span whose tokens repeat an earlier span of the same prompt is laid out the same way but read as context:
one cached block cannot sit at two positions of one request.

Nested generation: an inner generate whose output an outer generate reads (`align_output`) has its prompt
padded (newlines at the end of its last message) so that its output starts on a block boundary. A generated
`Assistant` in a `plus` whose tokens the engine still knows (`generated_ids`: its aligned prompt and its
output ids) becomes a span of its output ids alone — the judge's prompt holds the candidates' text, as a stock
judge's does, plus padding — anchored on its own prompt, explicitly: the KV its generation left in the cache
is reused, relocated, instead of prefilled again. A generated assistant the engine does not know is read as
text under its group's policy (counted in `generated_as_text`).
"""

from __future__ import annotations

import hashlib
import secrets
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spanq_backend.kv.span_table import MAX_ANCHOR_TOKENS, SpanTable
from spanq_integrations.query.errors import ContextLengthError, QueryValidationError
from spanq_integrations.query.flatten import BLOCK_SEPARATOR, SpanPart, block_text, chat_parts
from spanq_integrations.query.ir import (
    AnchorPolicy,
    Assistant,
    Fragment,
    Monad,
    Node,
    Plus,
    Print,
    User,
)

__all__ = [
    "DEFAULT_ANCHOR",
    "DEFAULT_LEAD_IN",
    "NEUTRAL_LEAD_IN",
    "NEUTRAL_PASSAGES",
    "GeneratedSpan",
    "LoweredPrompt",
    "Tokenizer",
    "check_fits",
    "generated_span_ids",
    "lower",
    "render_chat",
    "span_order",
    "spans_first",
]

DEFAULT_ANCHOR: AnchorPolicy = "template"
"""The anchor policy of a `plus` that names none: reuse after any prefix (docs/design.md, "Anchors")."""

NEUTRAL_PASSAGES = (
    (
        "The water cycle describes how water moves between the land, the oceans and the air. Heat from the sun "
        "evaporates water from lakes and seas; the vapour rises, cools and condenses into clouds. When the "
        "droplets grow heavy they fall as rain or snow, which feeds rivers and soaks into the ground, and in time "
        "the water returns to the sea."
    ),
    (
        "Bread has been baked for thousands of years. A simple dough of flour, water, salt and yeast is kneaded, "
        "left to rise, shaped and baked in a hot oven. The yeast turns sugars into gas, which makes the loaf light, "
        "and the crust browns as it bakes."
    ),
    (
        "The city library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to six books "
        "for three weeks, and the reading room on the first floor keeps newspapers from the last ten years. A small "
        "cafe near the entrance sells tea and sandwiches."
    ),
    (
        "Mount Arden rises 2,300 metres above the valley and is covered in snow for most of the year. The first "
        "recorded climb was in 1854 by a party of four guides. Today a cable car carries visitors to a viewpoint "
        "near the summit, and marked trails lead down through pine forest."
    ),
    (
        "Tomatoes grow best in full sun and well-drained soil. Seedlings are planted out once the nights are warm, "
        "tied to stakes as they grow and watered at the roots. The fruit ripens from green to red over several weeks "
        "and is picked when it gives a little to the touch."
    ),
    (
        "The museum's east wing holds a collection of old clocks, from pocket watches to a tower mechanism taken from "
        "a church in 1902. Guided tours start every hour, and a workshop on the ground floor shows how the springs "
        "and gears are repaired."
    ),
    (
        "A train leaves the central station for the coast every half hour. The journey takes about ninety minutes, "
        "with stops at four market towns, and bicycles may be carried in the last carriage outside the morning rush."
    ),
    (
        "Bees collect nectar from flowers and store it in wax cells, where it thickens into honey. A strong hive holds "
        "tens of thousands of workers and a single queen, and in a good summer a keeper may take twenty kilograms."
    ),
)
NEUTRAL_LEAD_IN = BLOCK_SEPARATOR.join(NEUTRAL_PASSAGES)
"""A neutral lead-in (eight short passages on unrelated subjects, ~460 tokens; the first four until 2026-12-05,
docs/benchmarks.md "The lead-in's length"): what a canonical anchor reads before a span when no document of the
corpus is known yet (`SpanGenerator`'s "auto" lead-in) or asked for."""

DEFAULT_LEAD_IN = NEUTRAL_LEAD_IN
"""What a span reads before itself in its canonical anchor ("template", "system"), after the chat template's
opening, as if other documents came first. In a prompt a document follows others; computed right after the
opening, its tokens attend as if they started the text, and what reads the span later sees one such start per
document. A lead-in recovers much of what span attention costs, at no cost per query: it is part of the anchor,
computed once and cached (docs/design.md, "Lead-in"; measured in docs/benchmarks.md, `quality`). "" turns it off."""


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def span_digest(text: str) -> str:
    """A span's routing key: a digest of its text (the same on a router, which reads the query, and on the
    replica that prepared it)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


@dataclass
class LoweredPrompt:
    """A prompt ready for the engine: tokens, where the spans are, and what each span's prepare request is."""

    token_ids: list[int]
    table: SpanTable
    span_texts: list[str] = field(default_factory=list)
    padded_tokens: int = 0
    # Span i's last block where this prompt leaves it as context (its tail, then padding): its prepare request
    # computes it all the same, so that the span is cached whole wherever it sits next.
    prepare_tails: dict[int, tuple[int, ...]] = field(default_factory=dict)
    generated_spans: int = 0  # generated assistants read as spans on their own prompt (their KV reused)
    generated_as_text: int = 0  # generated assistants the engine no longer knows: read as text, prefilled again
    # Where the last `plus` child's tokens end (a span's, or a text read in context after the spans, or a repeated
    # document's): what follows is the question (`recompute.question_start`). 0: not recorded.
    slots_end: int = 0

    @property
    def has_spans(self) -> bool:
        return bool(self.table.spans)

    def in_span_order(self, texts: Iterable[str]) -> list[str]:
        """`texts` in the order this prompt reads them as spans; a text it does not read as a span goes last, in
        the order given (the sort is stable)."""
        rank = {text: i for i, text in enumerate(self.span_texts)}
        return sorted(texts, key=lambda t: rank.get(t, len(rank)))

    @property
    def anchor_ids(self) -> list[int]:
        return self.token_ids[: self.table.anchor_len]

    def span_ids(self, i: int) -> list[int]:
        s, e = self.table.spans[i]
        return self.token_ids[s:e]

    def prepare_prompt(self, i: int) -> list[int]:
        """`[anchor][span i]`: computing this alone puts span i's isolated KV in the cache (its whole blocks,
        and its last block padded where this prompt reads that block as context)."""
        return self.table.anchor_ids(i, self.token_ids) + self.span_ids(i) + list(self.prepare_tails.get(i, ()))

    @property
    def reads_after_another_prefix(self) -> bool:
        """Whether no span is anchored on this prompt's own prefix: then no span's prepare request caches the
        prefix, which vLLM's lookup (contiguous from the first block) must find before it reaches the spans."""
        table = self.table
        return table.anchor_len > 0 and all(table.anchor_of(i) != table.anchor_len for i in range(len(table.spans)))

    def prefix_prompt(self) -> list[int]:
        """The prompt before its first span (whole blocks)."""
        return self.token_ids[: self.table.anchor_len]

    def span_key(self, i: int) -> str:
        """A stable key of span i under its anchor (for the engine's bookkeeping; the cache uses block hashes)."""
        h = hashlib.sha256()
        h.update(repr((self.table.block_size, self.prepare_prompt(i))).encode())
        return h.hexdigest()[:32]


def render_chat(tokenizer: Tokenizer, chat: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat rendered as text by the model's own template. A template that refuses the messages (roles that
    do not alternate, a system message it does not take) is the query's to fix: a `QueryValidationError`."""
    from jinja2 import TemplateError  # what transformers renders chat templates with

    try:
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        roles = ", ".join(m["role"] for m in chat)
        raise QueryValidationError("$", f"the model's chat template refused these messages ({roles}): {e}") from e
    if not isinstance(rendered, str):
        raise TypeError("the tokenizer's chat template did not render to text")
    return rendered


@dataclass(frozen=True)
class GeneratedSpan:
    """What an engine knows of a generation whose output an outer generate reads: its prompt (whole blocks,
    laid out with `align_output`) and its output token ids (without a trailing end-of-sequence token)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


def generated_span_ids(tokenizer: Tokenizer, output_ids: Sequence[int], block_size: int, pad_token_id: int) -> list[int]:
    """A generated output as a judge reads it: its ids, the separator, padding to a block boundary — the same
    tokens the generation's sealing request and the judge's span hold."""
    ids = list(output_ids) + _span_tokens(tokenizer, BLOCK_SEPARATOR)
    ids.extend([pad_token_id] * ((-len(ids)) % block_size))
    return ids


_SPAN_TOKENS: weakref.WeakKeyDictionary[Any, OrderedDict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_SPAN_TOKENS_PER_TOKENIZER = 4096


def _span_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """A span's text tokenized on its own, remembered per tokenizer: warm queries re-read the same spans."""
    cache = _SPAN_TOKENS.setdefault(tokenizer, OrderedDict())
    ids = cache.get(text)
    if ids is None:
        ids = cache[text] = tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()
        if len(cache) > _SPAN_TOKENS_PER_TOKENIZER:
            cache.popitem(last=False)
    else:
        cache.move_to_end(text)
    return list(ids)


_ANCHORS: weakref.WeakKeyDictionary[Any, OrderedDict[tuple, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _anchor_tokens(
    tokenizer: Tokenizer,
    policy: AnchorPolicy,
    systems: tuple[str, ...],
    block_size: int,
    pad_token_id: int,
    lead_in: str = DEFAULT_LEAD_IN,
) -> tuple[int, ...]:
    """The tokens of a canonical anchor: the chat template's opening of a user turn (after the query's leading
    system messages for "system"), then the lead-in and the separator spans end with, padded to a block
    boundary. Remembered per tokenizer."""
    cache = _ANCHORS.setdefault(tokenizer, OrderedDict())
    key = (policy, systems if policy == "system" else (), block_size, pad_token_id, lead_in)
    ids = cache.get(key)
    if ids is None:
        mark = f"\u27e6spanq:anchor:{secrets.token_hex(6)}\u27e7"
        content = f"{lead_in}{BLOCK_SEPARATOR}{mark}" if lead_in else mark
        chat = [{"role": "system", "content": t} for t in key[1]] + [{"role": "user", "content": content}]
        rendered = render_chat(tokenizer, chat, add_generation_prompt=False)
        head, found, _ = str(rendered).partition(mark)
        if not found:
            raise QueryValidationError("$", "the chat template dropped a user message; it cannot carry spans")
        out = list(tokenizer.encode(head, add_special_tokens=False)) if head else []
        out.extend([pad_token_id] * ((-len(out)) % block_size))
        ids = cache[key] = tuple(out) or tuple([pad_token_id] * block_size)
        if len(cache) > 64:
            cache.popitem(last=False)
    return ids


def _after_separator(text: str) -> str:
    """Text that follows a span, without the separator the span already ends with."""
    return text.removeprefix(BLOCK_SEPARATOR)


def lower(
    node: Node,
    tokenizer: Tokenizer,
    block_size: int,
    pad_token_id: int,
    max_model_len: int | None = None,
    max_new_tokens: int = 0,
    generated_ids: Callable[[Assistant], GeneratedSpan | None] | None = None,
    default_anchor: AnchorPolicy = DEFAULT_ANCHOR,
    align_output: bool = False,
    lead_in: str = DEFAULT_LEAD_IN,
    as_context: frozenset[str] = frozenset(),
    keep_order: bool = False,
) -> LoweredPrompt:
    """Lower a closed generate input to tokens and a span table (no spans when there is no `plus`).

    `generated_ids(assistant)` returns what the engine knows of a generated assistant (None: nothing);
    `default_anchor` is the policy of a `plus` that names none; `align_output` pads a prompt without spans so
    that its output starts on a block boundary (an inner generation whose output a judge reads as a span);
    `lead_in` is what a canonical anchor holds after the template's opening (`DEFAULT_LEAD_IN`); a `plus` child
    whose text is in `as_context` is laid out as context (its tokens as a span's, unpadded, in no span: computed in
    context by the request, as a stock prompt's); `keep_order` reads each group in the order given, not in the
    order of `span_order`."""
    read = node if keep_order else span_order(node, tokenizer, block_size, as_context)
    messages = chat_parts(read)
    slots = [p for m in messages for p in m.parts if isinstance(p, SpanPart)]
    nonce = secrets.token_hex(6)
    sentinel = [f"\u27e6spanq:{i}:{nonce}\u27e7" for i in range(len(slots))]
    slot_index = {id(s): i for i, s in enumerate(slots)}
    chat = []
    for m in messages:
        pieces = [sentinel[slot_index[id(p)]] if isinstance(p, SpanPart) else p for p in m.parts]
        chat.append({"role": m.role, "content": BLOCK_SEPARATOR.join(pieces)})
    align_mark = f"\u27e6spanq:align:{nonce}\u27e7" if align_output and not slots else None
    if align_mark is not None:
        chat[-1]["content"] += align_mark
    rendered = render_chat(tokenizer, chat, add_generation_prompt=True)
    if align_mark is not None:
        return _aligned(rendered, align_mark, tokenizer, block_size, pad_token_id, max_model_len, max_new_tokens)

    # Split the rendered prompt at the sentinels, in order.
    texts: list[str] = []
    rest = rendered
    for i, s in enumerate(sentinel):
        before, found, after = rest.partition(s)
        if not found:
            raise QueryValidationError("$", f"the chat template dropped span {i}; it cannot carry spans")
        texts.append(before)
        rest = after
    texts.append(rest)

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    def pad(ids: list[int]) -> int:
        n = (-len(ids)) % block_size
        ids.extend([pad_token_id] * n)
        return n

    sep_ids = enc(BLOCK_SEPARATOR)
    ids: list[int] = enc(texts[0])
    padded = 0
    spans: list[tuple[int, int]] = []
    anchors: list[int] = []
    span_texts: list[str] = []
    tails: dict[int, tuple[int, ...]] = {}
    seen: set[tuple[int, ...]] = set()
    generated_spans = generated_as_text = 0
    def in_context(i: int) -> bool:
        return slots[i].text in as_context and not (
            generated_ids is not None and isinstance(slots[i].node, Assistant) and slots[i].node.source is not None
        )

    if any(not in_context(i) for i in range(len(slots))):  # spans follow: the prefix ends on a block
        padded += pad(ids)
    anchor_len = len(ids)
    # The "system" anchor: the prompt's own leading system message, as the template renders it (its text parts
    # joined as they are in the prompt).
    first = messages[0] if messages[0].role == "system" else None
    system_text = BLOCK_SEPARATOR.join(p for p in first.parts if isinstance(p, str)) if first else ""
    systems = (system_text,) if system_text else ()  # (a system message of documents only: no system prompt)

    def anchor_for(slot: SpanPart, size: int) -> int | tuple[int, ...]:
        policy = slot.anchor or default_anchor
        if policy == "prefix":
            return anchor_len
        tokens = _anchor_tokens(tokenizer, policy, systems, block_size, pad_token_id, lead_in)
        if lead_in and max_model_len is not None and len(tokens) + size + block_size >= max_model_len:
            # a span too long to be prepared after the lead-in within the context window: without it
            tokens = _anchor_tokens(tokenizer, policy, systems, block_size, pad_token_id, "")
        if tuple(ids[:anchor_len]) == tokens or len(tokens) > MAX_ANCHOR_TOKENS:
            return anchor_len  # the prefix itself (say so), or an anchor too long to travel: the exact prefix
        return tokens

    def followed_by_context(i: int) -> bool:
        return i == len(slots) - 1 or bool(_after_separator(texts[i + 1]).strip()) or in_context(i + 1)

    for i, slot in enumerate(slots):
        between = _after_separator(texts[i]) if i else ""
        if between.strip():
            ids.extend(enc(between))  # context between spans, e.g. an instruction between two groups
        if in_context(i):  # read as a stock prompt reads it: computed in context, no padding, no span
            ids.extend(_span_tokens(tokenizer, slot.text) + sep_ids)
            continue
        padded += pad(ids)  # a span starts on a block (after a tail left as context, or context between)
        start = len(ids)
        known = None
        if generated_ids is not None and isinstance(slot.node, Assistant) and slot.node.source is not None:
            known = generated_ids(slot.node)
            if known is not None and len(known.prompt_ids) > MAX_ANCHOR_TOKENS:
                known = None  # a prompt too long to travel as an anchor: read as text
            if known is None:
                generated_as_text += 1
            else:
                generated_spans += 1
        anchor: int | tuple[int, ...]
        if known is not None:
            span = generated_span_ids(tokenizer, known.output_ids, block_size, pad_token_id)
            ids.extend(span)
            padded += len(span) - len(known.output_ids) - len(sep_ids)
            anchor = anchor_len if tuple(ids[:anchor_len]) == known.prompt_ids else known.prompt_ids
        else:
            ids.extend(_span_tokens(tokenizer, slot.text) + sep_ids)
            if not followed_by_context(i) or len(ids) - start < block_size:
                padded += pad(ids)  # (a span shorter than a block has no whole block to keep: padded)
            anchor = anchor_for(slot, len(ids) - start)
        # A text span that context follows keeps its last, partial block as context (no padding): computed by
        # the request itself, after everything before it. Its whole blocks are the same as where it is padded.
        end = start + (len(ids) - start) // block_size * block_size
        anchor_size = anchor if isinstance(anchor, int) else len(anchor)
        tail = (*ids[end:], *[pad_token_id] * ((-len(ids)) % block_size))  # empty where padded above
        key = (anchor, tuple(ids[start:end]) + tail)  # the span as its prepare request computes it
        if key not in seen:
            seen.add(key)
            if tail:
                tails[len(spans)] = tail
            spans.append((start, end))
            anchors.append(anchor)
            span_texts.append(slot.text)
        size = end - start + len(tail)  # as its prepare request computes it
        if max_model_len is not None and size + anchor_size >= max_model_len:
            if read is not node:  # named by its place in the query as given (clients map it to a document)
                i = [p.text for m in chat_parts(node) for p in m.parts if isinstance(p, SpanPart)].index(slot.text)
            raise ContextLengthError(
                f"span {i} ({size} tokens with its {anchor_size}-token anchor) does not fit the "
                f"model's context window of {max_model_len} tokens"
            )
    slots_end = len(ids)
    if slots:  # without spans, texts[0] was the whole prompt
        ids.extend(enc(_after_separator(texts[-1])))
    check_fits(ids, padded, max_model_len, max_new_tokens)
    if spans and spans[0][0] != anchor_len:
        # Text before the first span (a group read in context, `as_context`): a span anchored on the prefix names
        # it by its tokens (an integer anchor is the table's own prefix, which now holds that text too), or, too
        # long to travel so, by the table's prefix: computed after everything before it.
        prefix = tuple(ids[:anchor_len]) if anchor_len <= MAX_ANCHOR_TOKENS else spans[0][0]
        anchors = [prefix if a == anchor_len else a for a in anchors]
        anchor_len = spans[0][0]
    table = SpanTable(block_size, tuple(spans), tuple(anchors) if any(a != anchor_len for a in anchors) else None)
    table.validate(len(ids))
    return LoweredPrompt(
        token_ids=ids,
        table=table,
        span_texts=span_texts,
        padded_tokens=padded,
        prepare_tails=tails,
        generated_spans=generated_spans,
        generated_as_text=generated_as_text,
        slots_end=slots_end if slots else 0,
    )


def spans_first(node: Node, first: Callable[[str], bool]) -> Node:
    """`node` with the children of each `plus` reordered, stably: those whose text `first` holds first. A `plus`
    says its children's order does not matter; the span engine reads cached documents first, so that the
    documents it computes in context come last and every cached one before them is a cache hit."""
    from spanq_integrations.query.ir import transform

    def reorder(n: Node) -> Node:
        if not isinstance(n, Plus) or len(n.children) < 2:
            return n
        texts = [block_text(c) if not isinstance(c, (Monad, Print)) else "" for c in n.children]
        keys = [not first(t) for t in texts]
        if keys == sorted(keys):
            return n
        order = sorted(range(len(n.children)), key=lambda k: keys[k])
        return n.model_copy(update={"children": tuple(n.children[k] for k in order)})

    return transform(node, reorder)


def span_order(
    node: Node, tokenizer: Tokenizer, block_size: int, as_context: frozenset[str] = frozenset()
) -> Node:
    """`node` with the children of each `plus` of text spans in one order that depends only on which spans the
    group holds, not on the order given: by a digest of each span's text, the one whose last partial block is
    shortest last.

    One order per set of spans: the group's cached blocks sit, after the first query that read them together, at
    the positions every later query with the same spans reads them at (in any order given), so nothing is
    relocated; and an answer read from spans does not depend on the order a retriever returned. The last span of a
    group keeps its last partial block as context (the others are padded) and the request computes it besides the
    question: over random document lengths that tail averages half a block, as much as a stock prompt's own last
    partial block, so the shortest tail last makes the warm span prompt compute no more of its documents than a
    stock prompt whose documents are all cached (docs/benchmarks.md, "8 × 512 warm against stock canonical"). A
    group with a child that is not a text span (a generated candidate, a nested group, a text read in context) is
    left as it is."""
    from spanq_integrations.query.ir import transform

    sep = len(_span_tokens(tokenizer, BLOCK_SEPARATOR))

    def tail(text: str) -> int:
        n = len(_span_tokens(tokenizer, text)) + sep
        return 0 if n < block_size else n % block_size

    def reorder(n: Node) -> Node:
        if not isinstance(n, Plus) or len(n.children) < 2:
            return n
        if not all(isinstance(c, (Fragment, User)) and c.text not in as_context for c in n.children):
            return n
        texts = [c for c in n.children if c.text]  # an empty text (a retriever's empty document) adds nothing
        if not texts:
            return n
        ordered = sorted(texts, key=lambda c: _order_key(c.text))
        tails = [tail(c.text) for c in ordered]
        last = len(tails) - 1
        k = min(range(last, -1, -1), key=lambda i: tails[i])  # of the shortest, the latest by digest
        ordered = [*ordered[:k], *ordered[k + 1 :], ordered[k]]
        if len(ordered) == len(n.children) and all(a is b for a, b in zip(ordered, n.children, strict=True)):
            return n
        return n.model_copy(update={"children": tuple(ordered)})

    return transform(node, reorder)


def _order_key(text: str) -> bytes:
    """Where a span goes in its group: a digest of its text (stable across processes and versions of Python)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def check_fits(ids: list[int], padded: int, max_model_len: int | None, max_new_tokens: int) -> None:
    """Refuse a prompt that, with the tokens it asks for, does not fit the model's context window."""
    if max_model_len is not None and max_new_tokens >= max_model_len:  # no prompt fits: the call's field is wrong
        error = ContextLengthError(
            f"max_tokens={max_new_tokens} is not below the model's context window of {max_model_len} tokens; "
            f"this prompt of {len(ids)} tokens leaves room for at most {max(max_model_len - len(ids), 0)}"
        )
        error.field = ".g.max_tokens"
        raise error
    if max_model_len is not None and len(ids) + max(max_new_tokens, 1) > max_model_len:
        of_padding = f" ({padded} of them padding)" if padded else ""
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens{of_padding} and asks for {max_new_tokens} more; "
            f"the model's context window is {max_model_len} tokens"
        )


def _aligned(
    rendered: str,
    mark: str,
    tokenizer: Tokenizer,
    block_size: int,
    pad_token_id: int,
    max_model_len: int | None,
    max_new_tokens: int,
) -> LoweredPrompt:
    """A prompt without spans, padded at `mark` (the end of its last message) to whole blocks, so that its
    output starts on a block boundary."""
    before, found, after = rendered.partition(mark)
    if not found:
        raise QueryValidationError("$", "the chat template dropped the last message's end; it cannot be aligned")
    head = list(tokenizer.encode(before, add_special_tokens=False)) if before else []
    tail = list(tokenizer.encode(after, add_special_tokens=False)) if after else []
    n = (-(len(head) + len(tail))) % block_size
    ids = head + [pad_token_id] * n + tail
    check_fits(ids, n, max_model_len, max_new_tokens)
    return LoweredPrompt(token_ids=ids, table=SpanTable(block_size, ()), padded_tokens=n)
