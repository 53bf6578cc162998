"""CIDRA: concurrent requests over shared spans at different positions.

A property test drives the planner against a model of the KV cache (which position each physical block's
keys encode, who holds it); an end-to-end test runs 8 orders of the same 4 fragments in one batch on the
real engine and compares each output with the same request run alone and with the HF span reference.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spanq_backend.kv.cidra import CidraPlanner
from tests.backend.settings import temporarily

BS = 32
SPANS = "ABCDE"


class KVModel:
    """Physical blocks and the position their keys encode; requests holding blocks as logical blocks."""

    def __init__(self) -> None:
        self.encodes: dict[int, int] = {}
        self.refs: Counter[int] = Counter()
        self.running: dict[int, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.next_block = 1
        self.encodes[0] = 0  # block 0: the shared anchor, always at position 0
        self.planner = CidraPlanner(BS, lambda b: self.refs[b])

    def new_block(self, position: int) -> int:
        b = self.next_block
        self.next_block += 1
        self.encodes[b] = position
        return b

    def admit(self, rid: int, order: str) -> int:
        for i, name in enumerate(order):  # prepare: a span computed after the anchor, at position BS
            if name not in self.cached:
                self.cached[name] = self.new_block(BS)
        hit = [0] + [self.cached[n] for n in order]
        plan = self.planner.plan(hit)
        held = list(hit)
        for j in plan.duplicate:
            held[j] = self.new_block(self.encodes[hit[j]])  # the copy encodes what its source encodes
        for j, b in enumerate(held):  # the runner rotates every block this request reads to its position
            if self.encodes[b] != j * BS:
                others = [r for r, blocks in self.running.items() if b in blocks]
                assert not others, f"block {b} rotated while requests {others} read it"
                self.encodes[b] = j * BS
        for b in held:
            self.refs[b] += 1
        self.running[rid] = held
        self.planner.admitted(held)
        return len(plan.duplicate)

    def finish(self, rid: int) -> None:
        for b in self.running.pop(rid):
            self.refs[b] -= 1

    def check(self) -> None:
        for rid, blocks in self.running.items():
            for j, b in enumerate(blocks):
                assert self.encodes[b] == j * BS, f"request {rid}: block {j} encodes {self.encodes[b]}"


# A name may repeat: two spans whose first blocks hold the same tokens hash alike, so one request can hit one
# cached block at two positions (the same span twice, as far as the cache can tell).
orders = st.lists(st.sampled_from(SPANS), min_size=1, max_size=4).map("".join)
ops = st.lists(st.one_of(st.tuples(st.just("admit"), orders), st.tuples(st.just("finish"), st.integers(0, 50))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_running_request_reads_its_own_positions(operations):
    kv = KVModel()
    rid = 0
    for op, arg in operations:
        if op == "admit":
            kv.admit(rid, arg)
            rid += 1
        elif kv.running:
            kv.finish(sorted(kv.running)[arg % len(kv.running)])
        kv.check()


def test_duplicates_only_when_a_block_is_read_elsewhere():
    kv = KVModel()
    assert kv.admit(0, "AB") == 0  # nobody reads A or B: rotate in place
    assert kv.admit(1, "AB") == 0  # same positions: share
    assert kv.admit(2, "BA") == 2  # both read at other positions by running requests: copy both
    kv.finish(0)
    kv.finish(1)
    assert kv.admit(3, "BA") == 0  # the readers are gone: in place again
    kv.check()


def test_one_request_reading_a_block_at_two_positions_gets_a_copy():
    kv = KVModel()
    assert kv.admit(0, "ABA") == 1  # A at blocks 1 and 3: one copy, whatever else runs
    kv.check()
    assert kv.admit(1, "CC") == 1  # nobody else reads C: still one copy for its second use
    kv.check()




def test_a_block_moved_in_place_too_often_in_a_low_precision_cache_is_let_go():
    """A cache below float32 rounds a block's keys once per move: a hot span read at ever new positions would
    drift without end (bf16: ~7e-2 relative after 500 moves). The planner counts a cached block's in-place moves
    and reports it worn at `max_moves` (the engine drops it from the prefix cache: the next reader prepares it
    again); a block allocated anew starts from none; in float32 (`max_moves=None`) nothing is counted."""
    readers: Counter[int] = Counter()
    planner = CidraPlanner(BS, lambda b: readers[b], max_moves=3)
    planner.admitted([7], 0)  # block 7 computed at position 0
    worn = []
    for k in range(1, 7):  # one reader at a time, each at another position (block index k % 2 + 1)
        plan = planner.plan([0] * (k % 2 + 1) + [7])  # block 0 repeated: the reader's logical index for 7 varies
        assert plan.moved == [7]
        worn.append(planner.moved_in_place(plan.moved))
        planner.admitted([7], k % 2 + 1)
    assert worn == [[], [], [7], [], [], [7]]
    planner.moved_in_place([7])
    planner.fresh([7])  # computed anew: the count starts again
    assert planner.moves.get(7) is None
    exact = CidraPlanner(BS, lambda b: 0)
    exact.admitted([7], 0)
    assert exact.plan([0, 7]).moved == [7] and exact.moved_in_place([7] * 100) == []


def test_the_engine_bounds_moves_only_in_a_cache_below_float32():
    from types import SimpleNamespace

    import torch

    from spanq_backend.vllm_integration import engine_core

    def manager(dtype):
        return SimpleNamespace(block_pool=SimpleNamespace(blocks=[]), block_size=BS,
                               kv_cache_spec=SimpleNamespace(dtype=dtype))  # fmt: skip

    assert engine_core._manager_state(manager(torch.float32)).planner.max_moves is None
    for dtype in (torch.bfloat16, torch.float16):
        assert engine_core._manager_state(manager(dtype)).planner.max_moves == engine_core.MAX_MOVES_LOW_PRECISION


@pytest.mark.vllm
def test_blocks_a_kv_connector_loads_are_recorded_where_their_reader_reads_them():
    """vLLM's own KV cache manager (spanq's hooks on it), a request with no local hit whose first blocks a KV
    connector (the span tier) loads: CIDRA must record every block it holds at its position, or a request
    admitted next that hits one of those blocks elsewhere rotates it in place while this one reads it. Blocks a
    connector loads are added before the hooked allocation; without a local hit no plan was kept, and they were
    never recorded. Their move counts (`max_moves`) start again too: new contents."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from spanq_backend import vllm_integration
    from spanq_backend.vllm_integration import engine_core

    vllm_integration.register()  # spanq's patches of vLLM's classes (once per process)
    bs = 16
    hash_fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(hash_fn)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=bs, hash_block_size=bs)
    request = Request("loaded", list(range(100, 100 + 3 * bs + 1)), SamplingParams(max_tokens=4), None,
                      block_hasher=kcu.get_request_block_hasher(bs, hash_fn))  # fmt: skip
    found = manager.get_computed_blocks(request)
    assert found[1] == 0  # no local hit
    single = manager.coordinator.single_type_managers[0]
    planner = engine_core.manager_spans(single).planner
    planner.moves.update({b: 7 for b in range(64)})  # moves counted for whatever these block ids held before
    assert manager.allocate_slots(request, num_new_tokens=bs + 1, new_computed_blocks=found[0],
                                  num_external_computed_tokens=2 * bs) is not None  # fmt: skip
    held = [b.block_id for b in single.req_to_blocks["loaded"]]
    assert len(held) == 4
    assert {b: planner.in_use_at.get(b) for b in held} == {b: j * bs for j, b in enumerate(held)}
    assert not any(b in planner.moves for b in held)  # new contents: no moves yet, loaded ones included


