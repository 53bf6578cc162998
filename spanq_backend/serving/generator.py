"""Span-aware generation on any vLLM engine: lower a `Generate`, prepare its spans, run it, measure it.

`SpanGenerator` holds everything that does not depend on how the engine is driven. Each host hands it one
callable that runs a token request on its engine (`RequestStream`): the in-process `SpanEngine` feeds its
engine thread, `spanq serve` calls vLLM's `AsyncLLM` engine client. Requests that need the same span at
different positions run concurrently: the plugin's CIDRA gives each its own copy of a block that another
running request reads elsewhere (invariant 6 of docs/design.md).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spanq_backend.kv.span_table import EXTRA_ARGS_KEY, SpanTable
from spanq_backend.serving import metrics
from spanq_backend.serving.lowering import (
    DEFAULT_ANCHOR,
    NEUTRAL_LEAD_IN,
    GeneratedSpan,
    LoweredPrompt,
    Tokenizer,
    check_fits,
    generated_span_ids,
    lower,
    render_chat,
    span_digest,
    spans_first,
)
from spanq_backend.serving.prefix_tokens import PrefixTokens, documents_end
from spanq_backend.serving.recompute import (
    DEFAULT_RECOMPUTE,
    RecomputePlan,
    choose_blocks,
    plan_recompute,
    question_start,
)
from spanq_integrations.backends.protocol import CallMetrics, Completion, TokenCallback
from spanq_integrations.query.errors import (
    BackendError,
    ContextLengthError,
    RequestRejectedError,
    SpanQueryError,
)
from spanq_integrations.query.ir import (
    AnchorPolicy,
    Assistant,
    Fragment,
    Generate,
    Plus,
    Recompute,
    User,
    walk,
)

__all__ = [
    "RequestStream",
    "SpanGenerator",
    "TokenRun",
    "engine_error",
    "flattened_prompt_ids",
    "load_chat_tokenizer",
]

RequestStream = Callable[[list[int], Any], AsyncIterator[Any]]
"""Runs one token request on an engine: `(prompt_ids, SamplingParams) -> RequestOutput`s (deltas).

It aborts the request in the engine when the iterator is closed early or its consumer is cancelled (so its KV
blocks are freed)."""


log = logging.getLogger("spanq.generator")


def load_chat_tokenizer(model_path: str | Path) -> Any:
    """The model folder's tokenizer; spans are laid out through its chat template, so it must have one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if not getattr(tokenizer, "chat_template", None):
        raise BackendError(f"the model at {model_path} has no chat template; spanq needs one")
    return tokenizer


def engine_error(e: Exception) -> SpanQueryError:
    """The spanq error for an engine's refusal of a request (an over-long prompt, bad parameters)."""
    if isinstance(e, SpanQueryError):
        return e
    msg = str(e)
    if "longer than" in msg or "context length" in msg:
        return ContextLengthError(msg)
    return RequestRejectedError(f"the engine refused the request: {msg}")


def flattened_prompt_ids(tokenizer: Tokenizer, node: Any) -> list[int]:
    """A generate input's prompt as a stock engine reads it: spans flattened to text (`to_chat_messages`), no span
    layout, no padding."""
    from spanq_integrations.query.flatten import to_chat_messages

    text = render_chat(tokenizer, to_chat_messages(node), add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------------------- generation


@dataclass
class TokenRun:
    """One finished token request: its outputs (deltas, in order) and when its first text arrived."""

    outputs: list[Any]
    first_text_at: float | None  # time.perf_counter()

    @property
    def last(self) -> Any:
        return self.outputs[-1]

    @property
    def text(self) -> str:
        return "".join(o.outputs[0].text for o in self.outputs if o.outputs)

    @property
    def finish_reason(self) -> str | None:
        return self.last.outputs[0].finish_reason if self.outputs and self.last.outputs else None

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs if o.outputs)

    @property
    def cached_tokens(self) -> int:
        return (self.last.num_cached_tokens or 0) if self.outputs else 0

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs if o.outputs for t in o.outputs[0].token_ids]


def structured_outputs(call: Generate) -> Any:
    """vLLM's constrained decoding for a call whose answer is JSON (`Generate.json_schema`), else None."""
    schema = call.schema
    if schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    # Whitespace in the JSON is an engine setting (`EngineConfig.compact_json`), not a request's.
    return StructuredOutputsParams(json_object=True) if schema == {} else StructuredOutputsParams(json=schema)


@dataclass
class CallLayout:
    """A call's prompt as it runs now (`SpanGenerator.layout`): "warm" (every span cached), "stock" (every span
    cached, but the stock prompt computes nearly as much: read as stock reads it, `SpanGenerator.as_stock`),
    "in-context" (the documents cached in context: read so), "tier" (the cold spans in the engine's span tier: the
    answer's request loads them), "isolate" (the cold spans' `[anchor][span]` prompts computed first), or "context"
    (the cold spans computed in context by the answer, their prepares `deferred` until the engine is idle)."""

    lowered: LoweredPrompt
    flattened: bool
    mode: str
    isolate: list[list[int]] = field(default_factory=list)
    isolated: list[int] = field(default_factory=list)  # the spans `isolate` prepares, in its order
    deferred: list[list[int]] = field(default_factory=list)
    also: list[list[int]] = field(default_factory=list)  # deferred beside the spans: the span layout's prefix
    spans: int = 0  # the call's spans, wherever they are read from (cache, prepares, or in context)
    # Where `deferred`/`also` are worked out only after the answer (`SpanGenerator.unseen_in_context`): how.
    later: Callable[[], tuple[list[list[int]], list[list[int]]]] | None = None
    # A stock prompt read in context whose documents' tokens are kept after the answer (`PrefixTokens.learn`):
    # its text, where the documents end in it, its ids.
    learn: tuple[str, int, list[int]] | None = None
    # The recompute plan of `lowered`, where `layout` worked it out already (`as_stock` counted it): not again.
    plan: RecomputePlan | None = None


def read_by_answer(lowered: LoweredPrompt, i: int, computed: int) -> int:
    """Of the `computed` tokens that span i's prepare took (the end of its `[anchor][span][tail]` prompt: what the
    cache lacked), those the answer then finds cached: the span's whole blocks, and the anchor where it is the
    answer's own prefix. Not the tail (the answer reads that block as context) nor another anchor (a lead-in, a
    candidate's prompt: not in the answer's prompt)."""
    table = lowered.table
    start, end = table.spans[i]
    after_anchor = computed - len(lowered.prepare_tails.get(i, ()))
    in_span = max(0, min(after_anchor, end - start))
    in_anchor = max(0, after_anchor - (end - start))
    return in_span + (in_anchor if isinstance(table.anchor_of(i), int) else 0)


async def _gather_or_abort(aws: list[Any], opened: list[AsyncIterator[Any]]) -> list[Any]:
    """Await the readers of `opened` requests together; if one fails or the caller is cancelled, stop the others
    and close every request (aborted in the engine, also one whose reader never started)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for o in opened:
            with contextlib.suppress(Exception):
                await o.aclose()  # type: ignore[attr-defined]
        raise


ISOLATE_MIN_TOKENS = 1536
"""`cold_spans="auto"` (the default): cold span tokens from which a call prepares its cold spans alone first (a
round of its own) instead of computing them in context: below it, attention over the whole prompt costs less than
the extra round and the padding (`spanq bench rag --grid --cold-spans isolate|context`, docs/benchmarks.md, "Cold
spans": on tiny, isolating is 0.56-0.87x stock cold up to 1k cold tokens and 1.05-1.94x from 2k; the documents of
a 2048-token grid cell hold just under 2048 span tokens, hence 1536). That was measured on calls that recompute
nothing; a call that recomputes blocks isolates from `ISOLATE_MIN_TOKENS_RECOMPUTING`."""

ISOLATE_MIN_TOKENS_RECOMPUTING = 5120
"""`cold_spans="auto"`, a call that recomputes span blocks (any recompute setting but 0; the default
`"first+question"` is one): the cold span tokens from which its cold spans are prepared alone first. Its recompute
round then computes in context, at the end of a long prompt, most of what isolating saved: at the default,
isolating was 0.60-1.00x stock cold from 537 to 4111 prompt tokens on SmolLM2 (0.39-0.91x on tiny), where reading
them in context is stock's own computation (0.84-1.18x across four runs: this machine's spread) and full
attention's answer; 1.23x at 6142 and 1.37x at 7661 on SmolLM2 (`spanq bench rag`, docs/benchmarks.md, "Cold spans
at the default recompute"). `isolate_min_tokens` stays the least, where it is set higher."""


# A prompt with more characters than this is tokenized off the event loop before it is laid out, and refused there if
# it cannot fit the context window (~0.1 s of tokenizing; at the 8 MiB body limit, seconds that held every other
# request of the server up). Shorter ones are tokenized where they are laid out, as before.
LONG_PROMPT_CHARS = 200_000

LEAD_IN_AUTO = "auto"  # the lead-in setting that takes the start of the first document given (`lead_in_for`)
LEAD_IN_NEUTRAL = "neutral"  # the default: `lowering.NEUTRAL_LEAD_IN`, the same on every engine
LEAD_IN_MIN_TOKENS = 64
LEAD_IN_MAX_TOKENS = 256


class SpanProbe(Protocol):
    """What the generator asks of an engine's prefix cache (`cache_probe.BlockPoolProbe`, `KVEventsMirror`)."""

    def block_hashes(self, token_ids: list[int]) -> tuple[Any, ...] | None: ...

    def holds(self, hashes: tuple[Any, ...] | None) -> bool: ...

    def cached(self, token_ids: list[int]) -> bool: ...

    def cached_blocks(self, token_ids: list[int]) -> int: ...


def _plus_texts(n: Any) -> tuple[str, ...] | None:
    """A `plus` whose children are all texts, distinct: their texts in its order (else None). An empty text (a
    retriever's empty document) is no child: it adds nothing to the prompt."""
    if not isinstance(n, Plus) or not all(isinstance(c, (Fragment, User)) for c in n.children):
        return None
    texts = tuple(c.text for c in n.children if c.text)
    return texts if texts and len(set(texts)) == len(texts) else None


