"""Span-aware generation on any vLLM engine: lower a `Generate`, prepare its spans, run it, measure it.

`SpanGenerator` holds everything that does not depend on how the engine is driven. Each host hands it one
callable that runs a token request on its engine (`RequestStream`): the in-process `SpanEngine` feeds its
engine thread, `spanq serve` calls vLLM's `AsyncLLM` engine client. Requests that need the same span at
different positions run concurrently: the plugin's CIDRA gives each its own copy of a block that another
running request reads elsewhere (invariant 6 of docs/design.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spanq_backend.kv.span_table import EXTRA_ARGS_KEY, SpanTable
from spanq_backend.serving import metrics
from spanq_backend.serving.lowering import (
    DEFAULT_ANCHOR,
    GeneratedSpan,
    LoweredPrompt,
    Tokenizer,
    check_fits,
    generated_span_ids,
    lower,
    render_chat,
    span_digest,
)
from spanq_backend.serving.recompute import RecomputePlan, choose_blocks, plan_recompute
from spanq_integrations.backends.protocol import CallMetrics, Completion, TokenCallback
from spanq_integrations.query.errors import (
    BackendError,
    ContextLengthError,
    RequestRejectedError,
    SpanQueryError,
)
from spanq_integrations.query.ir import AnchorPolicy, Assistant, Generate, Plus, Recompute, walk

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


class SpanProbe(Protocol):
    """What the generator asks of an engine's prefix cache (`cache_probe.BlockPoolProbe`, `KVEventsMirror`)."""

    def block_hashes(self, token_ids: list[int]) -> tuple[Any, ...] | None: ...

    def holds(self, hashes: tuple[Any, ...] | None) -> bool: ...

    def cached(self, token_ids: list[int]) -> bool: ...


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
        default_recompute: Recompute = 0.0,
        batch: Callable[[], AbstractContextManager[Any]] | None = None,
    ):
        self.stream = stream
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
        # Whether a `[anchor][span]` prompt is wholly in the prefix cache (the engine's probe tells): its
        # prepare request would compute nothing, so it is skipped.
        self.span_probe = span_probe
        self.span_cached: Callable[[list[int]], bool] | None = span_probe.cached if span_probe is not None else None
        metrics.register()  # spanq's counters in vLLM's Prometheus registry (once per process)
        # Nested generation: the output ids of the aligned generations this generator ran itself (by prompt
        # and text), unless the host supplies its own lookup.
        self.generated_ids = generated_ids or self._remembered_ids
        self._generated: OrderedDict[tuple[tuple[int, ...], str], tuple[int, ...]] = OrderedDict()
        # The spans this generator prepared (or found cached): text digest -> the block hashes of its prepare
        # prompt (computed once), so that `cached_span_digests` can say which of them the cache still holds
        # (what a cluster router routes on).
        self._span_blocks: OrderedDict[str, tuple[Any, ...] | None] = OrderedDict()
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

    REMEMBERED_SPANS = 65536

    def _note_spans(self, lowered: LoweredPrompt) -> None:
        if self.span_probe is None:
            return  # nothing could tell later which of them the cache holds
        for i, text in enumerate(lowered.span_texts[: len(lowered.table.spans)]):
            key = span_digest(text)  # under the anchor it was last prepared on
            self._span_blocks[key] = self.span_probe.block_hashes(lowered.prepare_prompt(i))
            self._span_blocks.move_to_end(key)
        while len(self._span_blocks) > self.REMEMBERED_SPANS:
            self._span_blocks.popitem(last=False)

    def cached_span_digests(self) -> list[str]:
        """The digests (`span_digest` of the text) of the spans this generator prepared whose KV the engine's
        cache still holds, most recently used last; empty where the cache cannot be probed."""
        if self.span_probe is None:
            return []
        return [key for key, blocks in list(self._span_blocks.items()) if self.span_probe.holds(blocks)]

    def _remembered_ids(self, node: Assistant) -> GeneratedSpan | None:
        if not isinstance(node.source, Generate) or not self.spans:
            return None  # not generated, or combined in code: read as text
        try:
            lowered = self._lower(node.source, align_output=True)[0]
        except SpanQueryError:
            return None
        out = self._generated.get((tuple(lowered.token_ids), node.text))
        return None if out is None else GeneratedSpan(tuple(lowered.token_ids), out)

    def lower(self, call: Generate) -> LoweredPrompt:
        return self._lower(call)[0]

    def _lower(self, call: Generate, align_output: bool = False) -> tuple[LoweredPrompt, bool]:
        """The call's prompt, and whether its spans were flattened (a stock engine's layout)."""
        if not self.spans and any(isinstance(n, Plus) for _, n in walk(call.input)):
            # A stock engine: the same messages, flattened, without span layout or padding (never laid out as
            # spans first: the padding would count against the context window).
            ids = flattened_prompt_ids(self.tokenizer, call.input)
            check_fits(ids, 0, self.max_model_len, call.max_tokens or 1)
            return LoweredPrompt(token_ids=ids, table=SpanTable(self.block_size, ())), True
        lowered = lower(
            call.input,
            self.tokenizer,
            self.block_size,
            self.pad_token_id,
            self.max_model_len,
            call.max_tokens or 1,
            generated_ids=self.generated_ids,
            default_anchor=self.default_anchor,
            align_output=align_output and self.spans,
        )
        return lowered, False

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
        host that submits eagerly, `SpanEngine`, has queued it when this returns). Close the iterator to abort."""
        if table is not None and table.spans:
            params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: table.to_extra_args()}
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

    def open_compute(self, prompt: list[int], table: SpanTable | None = None) -> AsyncIterator[Any]:
        """Submit the request that puts `prompt` (whole blocks, laid out by `table`) in the cache."""
        from vllm import SamplingParams

        # One token past the span: vLLM always recomputes a prompt's last token, and this way that is all it
        # recomputes when the span is cached already (not the span's whole last block).
        return self.open(prompt + [self.pad_token_id], SamplingParams(max_tokens=1, temperature=0.0), table)

    async def _computed(self, length: int, opened: AsyncIterator[Any]) -> int:
        run = await self.consume(opened)
        return max(0, length - run.cached_tokens)

    def recompute_plan(self, call: Generate, lowered: LoweredPrompt) -> RecomputePlan:
        """Which of the prompt's span blocks the call recomputes in context, and the layout that does it."""
        setting = call.recompute if call.recompute is not None else self.default_recompute
        if not lowered.has_spans or not setting:  # 0 (or 0.0): nothing recomputed
            return RecomputePlan(lowered, (), ())
        return plan_recompute(lowered, choose_blocks(lowered, setting, self.pad_token_id))

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
        lowered, flattened = self._lower(call, align_output=span_output)
        prepared, prepare_tokens = await self.prepare_detail(lowered) if lowered.has_spans else (0, 0)
        redo = self.recompute_plan(call, lowered)
        # One round: the recompute runs and the call's own requests go to the engine together (`open_recompute`).
        params = [self.sampling_params(call, seed=None if call.seed is None else call.seed + k) for k in range(call.n)]
        with self.batch():
            redone = self.open_recompute(redo)
            answers = [self.open(lowered.token_ids, p, redo.lowered.table) for p in params]
        consumed = [self._computed(end, o) for end, o in redone]
        consumed += [self.consume(o, on_token if k == 0 else None) for k, o in enumerate(answers)]
        done = await _gather_or_abort(consumed, [o for _, o in redone] + answers)
        recompute_tokens = sum(done[: len(redone)])
        runs = done[len(redone) :]
        prepare_tokens += recompute_tokens
        sealed, sealed_new, seal_tokens = (0, 0, 0)
        if span_output and self.spans and not lowered.has_spans:
            sealed, sealed_new, seal_tokens = await self.seal(lowered, runs)
        first = runs[0].first_text_at
        metrics.count_call(
            spans=len(lowered.table.spans),
            prepared=prepared + sealed_new,
            prepared_tokens=prepare_tokens + seal_tokens,
            padding_tokens=lowered.padded_tokens,
        )
        call_metrics = CallMetrics(
            path=path,
            model=self.model_name,
            ttft_s=(first - t0) if first is not None else None,
            wall_s=time.perf_counter() - t0,
            prompt_tokens=len(lowered.token_ids),
            # What the request found cached includes what this call's prepare requests just computed: that is
            # reported as prepared, never as cached (invariant 8). Where two prepares computed one shared block,
            # it is subtracted twice: the count errs low, never high.
            cached_tokens=max(0, runs[0].cached_tokens - prepare_tokens),
            generated_tokens=sum(r.generated_tokens for r in runs),
            padded_tokens=lowered.padded_tokens,
            prepared_spans=prepared + sealed_new,
            prepared_tokens=prepare_tokens + seal_tokens,
            fallback=self.fallback if flattened else None,
            extra={
                "spans": len(lowered.table.spans),
                "generated_spans": lowered.generated_spans,
                "generated_as_text": lowered.generated_as_text,
                "sealed_outputs": sealed,
                "recomputed_tokens": redo.tokens,
            },
        )
        return Completion(
            texts=[r.text for r in runs], finish_reasons=[r.finish_reason for r in runs], metrics=call_metrics
        )