@pytest.mark.vllm
def test_eight_orders_in_one_batch_match_solo_runs_and_the_reference(tiny_backend, hf_model):
    from test_span_correctness import rag_query
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from spanq_backend import vllm_integration as vllm_plugin

    engine = tiny_backend.engine

    async def run(call, together: bool):
        lw = engine.lower(call)
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
        outs, _ = await engine.run_tokens(lw.token_ids, params, lw.table)
        toks, lps = [], []
        for o in outs:
            for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or []):
                toks.append(t)
                lps.append(lp[t].logprob)
        return toks, lps, outs[-1].num_cached_tokens

    order_list = ["".join(p) for p in itertools.permutations("ABCD")][::3][:8]

    async def scenario():
        await engine.prepare(engine.lower(rag_query("ABCD")))
        before = vllm_plugin.stats()
        together = await asyncio.gather(*(run(rag_query(o), True) for o in order_list))
        after = vllm_plugin.stats()
        alone = [await run(rag_query(o), False) for o in order_list]
        return together, alone, before, after

    # eight layouts of one set (by default the engine reads a set in one order, at one position)
    with temporarily(engine.generator, keep_span_order=True):
        check_eight_orders(engine, hf_model, order_list, *asyncio.run(scenario()))


def check_eight_orders(engine, hf_model, order_list, together, alone, before, after):
    import torch
    from test_span_correctness import rag_query

    from benchmarks.hf_span import span_reference_logprobs

    assert after["duplicates"] > before["duplicates"], "the batch needed shared blocks at several positions"
    assert after["conflicts"] == before["conflicts"] == 0
    assert after["moved_blocks"] > before["moved_blocks"], "the private copies were rotated"
    assert after["compiled_runners"] >= 1, "keys moved by spanq's compiled CPU op, not the torch fallback"
    for order, (t_tok, t_lp, t_cached), (a_tok, a_lp, a_cached) in zip(order_list, together, alone):
        assert t_tok == a_tok, order
        assert max(abs(x - y) for x, y in zip(t_lp, a_lp)) < 1e-4, order
        # Every span read from the cache in the batch (a run alone, later, may also find the context blocks
        # the batch computed: the last document's tail and the question).
        assert a_cached >= t_cached >= engine.lower(rag_query(order)).table.spans[-1][1], order
    # Not only consistent with itself: each batched output is span attention, by the independent reference.
    hf = hf_model
    for order, (t_tok, t_lp, _) in zip(order_list, together):
        lw = engine.lower(rag_query(order))
        ref = span_reference_logprobs(hf, lw.token_ids, lw.table, t_tok).double()
        got = torch.tensor(t_lp, dtype=torch.float64)
        assert torch.allclose(got, ref, atol=2e-4), f"{order}: max |diff| = {(got - ref).abs().max():.2e}"


