"""Never silently wrong: span tables are honoured only where every worker moves keys for the loaded model.

A span block found at a new position is only right once its keys are re-rotated, and only a hooked model
runner with a relocation runtime does that. These tests take that away — a runner without spanq's hook, a
model whose rotary embedding the runtime refuses, in one process (and, in `tests/cluster/test_replica_exit.py`,
with the engine core and the worker in processes of their own) — and check that span queries then run as stock
requests (exact under ordinary attention), say why (`fallback`), and that without the guard the same request
would be wrong.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from benchmarks.hf_span import full_attention_logprobs, span_reference_logprobs
from spanq_backend.vllm_integration.support import SpanSupport
from spanq_backend.vllm_integration.worker import runner_span_status
from spanq_integrations import cross, fragment, generate, plus, system, user
from tests.backend.logprobs import run_with_logprobs

pytestmark = [pytest.mark.vllm]

TOL = 2e-4


def docs(tag: str) -> dict[str, str]:
    return {
        c: f"Note {c}{tag}. " + " ".join(f"{c.lower()}{tag} item {i} is {i * 7 % 11}." for i in range(15))
        for c in "ABCD"
    }


def query(d: dict[str, str], order: str, max_tokens: int = 5):
    return generate(
        cross(system("Answer from the notes."), plus(*[fragment(d[c]) for c in order]), user("Which item is 3?")),
        max_tokens=max_tokens,
        temperature=0.0,
    )


# --------------------------------------------------------------------------------------------- the decision


def test_one_worker_that_cannot_move_keys_turns_spans_off_for_the_engine():
    assert SpanSupport.of_workers([(True, ""), (True, "")]).enabled
    off = SpanSupport.of_workers([(True, ""), (False, "no runtime")])
    assert not off.enabled and off.reason == "worker 1: no runtime"
    assert not SpanSupport.of_workers([]).enabled


def test_workers_that_could_not_be_asked_are_an_answer_that_may_change():
    """`spanq serve` keeps its backend (and so the engine's answer) for the life of the server, except where the
    workers could not be asked at all: then the next query asks again, rather than serving stock for good."""
    import asyncio

    from spanq_backend.vllm_integration.support import aquery_span_support

    async def failing(method):
        raise TimeoutError("the engine is busy")

    async def answering(method):
        return [(True, "")]

    asked = asyncio.run(aquery_span_support(failing))
    assert not asked.enabled and asked.unanswered and "could not answer" in asked.reason
    answered = asyncio.run(aquery_span_support(answering))
    assert answered.enabled and not answered.unanswered
    assert not SpanSupport.of_workers([(False, "no runtime")]).unanswered


def test_a_runner_class_without_the_hook_is_reported():
    class GPUishModelRunner:
        def __init__(self):
            self.kv_caches = [torch.zeros(1)]

        def execute_model(self, scheduler_output):
            return None

    ok, why = runner_span_status(GPUishModelRunner())
    assert not ok and "GPUishModelRunner is not hooked" in why


# --------------------------------------------------------------------------------------------- engines


def _engine(tiny_model: Path):
    from spanq_backend.serving.engine import SpanEngine

    return SpanEngine(model=str(tiny_model), block_size=32, max_model_len=1024, max_num_seqs=4, num_blocks=96,
                     recompute=0)


def _span_lowering(engine, call):
    """The span layout of `call` (the engine's own generator lays prompts out as stock once spans are off)."""
    from spanq_backend.serving.lowering import lower

    return lower(call.input, engine.tokenizer, engine.config.block_size, engine.pad_token_id, 1024, 5,
                 default_anchor="prefix")


async def _prepare_by_hand(engine, lowered) -> None:
    """What a span engine's prepare requests do: each `[anchor][span]` as a plain request."""
    from vllm import SamplingParams

    for i in range(len(lowered.table.spans)):
        ids = lowered.prepare_prompt(i) + [engine.pad_token_id]
        await engine.run_tokens(ids, SamplingParams(max_tokens=1, temperature=0.0))


@pytest.fixture
def unhooked_runner(monkeypatch):
    """vLLM's CPU model runner as a platform spanq does not hook (a GPU runner, vLLM's V2 runner) would be."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from spanq_backend import vllm_integration as vllm_plugin

    vllm_plugin.register()  # idempotent; makes sure the hook is there to take away
    hooked = CPUModelRunner.execute_model
    assert getattr(hooked, "__spanq_hook__", False)
    monkeypatch.setattr(CPUModelRunner, "execute_model", hooked.__wrapped__)


@pytest.mark.slow
def test_an_engine_whose_runner_is_not_hooked_runs_span_tables_as_stock(tiny_model, hf_model, unhooked_runner):
    engine = _engine(tiny_model)
    try:
        assert not engine.span_support.enabled
        assert "CPUModelRunner is not hooked" in engine.span_support.reason
        d = docs("u")

        async def scenario():
            # The generator lays the query out as stock and says why.
            completion = await engine.generate(query(d, "ABCD"))
            # A client that attaches a span table itself, spans prepared by hand and read in another order:
            first = _span_lowering(engine, query(d, "ABCD"))
            await _prepare_by_hand(engine, first)
            second = _span_lowering(engine, query(d, "DCBA"))
            return completion, second, await run_with_logprobs(engine, second, 5)

        completion, second, (cached, toks, lps) = asyncio.run(scenario())
        assert completion.metrics.fallback == engine.span_support.reason
        assert completion.metrics.prepared_spans == 0 and completion.metrics.padded_tokens == 0
        # Hashed as stock: only the first span (right after the anchor, where it was prepared) is found.
        spans = second.table.spans
        assert cached <= spans[0][1] < spans[1][1]
        ref = full_attention_logprobs(hf_model, second.token_ids, toks).double()
        assert torch.allclose(lps, ref, atol=TOL), f"max |diff| = {(lps - ref).abs().max():.2e}"
    finally:
        engine.close()


@pytest.mark.slow
def test_without_the_guard_an_unhooked_runner_reads_unmoved_keys(tiny_model, hf_model, unhooked_runner):
    """The failure the guard prevents: the same engine with span tables honoured regardless answers wrong."""
    engine = _engine(tiny_model)
    try:
        hasher = engine.llm_engine.engine_core.engine_core.request_block_hasher
        hasher.support = SpanSupport(True)  # the broken guard
        d = docs("w")

        async def scenario():
            first = _span_lowering(engine, query(d, "ABCD"))
            await _prepare_by_hand(engine, first)
            second = _span_lowering(engine, query(d, "DCBA"))
            return second, await run_with_logprobs(engine, second, 5)

        second, (cached, toks, lps) = asyncio.run(scenario())
        assert cached >= second.table.spans[-1][1], "every span was read from the cache at a new position"
        span_ref = span_reference_logprobs(hf_model, second.token_ids, second.table, toks).double()
        full_ref = full_attention_logprobs(hf_model, second.token_ids, toks).double()
        # Neither reference holds: the keys of the moved spans still encode their old positions.
        assert not torch.allclose(lps, span_ref, atol=TOL)
        assert not torch.allclose(lps, full_ref, atol=TOL)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_model_the_runtime_refuses_turns_spans_off_with_the_reason(tiny_model, monkeypatch):
    from spanq_backend.kv.rerope import RelocationError
    from spanq_backend.vllm_integration import kv_layout

    def refuse(model, layer_names):
        raise RelocationError("this model's rotary embedding is refused (simulated)")

    monkeypatch.setattr(kv_layout, "rope_specs_of_layers", refuse)
    engine = _engine(tiny_model)
    try:
        assert not engine.span_support.enabled
        assert "refused (simulated)" in engine.span_support.reason
        d = docs("m")
        completion = asyncio.run(engine.generate(query(d, "BADC")))
        assert completion.metrics.fallback and "refused (simulated)" in completion.metrics.fallback
        assert completion.metrics.prepared_spans == 0 and completion.text
    finally:
        engine.close()


@pytest.mark.slow
def test_a_failed_start_up_self_check_turns_spans_off_instead_of_serving_wrong_keys(tiny_model, monkeypatch):
    """The K layout deliberately misread: the self-check on the real cache catches it, and the engine serves
    span queries as stock, saying why."""
    from spanq_backend.kv.relocation import KLayout
    from spanq_backend.vllm_integration import kv_layout

    real = kv_layout.discover_cpu_k_layout

    def misread(runner, block_size, head_dim):
        right = real(runner, block_size, head_dim)
        if right.kind == "transposed":
            return KLayout.row_major(block_size, head_dim)
        return KLayout.transposed(block_size, head_dim)

    monkeypatch.setattr(kv_layout, "discover_cpu_k_layout", misread)
    engine = _engine(tiny_model)
    try:
        assert not engine.span_support.enabled
        assert "self-check" in engine.span_support.reason
        completion = asyncio.run(engine.generate(query(docs("s"), "BADC")))
        assert completion.metrics.fallback and "self-check" in completion.metrics.fallback
        assert completion.metrics.prepared_spans == 0 and completion.text
    finally:
        engine.close()


@pytest.mark.slow
def test_a_stock_engine_never_starts_the_span_runtime(tiny_model):
    """`SpanEngine(spans=False)`, the demo's and the benchmarks' in-process baseline, tells its engine so: its
    workers run no self-check, at start-up or at the first step (where it would land in the baseline's time to
    first token), and report a stock engine. (Until 2026-12-03 the engine core asked them at start-up, so they ran
    the self-check and answered yes; with the engine core told but not the workers, the first step ran it.)"""
    from spanq_backend.serving.engine import SpanEngine
    from spanq_backend.vllm_integration.support import STOCK, query_span_support

    engine = SpanEngine(model=str(tiny_model), spans=False, block_size=32, max_model_len=1024, max_num_seqs=2)
    try:
        assert asyncio.run(engine.generate(query(docs("k"), "ABCD"))).text
        # asked only now, after a step, and on an idle engine (the in-process executor calls the worker here)
        support = query_span_support(engine.llm_engine.collective_rpc)
        assert not support.enabled and support.reason == f"worker 0: {STOCK.reason}"
    finally:
        engine.close()
