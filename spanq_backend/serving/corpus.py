"""Compiling a corpus: each document's span KV computed once, as a query's `plus` of it is prepared, and, where
asked, pinned in the engine's KV cache. One routine for both kinds of engine: the embedded `SpanEngine.compile`
(whose engine core runs in-process: it pins on its own engine thread, and flushes and pins its span tier) and
`spanq serve`'s `POST /v1/spans` (whose engine core is another process: it pins through a utility call there,
`vllm_integration.engine_core.PIN_METHOD`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from spanq_backend.serving.generator import SpanGenerator

__all__ = ["BATCH_TOKENS", "PinBlocks", "compile_corpus", "unicode_problem"]

BATCH_TOKENS = 8192  # prepare prompts' tokens sent to the engine together

# Pins the cached blocks of these prefix-cache hashes (the engine core's own `BlockHash`es): counts of those pinned
# now, already pinned, not in the cache any more ("missing") and refused past the pin limit.
PinBlocks = Callable[[list[Any]], Awaitable[dict[str, int]]]


async def compile_corpus(
    generator: SpanGenerator,
    texts: list[str],
    *,
    pin: PinBlocks | None = None,
    skip_tier_held: bool = False,
    on_tier_held: Callable[[list[int]], None] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Prepare the span of each document not prepared already; with `pin`, pin each document's blocks right after
    they are computed (before another document's prepare can evict them), and those already cached at once.

    A document whose span the engine's cache holds is not computed (counted `held`); on an engine with a span
    tier and `skip_tier_held`, one whose span the tier holds wholly instead (so that what the tier lost is written
    again; not when pinning, which loads it into the cache by its prepare). Returns the report (documents, spans, held,
    prepared, tokens computed, too_long and their indices; with `pin`: pinned_blocks, pin_refused, pin_missing)
    and the prepare prompts pinned, for the caller's tier."""
    from spanq_integrations.query.errors import ContextLengthError
    from spanq_integrations.query.ir import Cross, Fragment, Generate, Plus, User

    probe = generator.span_probe
    seen: set[tuple[int, ...]] = set()
    report: dict[str, Any] = {"documents": len(texts), "spans": 0, "held": 0, "prepared": 0, "tokens": 0,
                              "too_long": 0, "too_long_documents": []}
    if pin is not None:
        report.update(pinned_blocks=0, pin_refused=0, pin_missing=0)
    pinned: list[list[int]] = []
    batch: list[list[int]] = []

    async def pin_now(prompt: list[int], retry: bool = False) -> bool:
        """Pin a prompt's blocks; False where some were not cached any more and `retry` (then it is prepared and
        pinned again: the cache probe that found it said so a moment before an eviction)."""
        keys = probe.tier_keys(prompt) if probe is not None else None  # the engine core's own hashes
        counts = await pin(list(keys or ()))  # type: ignore[misc]
        report["pinned_blocks"] += counts.get("pinned", 0)
        report["pin_refused"] += counts.get("refused", 0)
        if retry and counts.get("missing", 0):
            return False
        report["pin_missing"] += counts.get("missing", 0)
        return True

    async def run(prompts: list[list[int]]) -> None:
        with generator.batch():
            opened = [generator.open_compute(p) for p in prompts]
        for p, o in zip(prompts, opened):
            report["tokens"] += await generator._computed(len(p), o)
            report["prepared"] += 1
            if pin is not None:
                await pin_now(p)

    from spanq_integrations.query.errors import QueryValidationError

    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):  # (a string compiled each character)
        raise QueryValidationError("documents", f"expected a list of document texts, got {type(texts).__name__}")
    for index, text in enumerate(texts):  # (all checked before any is computed)
        if not isinstance(text, str):
            raise QueryValidationError(f"documents[{index}]", f"expected a document's text, got {type(text).__name__}")
        if (bad := unicode_problem(text)) is not None:
            raise QueryValidationError(f"documents[{index}]", bad)
    for index, text in enumerate(texts):
        call = Generate(input=Cross(children=[Plus(children=[Fragment(text=text)]), User(text="?")]))
        try:
            lowered = generator.lower(call)
        except ContextLengthError:
            report["too_long"] += 1
            report["too_long_documents"].append(index)
            continue
        if not lowered.table.spans:
            continue
        prompt = lowered.prepare_prompt(0)
        if tuple(prompt) in seen:
            continue
        seen.add(tuple(prompt))
        generator._note_spans(lowered)  # known to this engine's queries (and reported to a router) as prepared
        report["spans"] += 1
        if pin is not None and probe is not None and probe.cached(prompt) and await pin_now(prompt, retry=True):
            report["held"] += 1
            pinned.append(prompt)
            continue
        if pin is None and probe is not None and probe.tier is None and probe.cached(prompt):
            report["held"] += 1  # in the engine's cache already (with a tier, held means held by the tier)
            continue
        if pin is None and skip_tier_held and probe is not None and probe.tier_holds_all(prompt):
            report["held"] += 1
            if on_tier_held is not None:
                on_tier_held(prompt)
            continue
        if batch and sum(map(len, batch)) + len(prompt) > BATCH_TOKENS:
            await run(batch)
            batch = []
        batch.append(prompt)
        if pin is not None:
            pinned.append(prompt)
    if batch:
        await run(batch)
    return report, pinned


def unicode_problem(text: str) -> str | None:
    """What makes `text` not Unicode text (a lone surrogate, which JSON's `\\ud800` escapes allow: no tokenizer
    reads it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid Unicode text (a lone surrogate at index {e.start})"
    return None