@pytest.mark.vllm
def test_duplicates_that_do_not_fit_defer_requests_instead_of_corrupting_them(tiny_model):
    """64 KV blocks: the shared spans plus one order's private copies fit, six orders at once do not.
    The scheduler counts the copies before admitting a request, so the others wait; every output still
    equals the same request run alone."""
    from test_span_correctness import rag_query
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from spanq_backend import vllm_integration as vllm_plugin
    from spanq_backend.serving.engine import SpanEngine

    # keep_span_order: six layouts of one set (by default the engine reads a set in one order, at one position)
    engine = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=1024, max_num_seqs=8, num_blocks=64,
                         recompute=0, keep_span_order=True)
    try:
        async def run(call):
            lw = engine.lower(call)
            params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
            outs, _ = await engine.run_tokens(lw.token_ids, params, lw.table)
            toks, lps = [], []
            for o in outs:
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or []):
                    toks.append(t)
                    lps.append(lp[t].logprob)
            return toks, lps

        orders = ["ABCD", "DCBA", "BADC", "CDAB", "ACBD", "DBCA"]
        blocks_per_request = len(engine.lower(rag_query("ABCD")).token_ids) // 32 + 1
        assert 64 < blocks_per_request * len(orders), "the test must overflow the cache"

        async def scenario():
            await engine.prepare(engine.lower(rag_query("ABCD")))
            before = vllm_plugin.stats()
            together = await asyncio.gather(*(run(rag_query(o)) for o in orders))
            after = vllm_plugin.stats()
            alone = [await run(rag_query(o)) for o in orders]
            return together, alone, after["duplicates"] - before["duplicates"]

        together, alone, duplicates = asyncio.run(scenario())
        assert duplicates > 0
        for order, (t_tok, t_lp), (a_tok, a_lp) in zip(orders, together, alone):
            assert t_tok == a_tok, order
            assert max(abs(x - y) for x, y in zip(t_lp, a_lp)) < 1e-4, order
    finally:
        engine.close()


@pytest.mark.vllm
def test_a_stock_request_over_a_span_block_in_use_elsewhere_gets_a_copy(tiny_backend):
    """A plain request whose prompt starts like a span's prepare prompt hits that span's blocks by stock
    hashing, at the span's prepared position, while span requests read them elsewhere: both must be exact."""
    from test_span_correctness import rag_query
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from spanq_backend import vllm_integration as vllm_plugin

    engine = tiny_backend.engine
    base = engine.lower(rag_query("ABCD", question="Which lamp is lit?"))
    stock_ids = base.prepare_prompt(0) + base.token_ids[-12:]  # [anchor][span A] + a tail: no span table

    async def run(ids, table):
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
        outs, _ = await engine.run_tokens(ids, params, table)
        return [(t, lp[t].logprob) for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]

    async def scenario():
        await engine.prepare(base)
        spans = [engine.lower(rag_query("DCBA", question="Which lamp is lit?"))]  # A moves from block 1
        before = vllm_plugin.stats()
        together = await asyncio.gather(run(stock_ids, None), *(run(s.token_ids, s.table) for s in spans))
        after = vllm_plugin.stats()
        alone = [await run(stock_ids, None)] + [await run(s.token_ids, s.table) for s in spans]
        return together, alone, before, after

    together, alone, before, after = asyncio.run(scenario())
    # One span request and one stock request: a copy was needed only because they share span A's block.
    assert after["duplicates"] > before["duplicates"]
    assert after["conflicts"] == before["conflicts"]
    for t, a in zip(together, alone):
        assert [x for x, _ in t] == [x for x, _ in a]
        assert max(abs(x - y) for (_, x), (_, y) in zip(t, a)) < 1e-4