def plus_orders(node: Any) -> list[tuple[str, ...]]:
    """The texts of each text-only `plus` of `node` (`_plus_texts`), in the order the node gives them."""
    return [texts for _, n in walk(node) if (texts := _plus_texts(n)) is not None]


def in_order(node: Any, order_of: Callable[[frozenset[str]], tuple[str, ...] | None]) -> Any:
    """`node` with each text-only `plus` whose set of texts `order_of` knows laid out in that order (a `plus`
    says its children's order does not matter)."""
    from spanq_integrations.query.ir import transform

    def reorder(n: Any) -> Any:
        texts = _plus_texts(n)
        order = order_of(frozenset(texts)) if texts is not None else None
        if order is None or texts == order:
            return n
        by_text = {c.text: c for c in n.children}
        return n.model_copy(update={"children": tuple(by_text[t] for t in order)})

    return transform(node, reorder)


def _log_progress(m: CallMetrics, path: str) -> None:
    """A call's line of progress (shown by default, `logs.py`): the spans it prepared, or the new documents it read in
    context and will prepare when the engine is idle; named "the query" where it is the query's own call."""
    where = "the query" if path == "$" else f"the generate at {path}"
    if m.prepared_spans:
        log.info("prepared %d span%s (%d tokens) for %s", m.prepared_spans, "" if m.prepared_spans == 1 else "s",
                 m.prepared_tokens, where)  # fmt: skip
    if m.deferred_spans:
        log.info("read %d new document%s in context for %s; preparing them as spans when idle", m.deferred_spans,
                 "" if m.deferred_spans == 1 else "s", where)  # fmt: skip


def between_parts(done: concurrent.futures.Future[int], waiting: bool) -> None:
    """Mark a deferred prompt computed in parts as waiting for its next part (queued again until no call runs) or
    not: a call waits only for a prepare that can finish while it waits (`SpanGenerator._await_pending`)."""
    done.spanq_between_parts = waiting  # type: ignore[attr-defined]


# Tokens of deferred prepares computed at once, wherever they run (`SpanEngine._start_idle` on the embedded engine,
# `SpanGenerator._when_idle` on `spanq serve`): a call that arrives meanwhile waits for them (~1 s on SmolLM2 here),
# never for the whole backlog.
IDLE_BATCH_TOKENS = 512


