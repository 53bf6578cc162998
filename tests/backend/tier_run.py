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
  recompute_after_restart  documents of its own compiled, then a query over them that recomputes blocks: its
             prefix is in the tier, not in the engine's cache
  corrupt    after values of one stored block (the first of the query's second span) are flipped: the block
             must be refused and its span computed alone by its prepare
  corrupt_direct  the same flip, the query's own request loading its spans: the block is refused and the request
             starts over, computing it and all that follows in context (never cached under a span's key); a query
             that then prepares its spans computes that span alone again
  unkeyed    the same, with missed span blocks not re-keyed (a broken engine: in-context KV kept under the spans'
             keys, where the next query would read it as the spans: the engine's cache must be seen holding it)
  unchecked  the same flip, with the checksum not checked (a broken tier: must answer wrong)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
from pathlib import Path
from unittest.mock import patch

from spanq_backend.kv import relocation
from spanq_backend.serving.engine import EngineConfig, SpanEngine
from spanq_backend.serving.prepare import prepare_main, read_corpus
from spanq_backend.vllm_integration import engine_core, tier
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

QUESTION = "Which door is open?"


def query(docs: list[str]):
    return generate(
        cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]), user(QUESTION)),
        max_tokens=6,
        temperature=0.0,
    )


def span_hashes(engine: SpanEngine, lowered, i: int) -> tuple:
    """The cache keys of span i's whole blocks (its prepare's blocks after the anchor), in order."""
    bs = lowered.table.block_size
    hashes = engine._probe.block_hashes(lowered.prepare_prompt(i))
    first = lowered.table.anchor_size(i) // bs
    return hashes[first : first + len(lowered.span_ids(i)) // bs]


async def answer(engine: SpanEngine, call, prepare: bool = True) -> dict:
    """The call's tokens and log-probabilities: its spans prepared first (each prepare loads its span from the
    tier), or not (`prepare=False`: the call's own request loads them, as `generate` does on a tier engine)."""
    lowered = engine.lower(call)
    prepared = await engine.prepare(lowered) if prepare else 0
    _, tokens, logprobs = await run_with_logprobs(engine, lowered, call.max_tokens)
    keys = [span_hashes(engine, lowered, i) for i in range(len(lowered.table.spans))]
    return {
        "token_ids": lowered.token_ids,
        "spans": [list(s) for s in lowered.table.spans],
        "anchors": [a if isinstance(a, int) else list(a) for a in lowered.table.anchors] if lowered.table.anchors else None,
        "prepared": prepared,
        # each span block's file in the tier, and whether the engine's cache holds a block under its key now
        "span_blocks": [[str(engine.tier.path_of(h)) for h in hashes] for hashes in keys],
        "span_blocks_cached": [[engine._probe.holds((h,)) for h in hashes] for hashes in keys],
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


def run_engine(tier_dir: str, docs: list[str], prepare: bool = True, again: bool = False) -> dict:
    # recompute=0: the tier's own path (a query's request loads its spans) is a call that recomputes nothing; the
    # "recompute" call below says its own setting
    config = EngineConfig(model="tiny", tier_dir=tier_dir, num_blocks=72, max_model_len=2048, recompute=0)
    with SpanEngine(config) as engine:

        async def scenario() -> dict:
            await stale_blocks_first(engine)
            out = await answer(engine, query(docs), prepare)
            if again:  # the same query again, its spans prepared first: what the engine's cache now holds for them
                out["again"] = await answer(engine, query(docs))
            elif not prepare:  # and how `generate` reads them now, in another order
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


def run_recompute_after_restart(tier_dir: str, docs: list[str]) -> dict:
    """A restarted engine compiles documents of its own (their spans in its memory) and answers over them with
    recompute: the query's prefix is in the tier (saved by the engines before) but not in this engine's cache.
    The compile's prepares, one batch, share their anchor, which the tier holds: counted, how many blocks they
    loaded from it, against the anchor's whole blocks."""
    config = EngineConfig(model="tiny", tier_dir=tier_dir, num_blocks=256, max_model_len=2048, recompute="first")
    with SpanEngine(config) as engine:

        async def scenario() -> dict:
            own = [d.replace("Document", "Note") for d in docs]
            prepares = [engine.lower(query([d])).prepare_prompt(0) for d in own]
            hashes = [engine._probe.block_hashes(p[: len(p) // 32 * 32]) or () for p in prepares]
            shared = [h for h in hashes[0] if all(h in other for other in hashes[1:])]  # the anchor's blocks
            held = sum(engine.tier.holds(h) for h in shared)
            before = engine.tier_stats()["loaded_blocks"]
            await engine.compile(own)
            compiled = {"shared_blocks": len(shared), "shared_in_tier": held, "prepares": len(own),
                        "loaded_blocks": engine.tier_stats()["loaded_blocks"] - before}
            prefix = engine.lower(query(own)).prefix_prompt()
            held = {"prefix_in_tier": bool(engine._probe.tier_holds_all(prefix)), "prefix_cached": engine._probe.cached(prefix)}
            done = await engine.generate(query(own))
            m = done.metrics
            return {**held, "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
                    "recomputed_tokens": m.extra["recomputed_tokens"], "mode": m.extra["cold_spans"],
                    "compile": compiled}

        return asyncio.run(scenario())


def flip_one_block(target: str) -> str:
    """Flip the high byte of many values in the payload of one stored block (its file `target`); its path."""
    data = bytearray(Path(target).read_bytes())
    for i in range(len(data) - 4 * 4096 - 20, len(data) - 20, 4):  # values near the end: the last layer's
        data[i + 3] ^= 0x40
    Path(target).write_bytes(bytes(data))
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

    # a tier that says nothing of where loaded keys sit
    with patch.object(relocation.BlockPositionTracker, "loaded", lambda self, block_id, position: None):
        result["stale"] = run_engine(tier_dir, order)

    result["recompute_after_restart"] = run_recompute_after_restart(tier_dir, order)
    # a connector that lets every request load what another is loading (the tier's behaviour before)
    with patch.object(tier.SpanTierConnector, "in_flight_by", lambda self, found, rid: None):
        result["loads_twice"] = run_recompute_after_restart(tier_dir, [d.replace("Document", "Page") for d in order])

    # the first block of the query's second span: a span block the query's request loads after a whole span
    result["flipped"] = flip_one_block(result["restart"]["span_blocks"][1][0])
    unchecked = Path(result["flipped"]).read_bytes()
    result["corrupt"] = run_engine(tier_dir, order)
    Path(result["flipped"]).write_bytes(unchecked)  # the same flip again (the prepare above wrote a good copy)
    result["corrupt_direct"] = run_engine(tier_dir, order, prepare=False, again=True)

    Path(result["flipped"]).write_bytes(unchecked)  # and again, with nothing re-keyed (a broken engine)
    with patch.object(engine_core, "rekey_missed_spans", lambda request, num_computed_tokens, keep_span_keys=False: 0):
        result["unkeyed"] = run_engine(tier_dir, order, prepare=False, again=True)

    Path(result["flipped"]).write_bytes(unchecked)  # the same flip back in place, read without the checksum
    with patch.object(tier.DiskTier, "_verified", staticmethod(lambda body, checksum: True)):
        result["unchecked"] = run_engine(tier_dir, order)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
