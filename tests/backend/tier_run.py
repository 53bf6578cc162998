"""Run by tests/backend/test_tier.py in a process of its own (an engine with a span tier must be the only vLLM
engine of its process): compile a corpus into a tier with `spanq prepare`'s own entry point, then start engines
on that tier one after another — each a restart, reading what the last one left on disk — and answer the same
query on each, printing one JSON object with what each saw.

    python -m tests.backend.tier_run CORPUS TIER_DIR   (from the repository's root)

Engines, in order:
  restart    a fresh engine; it first runs an unrelated long prompt and forgets it (so the blocks the tier loads
             into once held keys at other positions), then answers the query, its spans prepared first
  direct     the same, the query's own request loading its spans (at other positions than they were stored at)
  stale      the same, with the tracker not told where loaded keys sit (a broken tier: must answer wrong)
  corrupt    after one byte of one stored block is flipped: the block must be refused and computed instead
  unchecked  the same flip, with the checksum not checked (a broken tier: must answer wrong)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
from pathlib import Path

from spanq_backend.kv import relocation
from spanq_backend.serving.engine import EngineConfig, SpanEngine
from spanq_backend.serving.prepare import prepare_main, read_corpus
from spanq_backend.vllm_integration import tier
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

QUESTION = "Which door is open?"


def query(docs: list[str]):
    return generate(
        cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]), user(QUESTION)),
        max_tokens=6,
        temperature=0.0,
    )


async def answer(engine: SpanEngine, call, prepare: bool = True) -> dict:
    """The call's tokens and log-probabilities: its spans prepared first (each prepare loads its span from the
    tier), or not (`prepare=False`: the call's own request loads them, as `generate` does on a tier engine)."""
    lowered = engine.lower(call)
    prepared = await engine.prepare(lowered) if prepare else 0
    _, tokens, logprobs = await run_with_logprobs(engine, lowered, call.max_tokens)
    return {
        "token_ids": lowered.token_ids,
        "spans": [list(s) for s in lowered.table.spans],
        "anchors": [a if isinstance(a, int) else list(a) for a in lowered.table.anchors] if lowered.table.anchors else None,
        "prepared": prepared,
        "tokens": tokens,
        "logprobs": logprobs.tolist(),
    }


async def stale_blocks_first(engine: SpanEngine) -> None:
    """Fill most of the cache with one long unrelated prompt, then forget it: its blocks go back to the free list
    with keys at positions the tier's loads will not match."""
    from vllm import SamplingParams

    long_prompt = [(i * 7919) % 5000 + 10 for i in range(2000)]
    await engine.run_tokens(long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.reset_prefix_cache()


def run_engine(tier_dir: str, docs: list[str], prepare: bool = True) -> dict:
    # recompute=0: the tier's own path (a query's request loads its spans) is a call that recomputes nothing; the
    # "recompute" call below says its own setting
    config = EngineConfig(model="tiny", tier_dir=tier_dir, num_blocks=72, max_model_len=2048, recompute=0)
    with SpanEngine(config) as engine:

        async def scenario() -> dict:
            await stale_blocks_first(engine)
            out = await answer(engine, query(docs), prepare)
            if not prepare:  # and how `generate` reads them now, in another order
                done = await engine.generate(query(docs[1:] + docs[:1]))
                out["generate"] = {"mode": done.metrics.extra["cold_spans"], "prepared_spans": done.metrics.prepared_spans}
                # a call that recomputes blocks, after the engine forgot everything: its prepares load the spans
                assert engine.reset_prefix_cache()
                redo = query(docs[2:] + docs[:2]).model_copy(update={"recompute": "first"})
                done = await engine.generate(redo)
                out["recompute"] = {"mode": done.metrics.extra["cold_spans"], "prepared_spans": done.metrics.prepared_spans,
                                    "recomputed_tokens": done.metrics.extra["recomputed_tokens"]}
            return out

        out = asyncio.run(scenario())
        out["tier"] = engine.tier_stats()
        from spanq_backend.serving import metrics

        out["metrics"] = {k: v for k, v in metrics.snapshot().items() if k.startswith("tier_")}
        return out


def flip_one_block(tier_dir: str) -> str:
    """Flip the high byte of many values in the payload of one stored block that a query's span loads; its path."""
    blocks = sorted(p for p in Path(tier_dir).rglob("*.kv"))
    target = blocks[len(blocks) // 2]
    data = bytearray(target.read_bytes())
    for i in range(len(data) - 4 * 4096 - 20, len(data) - 20, 4):  # values near the end: the last layer's
        data[i + 3] ^= 0x40
    target.write_bytes(bytes(data))
    return str(target)


def main() -> None:
    corpus, tier_dir = sys.argv[1], sys.argv[2]
    docs = [d for d in read_corpus(Path(corpus))[0] if len(d) < 10_000]  # not the one too long for any window
    result: dict = {}
    for name in ("prepare", "prepare_again"):  # both --pin: the first pins what it writes, the second what it finds
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result[f"{name}_exit"] = prepare_main([corpus, "--tier-dir", tier_dir, "--model", "tiny", "--json", "--pin"])
        result[name] = json.loads(printed.getvalue().strip().splitlines()[-1])
        result[f"{name}_files"] = {kind: len(list(Path(tier_dir).rglob(f"*.{kind}"))) for kind in ("kv", "pin")}
        if name == "prepare":
            for pin in Path(tier_dir).rglob("*.pin"):
                pin.unlink()  # unpinned again: the second run must pin the blocks it finds held
    order = list(reversed(docs))
    result["restart"] = run_engine(tier_dir, order)
    result["direct"] = run_engine(tier_dir, order, prepare=False)

    told = relocation.BlockPositionTracker.loaded
    relocation.BlockPositionTracker.loaded = lambda self, block_id, position: None  # a tier that says nothing
    try:
        result["stale"] = run_engine(tier_dir, order)
    finally:
        relocation.BlockPositionTracker.loaded = told

    result["flipped"] = flip_one_block(tier_dir)
    unchecked = Path(result["flipped"]).read_bytes()
    result["corrupt"] = run_engine(tier_dir, order)

    Path(result["flipped"]).write_bytes(unchecked)  # the same flip back in place, read without the checksum
    checked = tier.DiskTier._verified
    tier.DiskTier._verified = staticmethod(lambda body, checksum: True)
    try:
        result["unchecked"] = run_engine(tier_dir, order)
    finally:
        tier.DiskTier._verified = checked
    print(json.dumps(result))


if __name__ == "__main__":
    main()