def idle_part(have: int, reached: int, budget: int, block_size: int) -> tuple[int, int]:
    """Where the next part of a deferred prompt starts and ends (token offsets): past what the cache holds of it
    (`have`) and past the last part (`reached`: should that part's blocks have been evicted since, this one computes
    them again with its own, so every part goes further), whole blocks up to `budget` tokens, one block at least.
    A prompt no longer than the end is computed whole, as its last part."""
    start = max(have, reached)
    return start, start + max(block_size, budget // block_size * block_size)


def budget_after(budget: int, computed: int, block_size: int) -> int:
    """The whole blocks of an idle batch's token budget left once a part computing `computed` tokens is in it."""
    return (budget - computed) // block_size * block_size


def _can_finish_while_others_run(done: concurrent.futures.Future[int]) -> bool:
    """A deferred prepare under way in the engine (not queued, nor between its parts): it finishes beside calls."""
    return done.running() and not getattr(done, "spanq_between_parts", False)


def settle_deferred(done: concurrent.futures.Future[int], why: object) -> None:
    """End a deferred prepare that will not run or finish: cancelled while queued; failed once under way (a future
    under way cannot be cancelled, and one left pending would keep the calls that wait for it waiting)."""
    if done.done() or done.cancel():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # finished meanwhile
        done.set_exception(RuntimeError(f"the deferred prepare did not finish: {why}"))


class SpanGenerator:
    """Lowers closed `Generate`s, prepares their spans and runs them on the engine behind `stream`."""

    def __init__(
        self,
        stream: RequestStream,
        tokenizer: Tokenizer,
        *,
        block_size: int,
        max_model_len: int | None,
        model_name: str,
        default_max_tokens: int = 256,
        spans: bool = True,
        generated_ids: Callable[[Assistant], GeneratedSpan | None] | None = None,
        span_probe: SpanProbe | None = None,
        fallback: str | None = None,
        default_anchor: AnchorPolicy = DEFAULT_ANCHOR,
        default_recompute: Recompute = DEFAULT_RECOMPUTE,
        batch: Callable[[], AbstractContextManager[Any]] | None = None,
        default_lead_in: str = LEAD_IN_NEUTRAL,
        cold_spans: str = "auto",
        isolate_min_tokens: int = ISOLATE_MIN_TOKENS,
        background: Callable[[list[tuple[list[int], concurrent.futures.Future[int]]]], None] | None = None,
        read_in_context: bool = True,
        keep_span_order: bool = False,
        attention_scores: Callable[[str], Awaitable[dict[str, Any] | None]] | None = None,
    ):
        self.stream = stream
        # A probe's result from the engine's worker (`vllm_integration/attention_probe.take`, in process or through
        # collective_rpc); None: this backend cannot read attention, and recompute="attention" falls back.
        self.attention_scores = attention_scores
        self._probed: OrderedDict[tuple[Any, ...], list[float]] = OrderedDict()  # prompt -> the probe's block mass
        self.keep_span_order = keep_span_order  # False: one order per set (`lowering.span_order`)
        # Requests opened inside `with batch():` reach the engine together, in order, before its next step (the
        # embedded engine holds its thread; elsewhere they are submitted back to back and usually share a step).
        self.batch = batch or nullcontext
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.spans = spans  # False: a stock engine's prompts (flattened messages, no span layout)
        # Why spans are off on a span engine (its workers cannot move keys): reported on every call whose
        # spans were flattened because of it.
        self.fallback = fallback
        self.default_anchor = default_anchor  # the anchor policy of a `plus` that names none
        self.default_recompute = default_recompute  # span blocks recomputed in context, for a call that says nothing
        self.default_lead_in = default_lead_in  # what a canonical anchor reads before the span (`lead_in_for`)
        self.corpus_lead_in: str | None = None  # "auto": the document picked, once
        # Spans not in the cache: computed alone first ("isolate"), in context by the answer ("context"), or as
        # `cold_policy` decides ("auto"). `background` runs deferred prepares when the engine is idle (the host's
        # own way; by default a task on the caller's loop waits until no call of this generator runs).
        self.cold_spans = cold_spans
        self.isolate_min_tokens = isolate_min_tokens
        self.background = background
        self.active_calls = 0
        self._waiting_calls = 0  # calls waiting in `_await_pending` (nothing of theirs in the engine meanwhile)
        # Requests of the engine's other routes under way (`spanq serve`'s stock OpenAI routes: `outside_request`):
        # deferred prepares wait for them too, as for calls.
        self.outside_requests = 0
        self.on_quiet: Callable[[], None] | None = None  # told when no call runs (`calls_running`): a host's queue
        self._deferred_waiters: list[asyncio.Future[None]] = []
        # Long stock prompts tokenized on a thread (`_refuse_over_long`), by text: their layout reuses the tokens.
        self._long_prompts: OrderedDict[str, list[int]] = OrderedDict()
        self._background_tasks: set[asyncio.Task[None]] = set()
        # Deferred prepares this generator runs itself (no `background` host: `spanq serve`), and their one worker
        self._idle_todo: collections.deque[tuple[list[int], concurrent.futures.Future[int]]] = collections.deque()
        self._idle_worker: asyncio.Task[None] | None = None
        # Deferred prepares handed to the engine and not done yet: prompt -> done (tokens computed)
        self._pending: dict[tuple[int, ...], concurrent.futures.Future[int]] = {}
        self._deferred_full = False  # `MAX_DEFERRED` reached (said once in the log until the queue moves)
        # Whether a `[anchor][span]` prompt is wholly in the prefix cache (the engine's probe tells): its
        # prepare request would compute nothing, so it is skipped.
        self.span_probe = span_probe
        self.span_cached: Callable[[list[int]], bool] | None = span_probe.cached if span_probe is not None else None
        # Whether a `[anchor][span]` prompt the cache does not hold is in the engine's span tier (loaded by its
        # prepare request, `spanq_backend/vllm_integration/tier.py`); None: the engine has no tier.
        self.span_in_tier: Callable[[list[int]], bool] | None = (
            span_probe.in_tier if getattr(span_probe, "tier", None) is not None else None  # type: ignore[attr-defined]
        )
        # Whether such a prompt has a block neither cached nor in the tier any more (a file refused or evicted)
        self.span_tier_lost: Callable[[list[int]], bool] | None = (
            span_probe.tier_lost if getattr(span_probe, "tier", None) is not None else None  # type: ignore[attr-defined]
        )
        metrics.register()  # spanq's counters in vLLM's Prometheus registry (once per process)
        # Nested generation: the output ids of the aligned generations this generator ran itself (by prompt
        # and text), unless the host supplies its own lookup.
        self.generated_ids = generated_ids or self._remembered_ids
        self._generated: OrderedDict[tuple[tuple[int, ...], str], tuple[int, ...]] = OrderedDict()
        # The spans this generator prepared (or found cached): text digest -> the block hashes of its prepare
        # prompt (computed once), so that `cached_span_digests` can say which of them the cache still holds
        # (what a cluster router routes on).
        self._span_blocks: OrderedDict[str, tuple[Any, ...] | None] = OrderedDict()
        # and on an engine with a span tier, the names the tier gives those blocks (`tier_span_digests`)
        self._span_tier_keys: dict[str, tuple[Any, ...] | None] = {}
        self._remembered_blocks = 0  # the block hashes `_span_blocks` and `_span_tier_keys` hold in all
        # A call whose documents the cache holds in context, as a stock prompt laid them out in the order an
        # earlier call of this generator read them in context, is read that way when that computes at most a
        # block more than the span layout would (`in_context`): stock canonical's speed and full attention.
        # The order each set of `plus` texts was last read in context: set of texts -> texts in order.
        self.read_in_context = read_in_context
        self._orders: OrderedDict[frozenset[str], tuple[str, ...]] = OrderedDict()
        # The tokens of documents read in context, by the prompt's text up to their end (`PrefixTokens`)
        self.prefix_tokens = PrefixTokens(tokenizer)
        self.pad_token_id = tokenizer.encode("\n", add_special_tokens=False)[-1]
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    REMEMBERED_GENERATIONS = 1024

    def _output_ids(self, run: TokenRun) -> tuple[int, ...] | None:
        """The run's output ids that spell exactly its text: a trailing end-of-sequence token dropped (its KV is
        never computed, and the text does not show it), and trailing tokens that end in the middle of a
        character (the text holds them back). None if no ids do: a special token inside the output (the text
        skips it), text cut at a stop string."""
        out = run.token_ids
        while out and out[-1] in self._special_ids:
            out.pop()
        for end in range(len(out), max(0, len(out) - 4), -1):
            if self.tokenizer.decode(out[:end], skip_special_tokens=False) == run.text:
                return tuple(out[:end])
        return None

    def _remember(self, lowered: LoweredPrompt, text: str, output_ids: tuple[int, ...]) -> None:
        key = (tuple(lowered.token_ids), text)
        self._generated[key] = output_ids
        self._generated.move_to_end(key)
        while len(self._generated) > self.REMEMBERED_GENERATIONS:
            self._generated.popitem(last=False)

    REMEMBERED_ORDERS = 4096
    # `as_stock`: a call whose spans are all cached reads the stock prompt where that computes at most this many
    # times the tokens the span layout computes. Measured on SmolLM2 (`spanq bench rag --grid`'s subset columns,
    # docs/benchmarks.md, "Small documents read again: the stock prompt"): at 1.13 times, the spans were 0.90-0.95x
    # stock's speed; at 1.39, 1.16x; at 1.54, 1.26x (a computed token of the span layout costs more: it attends to
    # the whole prompt, beside moves and recompute requests).
    STOCK_READ_FACTOR = 1.25

    def _learn_documents(self, call: Generate, ids: list[int]) -> None:
        """After a call read its documents in context (the stock prompt `ids`): keep their tokens, so that the next
        call over them in this order (`seen_in_context`) tokenizes only its question."""
        texts = [t for group in plus_orders(call.input) for t in group]
        if not texts or not self.prefix_tokens.enabled:
            return
        text = self._stock_text(call.input)
        end = documents_end(text, texts)
        if end is not None:
            self._learn_tokens(text, end, ids)

    def _learn_tokens(self, text: str, end: int, ids: list[int]) -> None:
        try:
            self.prefix_tokens.learn(text, end, ids)
        except Exception as e:  # noqa: BLE001 - the answer is done: only a later call's shortcut is lost
            log.info("prompt tokens not kept: %s", e)

    def _remember_orders(self, node: Any) -> None:
        for order in plus_orders(node):
            key = frozenset(order)
            self._orders[key] = order
            self._orders.move_to_end(key)
        while len(self._orders) > self.REMEMBERED_ORDERS:
            self._orders.popitem(last=False)

    def in_context(
        self, call: Generate, lowered: LoweredPrompt, seen: tuple[LoweredPrompt, int] | None = None
    ) -> LoweredPrompt | None:
        """The stock layout of a call, where the prefix cache holds its documents in context so that it computes
        at most a block more than the span layout `lowered` would with every span cached (the least it can); else
        None.

        A `plus` is order-free, so the stock layout is laid out in the order this generator last read the same
        texts in context (a call that read them cold, in context, or this way); texts it never read so are not
        probed at all. What it finds is the in-context KV of exactly these tokens (a plain prompt's block
        hashes), so the answer is full attention: what stock vLLM answers over those documents in that order.
        `seen`: that layout and how many of its leading blocks the cache holds, where `seen_in_context` worked
        them out for this call already."""
        probe = self.span_probe
        counted = getattr(probe, "cached_blocks", None)
        if not self.read_in_context or counted is None or not lowered.has_spans:
            return None
        if (call.cold_spans or self.cold_spans) == "isolate":
            return None  # asked for answers that do not depend on what was read before (judges, bulk runs)
        orders = plus_orders(call.input)
        if not orders or any(frozenset(order) not in self._orders for order in orders):
            return None  # documents this generator never read in context: not cached so (and nothing to pay)
        span_computes = self._least_computes(lowered, self.cached_prefix(lowered))
        node = in_order(call.input, self._orders.get)
        stock, held = seen if seen is not None else (self._stock_layout(call, node), None)
        if stock is None:
            return None
        if held is None:
            held = counted(stock.token_ids)
        # Up to a block more than the spans: each computes a partial block before the question (stock its last
        # document's end, spans the last document's tail), one as much as the other on average; for that, nothing
        # moved and full attention's answer.
        if len(stock.token_ids) - held * self.block_size > span_computes + self.block_size:
            return None
        self._remember_orders(node)  # read in this order again: the most recent
        return stock

    def cached_prefix(self, lowered: LoweredPrompt) -> int:
        """The tokens of the span layout's prefix (before its first span) the cache holds: all of them, or none."""
        prefix = lowered.token_ids[: lowered.table.spans[0][0]]
        return len(prefix) if prefix and self.span_probe is not None and self.span_probe.cached(prefix) else 0

    @staticmethod
    def _least_computes(lowered: LoweredPrompt, cached_prefix: int) -> int:
        """The tokens the span layout computes with every span read from the cache and nothing recomputed (the
        least it can), its prefix cached up to `cached_prefix`."""
        return len(lowered.token_ids) - sum(end - start for start, end in lowered.table.spans) - cached_prefix

    def span_computes(
        self, call: Generate, lowered: LoweredPrompt, plan: RecomputePlan | None = None, prefix: int | None = None
    ) -> int:
        """The tokens the span layout `lowered` computes with every span cached: all but the span blocks it reads
        from the cache (those it recomputes in context count: `plan`, else worked out here; `recompute="attention"`
        counted as `"question"` chooses, the same number of blocks) and a cached prefix (`prefix`, where
        `cached_prefix` was worked out)."""
        if plan is None and self.recompute_of(call):
            plan = self.recompute_plan(call, lowered)
        prefix = self.cached_prefix(lowered) if prefix is None else prefix
        return self._least_computes(lowered, prefix) + (plan.tokens if plan is not None else 0)

    def known_plan(self, call: Generate, lowered: LoweredPrompt) -> RecomputePlan | None:
        """The recompute plan the answer runs, where it can be worked out before the call's own round (not for
        `"attention"`: its probe's pass comes first)."""
        return self.recompute_plan(call, lowered) if self.recompute_of(call) != "attention" else None

    def as_stock(
        self, call: Generate, lowered: LoweredPrompt, plan: RecomputePlan | None = None, span_output: bool = False
    ) -> LoweredPrompt | None:
        """The stock prompt of a call in the order given, where reading it computes at most `STOCK_READ_FACTOR`
        times what the span layout `lowered` computes with its spans read from the cache (every span, or with its
        cold ones laid out as context after them): small documents, most of whose blocks the default recompute
        computes in context again (a 76-token document is ~2.4 blocks of 32 tokens: up to both whole ones
        recomputed, the partial one computed as context, padding after it). There the span layout's moves,
        recompute requests and padding cost more than the stock prompt's extra tokens, and the stock prompt is
        full attention's answer. None: the span layout. Not where reading in context is off, nor for a call that
        asks `cold_spans="isolate"` (answers that do not depend on the order given), nor where spans are read or
        written that the stock prompt lacks (generated outputs, `span_output`).

        Counted without tokenizing the stock prompt: it is the span layout's tokens less its padding (the
        documents tokenized together or apart differ by a token or two), and its prefix cache is taken to hold
        only what the span layout's prefix finds (an order this generator read in context before is
        `in_context`'s)."""
        if (not self.read_in_context or not lowered.has_spans or span_output or lowered.generated_spans
                or (call.cold_spans or self.cold_spans) == "isolate"):  # fmt: skip
            return None
        prefix = self.cached_prefix(lowered)
        span = self.span_computes(call, lowered, plan, prefix)
        # The span layout pads its prefix to a block; the stock prompt's block that holds the prefix's end holds the
        # first document's start too: not cached.
        held = (prefix - 1) // self.block_size * self.block_size if prefix else 0
        stock = len(lowered.token_ids) - lowered.padded_tokens - held
        if stock > self.STOCK_READ_FACTOR * span:
            return None
        # (The call then remembers this order and keeps the documents' tokens, as a cold read in context does.)
        return self._stock_layout(call, call.input)

    def in_context_later(self, call: Generate, lowered: LoweredPrompt) -> list[int] | None:
        """For a call whose cold documents were prepared alone first: the stock prompt over its documents in the
        order the spans read them, to be computed when the engine is idle; the order is remembered. The next call
        over the same set, in any order, then finds the documents in context (`in_context`) and reads them as
        stock canonical does: full attention's answer, nothing recomputed or moved. None where `in_context` would
        never read them so (a call that asks "isolate", reading in context off, an engine with a span tier, whose
        plain prompts would be saved there) or this order is remembered already."""
        if (not self.read_in_context or self.span_in_tier is not None or not lowered.has_spans
                or lowered.generated_spans or (call.cold_spans or self.cold_spans) == "isolate"):  # fmt: skip
            return None
        orders = plus_orders(call.input)
        read = {frozenset(o): tuple(lowered.in_span_order(o)) for o in orders}
        if not orders or all(self._orders.get(key) == order for key, order in read.items()):
            return None
        node = in_order(call.input, read.get)
        stock = self._stock_layout(call, node)
        if stock is None:
            return None
        self._remember_orders(node)
        return stock.token_ids

    def _stock_layout(self, call: Generate, node: Any) -> LoweredPrompt | None:
        """The prompt stock vLLM reads for `call` with `node` as its input (None where it cannot be laid out)."""
        try:
            return self._lower(call.model_copy(update={"input": node}), stock=True)[0]
        except SpanQueryError:
            return None

    # The spans `cached_span_digests` can report: at most this many, holding at most REMEMBERED_BLOCKS block hashes
    # among them (~65 bytes each, the anchor's blocks in every span's: a 1k-token document behind the lead-in holds
    # ~40, and 65,536 of them held ~180 MB), the least recently used forgotten first.
    REMEMBERED_SPANS = 65536
    REMEMBERED_BLOCKS = 1 << 18

    def _note_spans(self, lowered: LoweredPrompt) -> None:
        if self.span_probe is None:
            return  # nothing could tell later which of them the cache holds
        tiered = self.span_in_tier is not None
        for i, text in enumerate(lowered.span_texts[: len(lowered.table.spans)]):
            key = span_digest(text)  # under the anchor it was last prepared on
            prompt = lowered.prepare_prompt(i)
            hashes = self.span_probe.block_hashes(prompt)
            self._remembered_blocks += len(hashes or ()) - len(self._span_blocks.get(key) or ())
            self._span_blocks[key] = hashes
            self._span_blocks.move_to_end(key)
            if tiered:
                keys = self.span_probe.tier_keys(prompt)  # type: ignore[attr-defined]
                self._remembered_blocks += len(keys or ()) - len(self._span_tier_keys.get(key) or ())
                self._span_tier_keys[key] = keys
        while len(self._span_blocks) > 1 and (
            len(self._span_blocks) > self.REMEMBERED_SPANS or self._remembered_blocks > self.REMEMBERED_BLOCKS
        ):
            key, hashes = self._span_blocks.popitem(last=False)
            self._remembered_blocks -= len(hashes or ()) + len(self._span_tier_keys.pop(key, None) or ())

    def cached_span_digests(self) -> list[str]:
        """The digests (`span_digest` of the text) of the spans this generator prepared whose KV the engine's
        cache still holds, most recently used last; empty where the cache cannot be probed."""
        if self.span_probe is None:
            return []
        return [key for key, blocks in list(self._span_blocks.items()) if self.span_probe.holds(blocks)]

    def tier_span_digests(self) -> list[str]:
        """The digests of the spans this generator prepared whose every block (of `[anchor][span]`) the engine's
        span tier holds, most recently used last: what any engine on the tier's folder loads instead of computing.
        Empty without a tier. One lookup a block, in the tier's index or (a block not in it) on its disk."""
        if self.span_in_tier is None:
            return []
        holds = self.span_probe.tier_holds_keys  # type: ignore[union-attr]
        return [key for key in list(self._span_blocks) if holds(self._span_tier_keys.get(key))]

    def tier_identity(self) -> str | None:
        """Which tier folder the engine's span tier is (`DiskTier.identity`); None without a tier."""
        tier = getattr(self.span_probe, "tier", None)
        return None if tier is None or self.span_in_tier is None else tier.identity

    def _remembered_ids(self, node: Assistant) -> GeneratedSpan | None:
        if not isinstance(node.source, Generate) or not self.spans:
            return None  # not generated, or combined in code: read as text
        try:
            lowered = self._lower(node.source, align_output=True)[0]
        except SpanQueryError:
            return None
        out = self._generated.get((tuple(lowered.token_ids), node.text))
        return None if out is None else GeneratedSpan(tuple(lowered.token_ids), out)

    def lead_in_for(self, call: Generate) -> str:
        """The lead-in of this call's canonical anchors. "neutral" (the default): `NEUTRAL_LEAD_IN`, the same text
        on every engine, so replicas and restarts compute the same span KV and give the same answers. "none" (or
        ""): nothing. "auto": the start of the first document this generator was given (`LEAD_IN_MIN_TOKENS` or
        more; its first `LEAD_IN_MAX_TOKENS`), kept for its lifetime so every span shares one anchor (a neutral
        one until then): closer to full attention (docs/benchmarks.md, "The lead-in"), but an engine's answers
        then depend on which document it read first. Any other text is itself."""
        setting = self.default_lead_in
        if setting == LEAD_IN_NEUTRAL:
            return NEUTRAL_LEAD_IN
        if setting in ("none", ""):
            return ""
        if setting != LEAD_IN_AUTO:
            return setting
        if self.corpus_lead_in is None:
            picked = self._first_document(call)
            if picked is not None:
                self.corpus_lead_in = picked
                log.info("spans read %d tokens of the first document given as their lead-in (--span-lead-in)",
                         len(self.tokenizer.encode(picked, add_special_tokens=False)))
        return self.corpus_lead_in if self.corpus_lead_in is not None else NEUTRAL_LEAD_IN

    def _first_document(self, call: Generate) -> str | None:
        for _, node in walk(call.input):
            if not isinstance(node, Plus):
                continue
            for child in node.children:
                if not isinstance(child, (Fragment, User)):  # documents, not generated outputs or messages
                    continue
                ids = self.tokenizer.encode(child.text, add_special_tokens=False)
                if len(ids) >= LEAD_IN_MIN_TOKENS:
                    return self.tokenizer.decode(ids[:LEAD_IN_MAX_TOKENS]).strip()
        return None

    def lower(self, call: Generate) -> LoweredPrompt:
        return self._lower(call)[0]

    def _lower(
        self, call: Generate, align_output: bool = False, as_context: frozenset[str] = frozenset(),
        stock: bool = False, check_window: bool = True,
    ) -> tuple[LoweredPrompt, bool]:
        """The call's prompt, and whether its spans were flattened (a stock engine's layout; `stock`: laid out as a
        stock engine lays it out, on a span engine too; `check_window=False`: the span layout, not checked against
        the context window)."""
        if (stock or not self.spans) and any(isinstance(n, Plus) for _, n in walk(call.input)):
            # A stock engine: the same messages, flattened, without span layout or padding (never laid out as
            # spans first: the padding would count against the context window).
            ids = self._flattened_ids(call.input)
            check_fits(ids, 0, self.max_model_len, call.max_tokens or 1)
            return LoweredPrompt(token_ids=ids, table=SpanTable(self.block_size, ())), not stock
        lowered = lower(
            call.input,
            self.tokenizer,
            self.block_size,
            self.pad_token_id,
            self.max_model_len if check_window else None,
            call.max_tokens or 1,
            generated_ids=self.generated_ids,
            default_anchor=self.default_anchor,
            align_output=align_output and self.spans,
            lead_in=self.lead_in_for(call),
            as_context=as_context,
            keep_order=self.keep_span_order,
        )
        return lowered, False

    def _flattened_ids(self, node: Any) -> list[int]:
        """`flattened_prompt_ids`, taken from `_long_prompts` where this text was tokenized there."""
        if not self._long_prompts:
            return flattened_prompt_ids(self.tokenizer, node)
        return self._text_ids(self._stock_text(node))

    def _stock_text(self, node: Any) -> str:
        """The text of a generate input's prompt as a stock engine reads it (`flattened_prompt_ids`'s)."""
        from spanq_integrations.query.flatten import to_chat_messages

        return render_chat(self.tokenizer, to_chat_messages(node), add_generation_prompt=True)

    def _text_ids(self, text: str) -> list[int]:
        ids = self._long_prompts.get(text)
        return list(ids) if ids is not None else list(self.tokenizer.encode(text, add_special_tokens=False))

    def sampling_params(self, call: Generate, seed: int | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                max_tokens=call.max_tokens or self.default_max_tokens,
                temperature=call.temperature,
                stop=list(call.stop) or None,
                seed=seed if seed is not None else call.seed,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=structured_outputs(call),
            )
        except (VLLMClientError, ValueError) as e:  # parameters vLLM refuses: the client's to fix
            raise engine_error(e) from e

    def open(self, prompt_ids: list[int], params: Any, table: SpanTable | None = None) -> AsyncIterator[Any]:
        """Submit one token request, with `table` attached out of band; its outputs come from the iterator (a
        host that submits eagerly, `SpanEngine`, has queued it when this returns). Close the iterator to abort.
        `params` are this request's own (each caller makes them for it): vLLM takes them without its deep copy."""
        if table is not None and table.spans:
            params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: table.to_extra_args()}
        # vLLM deep-copies a request's sampling parameters as it takes the request, span table and all (a table
        # lists each span's anchor tokens): on the tiny model a recompute round of 15 spans spent a quarter of
        # its forward passes' time copying them. These are the request's alone: a shallow copy, as vLLM's own
        # server makes for the parameters it builds.
        params.skip_clone = True
        return self.stream(prompt_ids, params)

    async def run(
        self,
        prompt_ids: list[int],
        params: Any,
        table: SpanTable | None = None,
        on_text: TokenCallback | None = None,
    ) -> TokenRun:
        """Run one token request to the end, with `table` attached out of band; stream its text to `on_text`."""
        return await self.consume(self.open(prompt_ids, params, table), on_text)

    async def consume(self, opened: AsyncIterator[Any], on_text: TokenCallback | None = None) -> TokenRun:
        """Read an opened request to its end; stream its text to `on_text`. Aborts it if cancelled."""
        outputs: list[Any] = []
        first: float | None = None
        async with aclosing(opened) as stream:
            async for out in stream:
                outputs.append(out)
                piece = "".join(c.text for c in out.outputs[:1])
                if piece and first is None:
                    first = time.perf_counter()
                if piece and on_text is not None:
                    maybe = on_text(piece)
                    if inspect.isawaitable(maybe):
                        await maybe
        if not outputs:
            raise BackendError("the engine finished a request without any output")
        if any(getattr(c, "finish_reason", None) == "error" for c in outputs[-1].outputs):
            # vLLM ends a request so when it could not run it (a grammar that did not compile, say): its empty
            # text is no answer, and it is the engine's failure, not the caller's
            raise BackendError("the engine ended the request with an error (finish reason \"error\"); its log "
                               "says why")
        return TokenRun(outputs, first)

    async def prepare(self, lowered: LoweredPrompt) -> int:
        """Put every span's isolated KV in the cache; returns how many spans had to be computed."""
        return (await self.prepare_detail(lowered))[0]

    async def prepare_detail(self, lowered: LoweredPrompt) -> tuple[int, int]:
        """Put every span's isolated KV in the cache (one `[anchor][span]` request each, run together).

        Returns how many spans had to be computed (the others were cached) and how many tokens that took."""
        self._note_spans(lowered)
        prompts = [lowered.prepare_prompt(i) for i in range(len(lowered.table.spans))]
        # Spans anchored elsewhere than this prompt's prefix are found only past a cached prefix (vLLM looks the
        # cache up contiguously from the first block): the prefix is computed as ordinary context, beside them.
        if lowered.reads_after_another_prefix:
            prompts.append(lowered.prefix_prompt())
        computed = await self.compute_all(prompts)
        n = len(lowered.table.spans)
        return sum(1 for c in computed[:n] if c > 0), sum(computed)

    async def compute_all(self, prompts: list[list[int]]) -> list[int]:
        """`compute` each prompt (no table), in one engine step; the tokens each took (0: cached already)."""
        opened: dict[int, AsyncIterator[Any]] = {}
        with self.batch():
            for i, prompt in enumerate(prompts):
                if not prompt:
                    continue
                if self.span_cached is not None and self.span_cached(prompt):
                    metrics.count_saved_prepare()
                    continue
                opened[i] = self.open_compute(prompt)
        done = await _gather_or_abort([self._computed(len(prompts[i]), o) for i, o in opened.items()], list(opened.values()))
        taken = dict(zip(opened, done))
        return [taken.get(i, 0) for i in range(len(prompts))]

    async def compute(self, prompt: list[int], table: SpanTable | None = None) -> int:
        """Put `prompt` (whole blocks, laid out by `table`) in the cache; the tokens it took (0: it was cached
        already)."""
        if not prompt:
            return 0
        if table is None and self.span_cached is not None and self.span_cached(prompt):
            metrics.count_saved_prepare()
            return 0
        return await self._computed(len(prompt), self.open_compute(prompt, table))

    def defer(self, prompts: list[list[int]], also: list[list[int]] = ()) -> None:
        """Compute these prompts (span prepares: `[anchor][span]`; `also`: other prompts of the span layout, its
        padded prefix) when the engine is idle, off every call's path: through the host's `background` hook, or
        on this loop once no call of this generator is running. A call that needs one of them before it is done
        waits for it (`_await_pending`) instead of computing the span in context again. Each is counted when
        done (`metrics.count_prepared`: spans and their tokens; `also`, tokens only)."""
        items = []
        for prompt, is_span in [*((p, True) for p in prompts), *((p, False) for p in also)]:
            key = tuple(prompt)
            if key in self._pending:
                continue
            if len(self._pending) >= self.MAX_DEFERRED:  # an engine never idle: the spans stay computed when read
                if not self._deferred_full:
                    log.warning("%d span prepares wait for the engine to be idle: no more are deferred until they "
                                "run", len(self._pending))
                self._deferred_full = True
                break
            self._deferred_full = False
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            self._pending[key] = done
            done.add_done_callback(lambda f, key=key, is_span=is_span: self._deferred_done(key, f, is_span))
            items.append((prompt, done))
        if not items:
            return
        if self.background is not None:
            self.background([(p + [self.pad_token_id], f) for p, f in items])
            return
        # One queue and one worker for the generator (`spanq serve`): the cap on what runs at once holds for the
        # server, however many calls deferred prepares.
        self._idle_todo.extend(items)
        loop = asyncio.get_running_loop()
        worker = self._idle_worker
        if worker is None or worker.done() or worker.get_loop() is not loop:
            worker = self._idle_worker = loop.create_task(self._when_idle())
            self._background_tasks.add(worker)
            worker.add_done_callback(self._background_tasks.discard)

    def _deferred_done(self, key: tuple[int, ...], done: concurrent.futures.Future[int], is_span: bool) -> None:
        self._pending.pop(key, None)
        if not done.cancelled() and done.exception() is None:
            computed = done.result()
            metrics.count_prepared(1 if is_span and computed else 0, computed)

    # Tokens of deferred prepares computed at once where this generator runs them (`spanq serve`). A longer prompt
    # goes in parts of whole blocks, each on the blocks the last cached (`idle_part`).
    IDLE_BATCH_TOKENS = IDLE_BATCH_TOKENS

    async def _when_idle(self) -> None:
        """The generator's deferred prepares (`_idle_todo`), when no call runs, until none is left."""
        bs = self.block_size
        counted = getattr(self.span_probe, "cached_blocks", None)
        todo = self._idle_todo
        progress: dict[concurrent.futures.Future[int], tuple[int, int]] = {}  # tokens computed, prefix reached
        batch: list[tuple[list[int], concurrent.futures.Future[int], bool]] = []
        try:
            while todo:
                while self.calls_running():
                    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    self._deferred_waiters.append(waiter)
                    await waiter
                batch = []
                budget = self.IDLE_BATCH_TOKENS
                while todo and budget > 0:
                    prompt, done = todo[0]
                    if not done.running() and not done.set_running_or_notify_cancel():  # cancelled while queued
                        todo.popleft()
                        continue
                    total, reached = progress.get(done, (0, 0))
                    have = counted(prompt) * bs if counted is not None else 0  # what the cache holds of it now
                    if counted is not None and have >= len(prompt) // bs * bs:
                        todo.popleft()
                        progress.pop(done, None)
                        if not total:
                            metrics.count_saved_prepare()  # cached meanwhile: no request
                        done.set_result(total)
                        continue
                    start, cut = idle_part(have, reached, budget, bs)
                    last = cut >= len(prompt)
                    if last:
                        todo.popleft()
                    else:
                        progress[done] = (total, cut)
                    between_parts(done, False)
                    batch.append((prompt if last else prompt[:cut], done, last))
                    budget = budget_after(budget, (len(prompt) if last else cut) - start, bs)
                computed = await self.compute_all([part for part, _, _ in batch])
                for (_, done, last), c in zip(batch, computed):
                    total, reached = progress.pop(done, (0, 0))
                    if last:
                        done.set_result(total + c)
                    else:
                        progress[done] = (total + c, reached)
                        between_parts(done, True)  # the next part waits for no call to run
        except BaseException as e:  # a deferred prepare is an optimisation: never an error of a call
            if not isinstance(e, asyncio.CancelledError):
                log.warning("a deferred span prepare failed: %s", e)
            for done in [*(d for _, d, _ in batch), *progress, *(d for _, d in todo)]:
                settle_deferred(done, e)
            todo.clear()
            if isinstance(e, asyncio.CancelledError):
                raise

    MAX_DEFERRED = 1024  # prompts waiting for the engine to be idle, at most (`defer`)
    PENDING_WAIT_S = 60.0  # the most a call waits for deferred prepares of its spans that are under way

    PENDING_RECHECK_S = 0.05  # how often a waiting call looks again whether a queued prepare can still start

    async def _await_pending(self, prompts: list[list[int]]) -> None:
        """Wait (at most `PENDING_WAIT_S`) for the deferred prepares of these prompts still to finish: those under
        way, and those queued or between their parts while no other call runs. While it waits the call is not
        counted as running (`calls_running`), so prepares queued for a quiet engine can start; a queued one (or the
        next part of one) does not start while other calls run, so it is not waited for then (the call computes
        those spans itself, as its cold policy says). Waiting never cancels a prepare (other calls may wait for it
        too); the caller's own cancellation goes through."""
        futures = [f for p in prompts if (f := self._pending.get(tuple(p))) is not None]
        if not futures:
            return
        waits = {f: asyncio.wrap_future(f) for f in futures}
        for w in waits.values():  # a failed prepare is the queue's to log, not this call's
            w.add_done_callback(lambda w: w.cancelled() or w.exception())
        self._waiting_calls += 1
        try:
            if not self.calls_running():
                self._quiet()
            deadline = time.monotonic() + self.PENDING_WAIT_S
            while (left := deadline - time.monotonic()) > 0:
                busy = self.calls_running() > 0
                wanted = [w for f, w in waits.items() if not f.done() and (not busy or _can_finish_while_others_run(f))]
                if not wanted:
                    break
                # on a timeout or a cancel none is cancelled; looked at again, as another call may have started
                await asyncio.wait(wanted, timeout=min(left, self.PENDING_RECHECK_S), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiting_calls -= 1

    def open_compute(self, prompt: list[int], table: SpanTable | None = None) -> AsyncIterator[Any]:
        """Submit the request that puts `prompt` (whole blocks, laid out by `table`) in the cache."""
        from vllm import SamplingParams

        # One token past the span: vLLM always recomputes a prompt's last token, and this way that is all it
        # recomputes when the span is cached already (not the span's whole last block).
        params = SamplingParams(max_tokens=1, temperature=0.0)
        if table is None and self.span_in_tier is not None:
            from spanq_backend.vllm_integration.tier import tier_params

            params.extra_args = tier_params()  # a prepare: its blocks are saved to the engine's span tier
        return self.open(prompt + [self.pad_token_id], params, table)

    async def _computed(self, length: int, opened: AsyncIterator[Any]) -> int:
        run = await self.consume(opened)
        return max(0, length - run.cached_tokens)

    def recompute_of(self, call: Generate) -> Recompute:
        """The call's recompute setting, else the engine's (`default_recompute`)."""
        return call.recompute if call.recompute is not None else self.default_recompute

    def recompute_plan(self, call: Generate, lowered: LoweredPrompt, block_mass: list[float] | None = None) -> RecomputePlan:
        """Which of the prompt's span blocks the call recomputes in context, and the layout that does it
        (`"attention"` ranks by `block_mass`, what `probe_attention` read; without it, by the question's words)."""
        setting = self.recompute_of(call)
        if not lowered.has_spans or not setting:  # 0 (or 0.0): nothing recomputed
            return RecomputePlan(lowered, (), ())
        return plan_recompute(lowered, choose_blocks(lowered, setting, self.pad_token_id, block_mass))

    async def plan(self, call: Generate, lowered: LoweredPrompt) -> tuple[RecomputePlan, dict[str, Any]]:
        """`recompute_plan`, with the attention probe's pass first where the call's setting is `"attention"`;
        what the probe did (its tokens and rows, or why it fell back to the question's words)."""
        setting = self.recompute_of(call)
        if setting != "attention" or not lowered.has_spans:
            return self.recompute_plan(call, lowered), {}
        mass, probe = await self.probe_attention(lowered)
        return self.recompute_plan(call, lowered, mass), probe

    async def probe_attention(self, lowered: LoweredPrompt) -> tuple[list[float] | None, dict[str, Any]]:
        """The attention the question gives each block of the prompt at the model's middle layer, its spans read
        from the cache as they are (nothing recomputed): one request over the prompt, `max_tokens=1`, read by the
        engine's worker (`vllm_integration/attention_probe.py`). The same prompt again reuses its ranking (one
        probe a prompt, not one a call). None, and why, where it cannot be read."""
        from vllm import SamplingParams

        from spanq_backend.vllm_integration.attention_probe import probe_params

        if self.attention_scores is None:
            return None, {"fallback": "this backend cannot read attention (recompute=\"attention\" chose by the question's words)"}
        key = (tuple(lowered.token_ids), lowered.table)
        if key in self._probed:
            self._probed.move_to_end(key)
            return self._probed[key], {"reused": True}
        probe_id = uuid.uuid4().hex
        params = SamplingParams(max_tokens=1, temperature=0.0)
        rows_from = question_start(lowered, self.pad_token_id)
        params.extra_args = probe_params(probe_id, rows_from)
        run = await self.run(lowered.token_ids, params, lowered.table)
        result = await self.attention_scores(probe_id) or {"error": "the engine kept no probe result"}
        info: dict[str, Any] = {"tokens": max(0, len(lowered.token_ids) - run.cached_tokens)}
        if "error" in result:
            log.info("attention probe: %s; recompute chose by the question's words", result["error"])
            return None, {**info, "fallback": f"{result['error']} (recompute=\"attention\" chose by the question's words)"}
        asked = len(lowered.token_ids) - rows_from
        if int(result["rows"]) < asked:  # never expected: the probe's question blocks are its own (salted)
            return None, {**info, "fallback": f"the probe read {result['rows']} of the question's {asked} rows "
                                              "(recompute=\"attention\" chose by the question's words)"}
        mass = [float(x) for x in result["blocks"]]
        self._probed[key] = mass
        while len(self._probed) > 64:
            self._probed.popitem(last=False)
        return mass, {**info, "rows": int(result["rows"]), "layer": result.get("layer")}

    def open_recompute(self, plan: RecomputePlan) -> list[tuple[int, AsyncIterator[Any]]]:
        """Submit the requests that compute the plan's recomputed runs in context, all at once, in prompt order
        (the caller submits the call's own request right after them, in the same batch): `(run's end, request)`.

        They run in one engine step. vLLM registers a block's hash when it schedules the request that computes
        it, and every layer writes the step's K/V before attending: run k finds runs j < k's blocks in the
        cache and attends to their in-context K/V as computed in this same step, exactly what one request after
        another computed. Where a step cannot hold them all (`max_num_seqs`, the token budget) the rest follow
        in the next, still exact."""
        ids, table = plan.lowered.token_ids, plan.lowered.table
        return [(end, self.open_compute(ids[:end], table.truncated(end))) for end in plan.ends]

    async def recompute(self, plan: RecomputePlan) -> int:
        """Compute the plan's recomputed blocks in context (in one engine step, `open_recompute`); the tokens
        that took."""
        with self.batch():
            opened = self.open_recompute(plan)
        done = await _gather_or_abort([self._computed(end, o) for end, o in opened], [o for _, o in opened])
        return sum(done)

    async def seal(self, lowered: LoweredPrompt, runs: list[TokenRun]) -> tuple[int, int]:
        """Make each run's output a span a judge reads on this prompt: remember its ids, and compute its last
        block (the generation never computed its final token's KV; the separator and padding follow it) as
        soon as it is done. Returns how many outputs were sealed, how many of them computed anything (the
        others were cached already: prepared spans count only those) and the tokens that took."""
        sealed: list[Any] = []
        for run in runs:
            out = self._output_ids(run)
            if out is None:
                continue
            self._remember(lowered, run.text, out)
            span = generated_span_ids(self.tokenizer, out, self.block_size, self.pad_token_id)
            sealed.append(self.compute(lowered.token_ids + span))
        computed = await asyncio.gather(*sealed)
        return len(computed), sum(1 for c in computed if c > 0), sum(computed)

    async def generate(
        self,
        call: Generate,
        *,
        path: str = "$",
        on_token: TokenCallback | None = None,
        span_output: bool = False,
    ) -> Completion:
        """Run one closed `Generate`: lower, prepare spans, run its `n` choices; with TTFT and cache usage.

        `span_output`: an outer generate reads this call's output as a span. Its prompt is laid out so the
        output starts on a block boundary, and each output is sealed (`seal`) as soon as it is done."""
        t0 = time.perf_counter()
        self.active_calls += 1
        try:
            await self._refuse_over_long(call)
            completion = await self._generate(call, path, on_token, span_output, t0)
        finally:
            self.active_calls -= 1
            if not self.calls_running():
                self._quiet()
        _log_progress(completion.metrics, path)
        return completion

    async def _refuse_over_long(self, call: Generate) -> None:
        """`ContextLengthError` for a prompt of over `LONG_PROMPT_CHARS` characters that does not fit the context
        window as a stock engine reads it (its own tokenizing, which lowering does first for such a call anyway),
        tokenized on a thread: the event loop serves other requests meanwhile (the tokenizer lets go of the GIL).
        A prompt that fits is laid out as any other."""
        if self.max_model_len is None:
            return
        if sum(len(text) for _, n in walk(call.input) if isinstance(text := getattr(n, "text", None), str)) <= LONG_PROMPT_CHARS:
            return
        from spanq_integrations.query.flatten import to_chat_messages

        chat = to_chat_messages(call.input)
        text = render_chat(self.tokenizer, chat, add_generation_prompt=True)
        ids = list(await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False))
        check_fits(ids, 0, self.max_model_len, call.max_tokens or 1)
        self._long_prompts[text] = ids
        while len(self._long_prompts) > 4:
            self._long_prompts.popitem(last=False)

    def calls_running(self) -> int:
        """Calls under way that may have work in the engine now or soon (a call waiting for deferred prepares has
        none): deferred prepares start only when there are none, so that none shares a call's steps, between its
        rounds included."""
        return self.active_calls - self._waiting_calls + self.outside_requests

    def outside_request(self, started: bool) -> None:
        """A request of the engine that is not a call (a stock chat completion on `spanq serve`) started or ended:
        deferred prepares do not share its steps (a 64-token answer beside them ran at a sixth of its speed)."""
        self.outside_requests = self.outside_requests + 1 if started else max(0, self.outside_requests - 1)
        if not started and not self.calls_running():
            self._quiet()

    def _quiet(self) -> None:
        for waiter in self._deferred_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._deferred_waiters.clear()
        if self.on_quiet is not None:
            self.on_quiet()

    def isolate_from(self, call: Generate) -> int:
        """The cold span tokens from which `"auto"` prepares a call's cold spans alone first: `isolate_min_tokens`,
        or `ISOLATE_MIN_TOKENS_RECOMPUTING` where that is more and the call recomputes span blocks (its own
        setting, else the engine's)."""
        if self.recompute_of(call):
            return max(self.isolate_min_tokens, ISOLATE_MIN_TOKENS_RECOMPUTING)
        return self.isolate_min_tokens

    def cold_policy(
        self, lowered: LoweredPrompt, cold: list[int], setting: str | None = None, min_tokens: int | None = None
    ) -> str:
        """How this call computes its spans that are not cached: "isolate" (a prepare round: each alone after its
        anchor, then the answer reads them from the cache) or "context" (the answer's own request computes them
        in context, after the cached ones, as a stock prompt would; they are prepared alone later, when the
        engine is idle). Isolating pays where attention over the whole prompt costs more than a round trip: many
        cold tokens (`min_tokens`, the call's `isolate_from`; None: `isolate_min_tokens`; measured in
        docs/benchmarks.md, `rag --grid`). `setting` is the call's own (`Generate.cold_spans`); None: the
        engine's."""
        if self.span_cached is None:
            return "isolate"  # nothing says which spans are cached: prepare each (cheap where it is)
        setting = setting or self.cold_spans
        if setting != "auto":
            return setting
        threshold = self.isolate_min_tokens if min_tokens is None else min_tokens
        if self.span_in_tier is not None:
            held = [self.span_in_tier(lowered.prepare_prompt(i)) for i in cold]
            if all(held):
                return "isolate"  # their prepares load them from the engine's span tier: cheaper than reading them
            if any(held):  # prepares load these and compute the rest alone: the threshold measured without recompute
                threshold = self.isolate_min_tokens
        table = lowered.table
        cold_tokens = sum(table.spans[i][1] - table.spans[i][0] for i in cold)
        return "isolate" if cold_tokens >= threshold else "context"

    def reads_from_tier(self, lowered: LoweredPrompt, cold: list[int]) -> bool:
        """Whether the call's request can load its cold spans from the engine's span tier itself: the tier
        connector loads what follows the engine's own hit contiguously, so every span from the first cold one on
        must be in the tier (spans the engine holds included: their blocks are loaded again). Not for a call that
        recomputes blocks (its recompute runs must find the spans before them cached in the step they run: their
        prepares load them first, `cold_policy`)."""
        holds = getattr(self.span_probe, "tier_holds_all", None)
        if self.span_in_tier is None or holds is None or not cold:
            return False
        return all(holds(lowered.prepare_prompt(i)) for i in range(min(cold), len(lowered.table.spans)))

    def cold_span_indices(self, lowered: LoweredPrompt, count: bool = True) -> list[int]:
        """The spans whose `[anchor][span]` the cache does not hold wholly (all of them where it cannot be asked):
        the blocks this prompt reads, not the padded last block a prepare adds where this prompt reads that block
        as context (vLLM frees a request's last blocks first: that one alone gone, the span is still warm here)."""
        n = len(lowered.table.spans)
        if self.span_cached is None:
            return list(range(n))
        ids = lowered.token_ids
        cold = [i for i in range(n) if not self.span_cached(lowered.table.anchor_ids(i, ids) + lowered.span_ids(i))]
        for _ in range(n - len(cold) if count else 0):
            metrics.count_saved_prepare()  # a span the cache holds: no prepare request
        return cold

    async def layout(self, call: Generate, span_output: bool = False) -> CallLayout:
        """How a call is laid out now, given what the cache holds: its prompt, and what it computes where.

        Cold spans (not cached) follow `cold_policy`: under "isolate" they are prepared alone first (`isolate`);
        under "context" the `plus` groups are reordered so cached spans come first, and the cold ones become
        context after them, computed by the answer's own request (their prepares are `deferred`). A cold span
        whose deferred prepare (of an earlier call) is under way is waited for: it is cached then."""
        first_seen = self.unseen_in_context(call, span_output)
        if first_seen is not None:
            return first_seen
        seen, stock_seen = self.seen_in_context(call, span_output)
        if seen is not None:
            return seen
        try:
            lowered, flattened = self._lower(call, align_output=span_output)
        except ContextLengthError:
            fallback = None if span_output else self._too_long_for_spans(call)
            if fallback is None:
                raise  # the span layout's error: it names the document that does not fit
            return fallback
        if not lowered.has_spans:
            return CallLayout(lowered, flattened, "warm")
        spans = len(lowered.table.spans)
        self._note_spans(lowered)
        stock = None if span_output or lowered.generated_spans else self.in_context(call, lowered, stock_seen)
        if stock is not None:  # cheaper than the spans even where all are cached: read so at once
            # Its spans not cached (nor under way) are prepared when the engine is idle, as a cold read in context
            # prepares them: another set or order of these documents reads them as spans.
            return CallLayout(stock, flattened, "in-context", deferred=self._lacking(lowered, count=False), spans=spans)
        cold = self.cold_span_indices(lowered)
        if cold and self._pending:
            await self._await_pending([lowered.prepare_prompt(i) for i in cold])
            cold = self.cold_span_indices(lowered, count=False)
        if not cold:
            plan = self.known_plan(call, lowered)  # worked out once: counted here, run by the answer
            stock = self.as_stock(call, lowered, plan, span_output)
            if stock is not None:  # the spans would compute nearly as much as the stock prompt: read that
                return CallLayout(stock, flattened, "stock", spans=spans)
            return CallLayout(lowered, flattened, "warm", spans=spans, plan=plan)
        recomputes = self.recompute_of(call)
        if not recomputes and self.reads_from_tier(lowered, cold):  # the answer's own request loads them
            return CallLayout(lowered, flattened, "tier", spans=spans)
        mode = self.cold_policy(lowered, cold, call.cold_spans, self.isolate_from(call))
        prompts = [lowered.prepare_prompt(i) for i in cold]
        if mode == "isolate":
            return CallLayout(lowered, flattened, mode, isolate=prompts, isolated=cold, spans=spans)
        # The span layout's prefix (padded to a block, unlike the stock prompt's): prepared with the spans, so the
        # next call that reads them finds everything before its own question cached.
        extra = [lowered.prefix_prompt()] if lowered.reads_after_another_prefix else []
        if len(cold) == len(lowered.table.spans) and not lowered.generated_spans and not span_output:
            # Nothing to read from the cache: the prompt a stock engine reads (no padding, its own tokenization).
            return CallLayout(
                self._lower(call, stock=True)[0], flattened, mode, deferred=prompts, also=extra, spans=spans
            )
        texts = {lowered.span_texts[i] for i in cold}
        relaid, _ = self._lower(
            call.model_copy(update={"input": spans_first(call.input, lambda t: t not in texts)}),
            align_output=span_output, as_context=frozenset(texts),
        )
        plan = self.known_plan(call, relaid)
        stock = self.as_stock(call, relaid, plan, span_output)
        if stock is not None:  # the cached spans save too little beside the cold ones: the stock prompt, as given
            return CallLayout(stock, flattened, mode, deferred=prompts, also=extra, spans=spans)
        return CallLayout(relaid, flattened, mode, deferred=prompts, also=extra, spans=spans, plan=plan)

    def _too_long_for_spans(self, call: Generate) -> CallLayout | None:
        """A call whose span layout does not fit the context window (its padding, up to a block less one token a
        span, counts against it) but whose stock prompt does: read as stock reads it, in context; the spans that
        fit alone are prepared when the engine is idle, for shorter prompts that read them. None where the stock
        prompt does not fit either (the span layout's error is the call's: it names the document)."""
        try:
            stock, _ = self._lower(call, stock=True)
        except ContextLengthError:
            return None
        texts = {c.text for _, n in walk(call.input) if isinstance(n, Plus) for c in n.children
                 if isinstance(c, (Fragment, User)) and c.text}  # fmt: skip
        return CallLayout(stock, False, "context", spans=len(texts), later=lambda: self._prepares_that_fit(call))

    def _prepares_that_fit(self, call: Generate, count: bool = True) -> tuple[list[list[int]], list[list[int]]]:
        """A call over-long as spans, read in context: the prepares of its cold spans that fit the window alone
        (its layout worked out unchecked against the window), for shorter prompts that read them; not those under
        way. `count`: its cached spans count as prepares saved (a call that read its documents in context again
        saved none)."""
        try:
            lowered, _ = self._lower(call, check_window=False)
        except SpanQueryError:
            return [], []
        if not lowered.has_spans:
            return [], []
        self._note_spans(lowered)
        prompts = self._lacking(lowered, count=count)
        return [p for p in prompts if self.max_model_len is None or len(p) < self.max_model_len], []

    def _lacking(self, lowered: LoweredPrompt, count: bool = True) -> list[list[int]]:
        """The prepare prompts of `lowered`'s spans the cache lacks and no deferred prepare is computing (`defer`
        skips those: not counted as this call's); `count`: the spans held count as prepares saved."""
        prompts = [lowered.prepare_prompt(i) for i in self.cold_span_indices(lowered, count=count)]
        return [p for p in prompts if tuple(p) not in self._pending]

    def _prepares_after_answer(self, call: Generate, again: bool) -> tuple[list[list[int]], list[list[int]]]:
        """`CallLayout.later` of a call read in context at once: the prepares of its spans the cache lacks, and
        the span layout's prefix where it is another's (`unseen_in_context`: documents never laid out here;
        `seen_in_context`, `again`: documents held in context, whose spans held are no prepares saved)."""
        try:
            lowered, _ = self._lower(call)
        except ContextLengthError:  # it fits only as stock lays it out: the spans that fit alone
            return self._prepares_that_fit(call, count=not again)
        if not lowered.has_spans:
            return [], []
        self._note_spans(lowered)
        also = [lowered.prefix_prompt()] if not again and lowered.reads_after_another_prefix else []
        return self._lacking(lowered, count=not again), also

    def unseen_in_context(self, call: Generate, span_output: bool = False) -> CallLayout | None:
        """The layout of a call none of whose span texts this generator has laid out before, where its cold spans
        would be read in context (`cold_policy`): stock's prompt, at once. Only this generator prepares spans on
        its engine, so a text it never laid out is not cached: the span layout, the cache probes and the prepare
        prompts would each cost a pass over every document (tokenizing, hashing) before the first token, for
        nothing the answer reads. They are worked out after the answer instead (`later`). None: the full layout
        (a text seen before may be cached; generated outputs and nested groups; "isolate"; a prompt long enough
        that "auto" may isolate)."""
        setting = call.cold_spans or self.cold_spans
        if not self.spans or self.span_probe is None or span_output or setting == "isolate":
            return None
        if self.span_in_tier is not None:
            return None  # a text never laid out here may be in the engine's span tier: look it up
        texts: list[str] = []
        for _, node in walk(call.input):
            if isinstance(node, Plus):
                for child in node.children:
                    if not isinstance(child, (Fragment, User)):
                        return None
                    if child.text:
                        texts.append(child.text)
        if not texts or any(span_digest(text) in self._span_blocks for text in texts):
            return None
        stock, _ = self._lower(call, stock=True)
        if setting == "auto" and len(stock.token_ids) >= self.isolate_from(call):
            return None  # the cold span tokens may reach the threshold: count them on the span layout

        return CallLayout(
            stock, False, "context", spans=len(set(texts)), later=lambda: self._prepares_after_answer(call, again=False)
        )

    def seen_in_context(
        self, call: Generate, span_output: bool = False
    ) -> tuple[CallLayout | None, tuple[LoweredPrompt, int] | None]:
        """The layout of a call over documents this generator read in context before, in an order it remembers
        for each group, whose stock prompt in those orders finds every document cached (all but the block where
        the last one ends): stock's prompt, at once — what `in_context` chooses on the span layout, decided on the
        stock prompt alone by a stricter test (`in_context` also allows for an uncached prefix and text between
        groups). The span layout, its hashes and the span probes (each a pass over every document) would cost
        more before the first token than the stock prompt costs; they are worked out after the answer (`later`),
        for the prepares of the spans the cache lacks. A call whose span layout would not fit the context window
        but whose stock prompt does is read so too (`_too_long_for_spans` read it in context in the order given).
        (None, the stock prompt and how many of its leading blocks the cache holds, where they were worked out):
        `layout` decides on the span layout, with them."""
        counted = getattr(self.span_probe, "cached_blocks", None)
        if not self.spans or not self.read_in_context or counted is None or span_output:
            return None, None
        if (call.cold_spans or self.cold_spans) == "isolate":
            return None, None
        orders: list[tuple[str, ...]] = []
        for _, node in walk(call.input):
            if isinstance(node, Plus):
                if (group := _plus_texts(node)) is None:
                    return None, None  # a generated output, a nested group, a repeated or an empty one: the span layout
                orders.append(group)
        if not orders or any(frozenset(o) not in self._orders for o in orders):
            return None, None
        texts = [t for group in orders for t in group]
        node = in_order(call.input, self._orders.get)
        text = self._stock_text(node)
        # Where the documents end in it (a later copy of one, say in the question, makes the test stricter)
        end = documents_end(text, texts)
        if end is None:
            return None, None  # a document the template rewrote: not found as given
        # The documents' tokens as the last call over them in this order tokenized them, where it kept them: only
        # the rest (the question) is tokenized now.
        long = text in self._long_prompts  # (tokenized on a thread already: `_text_ids` takes those)
        ids = None if long else self.prefix_tokens.ids(text, end)
        learn = None
        if ids is None:
            ids = self._text_ids(text)
            learn = None if long else (text, end, ids)
        try:
            check_fits(ids, 0, self.max_model_len, call.max_tokens or 1)
        except ContextLengthError:
            return None, None  # the span layout's error, or its fallback, says what does not fit
        stock = LoweredPrompt(token_ids=ids, table=SpanTable(self.block_size, ()))
        held = counted(ids)
        after = len(self.tokenizer.encode(text[end:], add_special_tokens=False))
        if len(ids) - held * self.block_size > after + self.block_size:
            return None, (stock, held)  # not every document is cached in context (evicted, or read so only in part)
        self._remember_orders(node)  # read in this order again: the most recent

        # The spans the cache lacks are prepared when the engine is idle, as in `layout`'s in-context reading:
        # another set or order of these documents reads them as spans.
        later = lambda: self._prepares_after_answer(call, again=True)
        return CallLayout(stock, False, "in-context", spans=len(set(texts)), later=later, learn=learn), stock

    async def _generate(
        self, call: Generate, path: str, on_token: TokenCallback | None, span_output: bool, t0: float
    ) -> Completion:
        layout = await self.layout(call, span_output)
        lowered, flattened, mode, deferred = layout.lowered, layout.flattened, layout.mode, layout.deferred
        t_lowered = time.perf_counter()
        prepared, prepare_tokens, read_prepared = 0, 0, 0
        prefix = lowered.prefix_prompt() if lowered.has_spans and lowered.reads_after_another_prefix else []
        if prefix and self.span_cached is not None and self.span_cached(prefix):
            prefix = []
        # A prefix the span tier holds and the engine's cache does not is loaded a step after its request is
        # scheduled; what the recompute runs and the answer look up in the step they run would stop before it
        # (vLLM's lookup is contiguous from the first block, and the tier's connector finds only what the tier
        # holds: not the spans in memory, nor a block recomputed in that step), and everything after it would be
        # computed in context. So it is loaded first, with the isolate round where there is one. Not where the
        # answer's own request loads prefix and spans from the tier together ("tier").
        in_tier_only = prefix and mode != "tier" and self.span_in_tier is not None and self.span_in_tier(prefix)
        load_first = [prefix] if in_tier_only else []
        if load_first:
            prefix = []
        if layout.isolate or load_first:  # round 1: each cold span alone after its anchor (and a tier prefix)
            computed = await self.compute_all([*layout.isolate, *load_first])
            computed = computed[: len(layout.isolate)]
            prepared, prepare_tokens = sum(1 for c in computed if c > 0), sum(computed)
            read_prepared = sum(read_by_answer(lowered, i, c) for i, c in zip(layout.isolated, computed))
        t_prepared = time.perf_counter()
        redo, probe = (layout.plan, {}) if layout.plan is not None else await self.plan(call, lowered)
        t_planned = time.perf_counter()
        # One round: the prompt's prefix (where no span is anchored on it and it is not cached), the recompute
        # runs and the call's own requests go to the engine together. Each reads what the ones before it compute
        # at the same positions, in the same step (`open_recompute`). Not the cold spans' prepares: the answer
        # reads them at other positions, and keys are moved there before the step computes them.
        params = [self.sampling_params(call, seed=None if call.seed is None else call.seed + k) for k in range(call.n)]
        beside = [prefix] if prefix else []
        if mode == "tier":
            # What the answer does not load itself, so that the next call finds its spans' prepares cached whole:
            # their anchors, and the prepares of spans whose padded last block the answer reads as context.
            table = lowered.table
            wanted = {tuple(table.anchor_ids(i, lowered.token_ids)) for i in range(len(table.spans))
                      if not isinstance(table.anchor_of(i), int)}
            wanted |= {tuple(lowered.prepare_prompt(i)) for i in lowered.prepare_tails}
            beside += [list(p) for p in sorted(wanted) if not (self.span_cached is not None and self.span_cached(list(p)))]
        with self.batch():
            head = [(len(p), self.open_compute(p)) for p in beside]
            redone = head + self.open_recompute(redo)
            answers = [self.open(lowered.token_ids, p, redo.lowered.table) for p in params]
        t_submitted = time.perf_counter()
        consumed = [self._computed(end, o) for end, o in redone]
        consumed += [self.consume(o, on_token if k == 0 else None) for k, o in enumerate(answers)]
        done = await _gather_or_abort(consumed, [o for _, o in redone] + answers)
        prepare_tokens += sum(done[: len(redone)])
        read_prepared += sum(done[: len(redone)])  # computed where the answer reads them
        runs = done[len(redone) :]
        also = layout.also
        if layout.later is not None:
            try:
                deferred, also = layout.later()
            except Exception as e:  # noqa: BLE001 - the answer was stock's: only the prepares for later are lost
                log.info("spans of %s not prepared for later: %s", path, e)
                deferred, also = [], []
        if mode == "tier" and self.span_tier_lost is not None:
            # A span whose file the answer's request was refused (corrupt, truncated) was computed in context from
            # that block on and is in neither the cache nor the tier now: prepared alone when the engine is idle,
            # which writes it to the tier again.
            deferred = [*deferred, *(p for i in range(len(lowered.table.spans))
                                     if self.span_tier_lost(p := lowered.prepare_prompt(i)))]
        if mode == "isolate":
            in_context_later = self.in_context_later(call, lowered)
            if in_context_later:
                also = [*also, in_context_later]
        if deferred or also:
            self.defer(deferred, also)
        if mode in ("context", "stock") and not lowered.has_spans:
            self._remember_orders(call.input)  # read in context in this order: the cache holds it so
            self._learn_documents(call, lowered.token_ids)
        elif layout.learn is not None:
            self._learn_tokens(*layout.learn)
        sealed, sealed_new, seal_tokens = (0, 0, 0)
        if span_output and self.spans and not lowered.has_spans:
            sealed, sealed_new, seal_tokens = await self.seal(lowered, runs)
        first = runs[0].first_text_at
        metrics.count_call(
            spans=layout.spans,
            prepared=prepared + sealed_new,
            prepared_tokens=prepare_tokens + seal_tokens,
            padding_tokens=lowered.padded_tokens,
            deferred=len(deferred),
            # Its documents cached (in context, or as spans it did not read: "stock", or a cold read whose cached
            # spans saved too little) and read as the stock prompt: no span read, none a hit.
            in_context=mode == "in-context" or (not lowered.has_spans and layout.spans > len(deferred)),
        )
        call_metrics = CallMetrics(
            path=path,
            model=self.model_name,
            ttft_s=(first - t0) if first is not None else None,
            wall_s=time.perf_counter() - t0,
            prompt_tokens=len(lowered.token_ids),
            # What the request found cached includes what this call's prepare requests just computed where it
            # reads them: that is reported as prepared, never as cached (invariant 8). Where two prepares computed
            # one shared block, it is subtracted twice: the count errs low, never high.
            cached_tokens=max(0, runs[0].cached_tokens - read_prepared),
            generated_tokens=sum(r.generated_tokens for r in runs),
            padded_tokens=lowered.padded_tokens,
            prepared_spans=prepared + sealed_new,
            prepared_tokens=prepare_tokens + seal_tokens,
            deferred_spans=len(deferred),
            fallback=(self.fallback if flattened else None) or probe.get("fallback"),
            extra={
                # the call's spans: read from the cache, prepared by it, or (cold, "context") read in context
                "spans": layout.spans,
                # Cold spans: "isolate" (prepared alone first), "tier" (loaded by the answer from the span tier),
                # "context" (computed in context by the answer,
                # prepared alone when the engine is idle: `deferred_spans`), "warm" (all cached), "in-context"
                # (all cached, and the documents too, in context: read as a stock prompt, `in_context`), "stock"
                # (all cached, but the span layout would compute nearly as much: read as stock reads it, `as_stock`)
                "cold_spans": mode,
                "generated_spans": lowered.generated_spans,
                "generated_as_text": lowered.generated_as_text,
                "sealed_outputs": sealed,
                "recomputed_tokens": redo.tokens,
                # recompute="attention": the probe's pass (its computed tokens, the question's rows it read, or the
                # fallback to the question's words and why; reused: the same prompt was probed before)
                **({"attention_probe": probe} if probe else {}),
                # Where the time to first token went: lowering (templates, tokenizing, probing the cache for
                # cold spans), the prepare round (cold spans computed alone), the attention probe's pass
                # (recompute="attention"), planning and submitting the answer's round, and that round until the
                # first token (recompute runs, the answer's prefill).
                "phases_s": {
                    "lower": t_lowered - t0,
                    "prepare": t_prepared - t_lowered,
                    "probe": t_planned - t_prepared,
                    "submit": t_submitted - t_planned,
                    "answer": (first - t_submitted) if first is not None else None,
                },
            },
        )
        return Completion(
            texts=[r.text for r in runs], finish_reasons=[r.finish_reason for r in runs], metrics=call_metrics
        )
