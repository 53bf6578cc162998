"""Selective recompute: some of a prompt's span blocks computed again in context, the rest read from the cache.

A span's cached KV attended only to its anchor. Recomputing a block *in context* (attending to everything before
it in the prompt: the prefix, the spans before it as cached, the span's own earlier blocks, and blocks recomputed
before it) buys back some of what span attention costs, at the price of computing that block (CacheBlend's idea,
at KV-block granularity). The rest of the span keeps its cached KV.

It is a change of the span table, nothing else: a recomputed block leaves its span and becomes context, and the
span's blocks after it become a span of their own whose anchor is, explicitly, the span's anchor followed by the
span's tokens up to there — exactly what they were computed after in the span's prepare request, so they hash
(invariant 3) and move (invariant 2) as before. A recomputed block is then an ordinary context block: hashed on
everything before it, never under a span's key (invariant 1), and reused only by a prompt with the same content
before it. vLLM computes a request's tokens contiguously from its first miss, so each run of recomputed blocks
that cached span blocks follow is computed by a request of its own over the prompt up to the run's end, in order
(`RecomputePlan.ends`); the last run, when no span follows it, is left to the request itself.

Which blocks (`choose_blocks`): `"first"` (each span's first block: the tokens that, computed alone, saw the
least), `"last"` (each span's last block: what the text after the spans reads first), `"question"` (as many blocks
as spans, those that share the most with the question by the score below, wherever they sit; none that shares
nothing — where the text after every document shares nothing with any span block, as when the question is asked
before the documents, the text before the first span is read as the question), `"first+question"` (both: each
span's first block, and as many blocks again, those of the others the question shares most with — a count per span,
where a share's count grows with the document), `"attention"` (as many blocks as spans, those the question attends to most in the middle of the model,
read by a pass of the prompt before the recompute round: `vllm_integration/attention_probe.py`; the blocks'
attention mass comes in as `block_mass`), or a share in (0, 1] of all
span blocks, picked by a cheap criterion that needs no model pass: first the spans' first blocks, then the other
blocks; within each, those that share the most with the text after the spans (the question, not the last span's
tail left as context, nor a document read in context after the spans), each shared token weighted by its rarity among the span blocks (an inverse document
frequency); ties to the earlier block.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from spanq_backend.kv.span_table import MAX_ANCHOR_TOKENS, Anchor, SpanTable
from spanq_backend.serving.lowering import LoweredPrompt
from spanq_integrations.query.ir import RECOMPUTE_POLICIES, Recompute

__all__ = [
    "DEFAULT_RECOMPUTE",
    "RecomputePlan",
    "choose_blocks",
    "plan_recompute",
    "question_start",
    "recompute_arg",
    "recompute_setting",
]

# What a call that says nothing recomputes: each span's first block and as many more, those the question shares
# most with — the first setting measured to meet every quality goal at a count per span (docs/design.md, "Why the
# default is first+question"; docs/benchmarks.md `quality` measures it). "question" (half the recompute) and `0`
# (nothing: span attention as it is, the fastest) are one argument away.
DEFAULT_RECOMPUTE: Recompute = "first+question"


def recompute_setting(value: Recompute | str | float | None) -> Recompute:
    """A recompute setting read from a flag or a config: "first", "last", "question", "first+question", "attention",
    or a share in [0, 1] ("none" is 0)."""
    if value is None or value == "none":
        return 0.0
    if value in RECOMPUTE_POLICIES:
        return value  # type: ignore[return-value]
    try:
        share = float(value)
    except (TypeError, ValueError):
        names = ", ".join(repr(p) for p in RECOMPUTE_POLICIES)
        raise ValueError(f"recompute must be a share between 0 and 1, {names} or 'none'; got {value!r}") from None
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute must be a share between 0 and 1, got {share:g}")
    return share


def recompute_arg(text: str) -> Recompute:
    """`recompute_setting` for a command-line option: a bad value is argparse's usage error."""
    try:
        return recompute_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class RecomputePlan:
    """A prompt laid out for recompute: its table (recomputed blocks as context), and where each request that
    computes a run of recomputed blocks ends (in prompt order; they run one after another)."""

    lowered: LoweredPrompt
    blocks: tuple[tuple[int, int], ...]  # (span, block within the span) recomputed
    ends: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Span tokens recomputed in context."""
        return len(self.blocks) * self.lowered.table.block_size


def _eligible(lowered: LoweredPrompt, i: int) -> bool:
    """Whether span i's blocks can be recomputed: its later pieces' explicit anchors (its anchor and its tokens)
    must travel in a span table."""
    s, e = lowered.table.spans[i]
    return lowered.table.anchor_size(i) + (e - s) <= MAX_ANCHOR_TOKENS


def choose_blocks(
    lowered: LoweredPrompt, setting: Recompute, pad_token_id: int | None = None, block_mass: list[float] | None = None
) -> list[tuple[int, int]]:
    """The (span, block) pairs `setting` recomputes in this prompt (see the module docstring); `pad_token_id`
    (the layout's padding) does not count as a shared token. `"attention"` ranks by `block_mass` (per prompt block,
    the attention the question gives it); without it, it chooses as `"question"` does (the caller says so)."""
    table = lowered.table
    bs = table.block_size
    sizes = [(e - s) // bs for s, e in table.spans]
    spans = [i for i in range(len(sizes)) if _eligible(lowered, i)]
    if setting == "first":
        return [(i, 0) for i in spans]
    if setting == "last":
        return [(i, sizes[i] - 1) for i in spans]
    if setting == "first+question":  # "first"'s blocks, and as many again: those "question" ranks first among the rest
        scored = _question_scores(lowered, spans, pad_token_id)
        rest = sorted((-score, start, pair) for pair, start, score in scored if pair[1] != 0 and score > 0)
        return sorted([(i, 0) for i in spans] + [pair for *_, pair in rest[: len(spans)]])
    if setting in ("question", "attention"):  # as many blocks as "first", the best scored, wherever they sit
        if not spans:
            return []
        scores = (_attention_scores(lowered, spans, block_mass) if setting == "attention" and block_mass is not None
                  else _question_scores(lowered, spans, pad_token_id))
        ranked = sorted((-score, start, pair) for pair, start, score in scores if score > 0)
        return sorted(pair for *_, pair in ranked[: len(spans)])
    share = float(setting)
    if share <= 0.0 or not spans:
        return []
    total = sum(sizes)
    budget = max(1, math.floor(share * total + 1e-9))
    # Each span's first block comes first (computed alone, it saw least: measured the most useful block to
    # recompute), the most relevant spans' first; then the blocks that share most with the question.
    scored = [(pair[1] != 0, -score, start, pair) for pair, start, score in _question_scores(lowered, spans, pad_token_id)]
    scored.sort()
    return sorted(pair for *_, pair in scored[:budget])


def _attention_scores(
    lowered: LoweredPrompt, spans: list[int], block_mass: list[float]
) -> list[tuple[tuple[int, int], int, float]]:
    """Each block of `spans` — (span, block), its first token's position — and the attention the question gives it
    (`block_mass`, per prompt block; a block past its end scores nothing)."""
    table = lowered.table
    bs = table.block_size
    out = []
    for i in spans:
        s, e = table.spans[i]
        for b in range((e - s) // bs):
            j = s // bs + b
            out.append(((i, b), s + b * bs, block_mass[j] if j < len(block_mass) else 0.0))
    return out


def _question_scores(
    lowered: LoweredPrompt, spans: list[int], pad_token_id: int | None
) -> list[tuple[tuple[int, int], int, float]]:
    """Each block of `spans` — (span, block), its first token's position — and how much it shares with the text
    after the spans (the question)."""
    table = lowered.table
    bs = table.block_size
    sizes = [(e - s) // bs for s, e in table.spans]
    blocks = []
    for i in spans:
        s, _ = table.spans[i]
        blocks += [((i, b), s + b * bs, set(lowered.token_ids[s + b * bs : s + (b + 1) * bs])) for b in range(sizes[i])]

    def scores(question: set[int]) -> list[tuple[tuple[int, int], int, float]]:
        # A token shared with the question weighs more the fewer span blocks hold it (an inverse document
        # frequency): the town a question names counts, the words every document repeats do not.
        question.discard(pad_token_id)
        held = Counter(t for _, _, toks in blocks for t in toks & question)
        weight = {t: math.log((1 + len(blocks)) / (1 + n)) for t, n in held.items()}
        return [(pair, start, sum(weight[t] for t in toks & question)) for pair, start, toks in blocks]

    after = scores(set(lowered.token_ids[question_start(lowered, pad_token_id) :]))
    if any(score > 0 for *_, score in after):
        return after
    # Nothing after the documents is shared with them ("Question: … Context: … Answer:", LangChain hub's
    # rlm/rag-prompt, asks before them): the text before the first span.
    return scores(set(lowered.token_ids[: table.spans[0][0]]))


def question_start(lowered: LoweredPrompt, pad_token_id: int | None) -> int:
    """Where the question starts: the first token after the last span, less that span's own tail where the prompt
    keeps it as context (its prepare tail without the padding: the last document's words are not the question's),
    and after any document the prompt reads in context after the spans (a cold one, a repeated one)."""
    table = lowered.table
    tail = lowered.prepare_tails.get(len(table.spans) - 1, ())
    kept = len(tail)
    while kept and tail[kept - 1] == pad_token_id:
        kept -= 1
    return max(table.spans[-1][1] + kept, lowered.slots_end)


def plan_recompute(lowered: LoweredPrompt, blocks: Iterable[tuple[int, int]]) -> RecomputePlan:
    """The prompt with `blocks` recomputed in context: its new span table and the recompute requests' ends."""
    table = lowered.table
    bs = table.block_size
    ids = lowered.token_ids
    chosen: dict[int, set[int]] = {}
    for i, b in blocks:
        s, e = table.spans[i]
        if not 0 <= b < (e - s) // bs:
            raise ValueError(f"span {i} has no block {b}")
        chosen.setdefault(i, set()).add(b)
    if not chosen:
        return RecomputePlan(lowered, (), ())
    # When the first span's first block becomes context, the prompt's prefix before the first span grows: spans
    # anchored on the old prefix (by length) name it by its tokens instead (they hash the same).
    prefix_moves = 0 in chosen.get(0, set())
    if prefix_moves and table.anchor_len > MAX_ANCHOR_TOKENS:  # the prefix could not travel as tokens
        chosen[0].discard(0)
        prefix_moves = False
        if not chosen[0]:
            del chosen[0]
        if not chosen:
            return RecomputePlan(lowered, (), ())
    spans: list[tuple[int, int]] = []
    anchors: list[Anchor] = []
    recomputed: list[tuple[int, int]] = []  # token ranges, in order
    for i, (s, e) in enumerate(table.spans):
        anchor = table.anchor_of(i)
        if isinstance(anchor, int) and anchor and prefix_moves:
            anchor = tuple(ids[:anchor])
        base = table.anchor_ids(i, ids)
        redo = chosen.get(i, set())
        b, n = 0, (e - s) // bs
        while b < n:
            if b in redo:
                recomputed.append((s + b * bs, s + (b + 1) * bs))
                b += 1
                continue
            c = b
            while c < n and c not in redo:
                c += 1
            spans.append((s + b * bs, s + c * bs))
            anchors.append(anchor if b == 0 else tuple(base + ids[s : s + b * bs]))
            b = c
    first = spans[0][0] if spans else 0
    new_table = SpanTable(
        bs, tuple(spans), tuple(anchors) if any(a != first for a in anchors) else None
    ).validate(len(ids))
    # Runs of adjacent recomputed blocks; a run that a span block follows needs a request of its own.
    runs: list[list[int]] = []
    for lo, hi in recomputed:
        if runs and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    last_span_end = spans[-1][1] if spans else 0
    ends = tuple(hi for _, hi in runs if hi < last_span_end)
    pairs = tuple(sorted((i, b) for i, bs_ in chosen.items() for b in bs_))
    # (The prepare requests ran on `lowered`; this layout's spans are other pieces: no prepare tails.)
    return RecomputePlan(replace(lowered, table=new_table, prepare_tails={}), pairs, ends)
