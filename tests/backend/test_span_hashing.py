"""Span-aware block hashing (spanq_backend.kv.span_hashing, the plugin's hasher) and the span table it reads.

Hashes are vLLM's real ones (`hash_block_tokens` with sha256), compared with vLLM's stock request block hasher
run on real `vllm.v1.request.Request` objects: a span hashes the same wherever it sits and the same as in its
prepare request `[anchor][span]`; what follows a `plus` group depends on which spans, in which order; a request
without span metadata hashes exactly as stock vLLM (invariants 3 and 7 of docs/design.md).
"""

from __future__ import annotations

import itertools

import pytest

from spanq_backend.kv.span_hashing import span_block_hashes
from spanq_backend.kv.span_table import EXTRA_ARGS_KEY, SpanTable, SpanTableError
from spanq_backend.vllm_integration import engine_core
from spanq_backend.vllm_integration.support import SpanSupport

pytestmark = [pytest.mark.vllm]

BS = 16
_ids = itertools.count(1)


def block_tokens(n_blocks: int, base: int) -> list[int]:
    return list(range(base, base + n_blocks * BS))


ANCHOR = block_tokens(2, 1000)
SPANS = {
    "A": block_tokens(2, 2000),
    "B": block_tokens(1, 3000),
    "C": block_tokens(3, 4000),
    "D": block_tokens(1, 5000),
}
TAIL = list(range(9000, 9000 + BS + 5))  # one full block and a partial one
ANCHOR_BLOCKS = len(ANCHOR) // BS


def layout(
    order: str, spans: dict[str, list[int]] = SPANS, tail: list[int] = TAIL
) -> tuple[list[int], SpanTable]:
    """`[anchor][spans in order][tail]` and its span table."""
    tokens = list(ANCHOR)
    table = []
    for name in order:
        table.append((len(tokens), len(tokens) + len(spans[name])))
        tokens += spans[name]
    return tokens + tail, SpanTable(BS, tuple(table)).validate(len(tokens) + len(tail))


def blocks_of(table: SpanTable, i: int) -> slice:
    s, e = table.spans[i]
    return slice(s // BS, e // BS)


@pytest.fixture(scope="module")
def hashing():
    """vLLM's sha256 block hashing, initialized as EngineCore does."""
    from types import SimpleNamespace

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    hash_fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(hash_fn)

    def hash_block(parent, tokens, extra):
        return kcu.hash_block_tokens(hash_fn, parent, tokens, extra)

    plugin = engine_core.make_hasher_factory(kcu.get_request_block_hasher)(BS, hash_fn)
    plugin.support = SpanSupport(True)  # as on an engine whose workers all move keys
    return SimpleNamespace(fn=hash_fn, block=hash_block, stock=kcu.get_request_block_hasher(BS, hash_fn), plugin=plugin)


def request(
    tokens, hasher, table: SpanTable | None = None, cache_salt: str | None = None, extra: dict | None = None
):
    """A real vLLM request, built as EngineCore builds it (the hasher runs in the constructor)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra_args = dict(extra or {})
    if table is not None:
        extra_args[EXTRA_ARGS_KEY] = table.to_extra_args()
    params = SamplingParams(max_tokens=64, extra_args=extra_args or None)
    return Request(f"r{next(_ids)}", list(tokens), params, None, cache_salt=cache_salt, block_hasher=hasher)


def stock_hashes(hashing, tokens, cache_salt: str | None = None) -> list:
    return list(request(tokens, hashing.stock, cache_salt=cache_salt).block_hashes)


def span_hashes(hashing, tokens, table) -> list:
    return span_block_hashes(tokens, table, hashing.block)


# --------------------------------------------------------------------------------------------- (a) spans


def test_a_span_hashes_the_same_wherever_it_sits(hashing):
    first, t_first = layout("ABCD")
    third, t_third = layout("CDAB")
    h_first, h_third = span_hashes(hashing, first, t_first), span_hashes(hashing, third, t_third)
    a_first, a_third = h_first[blocks_of(t_first, 0)], h_third[blocks_of(t_third, 2)]
    assert len(a_first) == len(SPANS["A"]) // BS == 2
    assert a_first == a_third


def test_every_span_hashes_as_its_prepare_request(hashing):
    for order in ("ABCD", "DCBA", "BDAC"):
        tokens, table = layout(order)
        hashes = span_hashes(hashing, tokens, table)
        for i, name in enumerate(order):
            prepare = stock_hashes(hashing, ANCHOR + SPANS[name])
            assert hashes[blocks_of(table, i)] == prepare[ANCHOR_BLOCKS:], (order, name)


def test_span_hashes_depend_on_the_anchor(hashing):
    tokens, table = layout("AB")
    other_anchor = [t + 1 if k == 5 else t for k, t in enumerate(tokens)]
    h, h_other = span_hashes(hashing, tokens, table), span_hashes(hashing, other_anchor, table)
    assert h[blocks_of(table, 0)] != h_other[blocks_of(table, 0)]
    assert h[blocks_of(table, 1)] != h_other[blocks_of(table, 1)]


def test_a_span_is_not_hashed_as_it_would_be_in_context(hashing):
    tokens, table = layout("ABCD")
    assert (
        span_hashes(hashing, tokens, table)[blocks_of(table, 1)]
        != stock_hashes(hashing, tokens)[blocks_of(table, 1)]
    )


# --------------------------------------------------------------------------------------------- (b) after a group


def test_the_block_after_a_plus_group_depends_on_the_order(hashing):
    abcd, t_abcd = layout("ABCD")
    dcba, t_dcba = layout("DCBA")
    after = t_abcd.spans[-1][1] // BS
    h_abcd, h_dcba = span_hashes(hashing, abcd, t_abcd), span_hashes(hashing, dcba, t_dcba)
    assert len(h_abcd) == after + 1  # the tail's full block; its partial block is not hashed
    assert h_abcd[after] != h_dcba[after]
    assert h_abcd[:ANCHOR_BLOCKS] == h_dcba[:ANCHOR_BLOCKS]
    # the same order gives the same hash (so the tail itself can be reused)
    again, t_again = layout("ABCD")
    assert span_hashes(hashing, again, t_again) == h_abcd


def test_the_block_after_a_plus_group_depends_on_each_span_content(hashing):
    tokens, table = layout("ABCD")
    after = table.spans[-1][1] // BS
    base = span_hashes(hashing, tokens, table)[after]
    for name in "ABCD":
        changed = dict(SPANS)
        changed[name] = list(SPANS[name])
        changed[name][0] += 7  # the first token of the span, far from its key block for multi-block spans
        t2, table2 = layout("ABCD", spans=changed)
        assert span_hashes(hashing, t2, table2)[after] != base, name


def test_the_block_after_a_plus_group_depends_on_which_spans(hashing):
    tokens, table = layout("ABC", tail=SPANS["D"] + TAIL)  # D is context here, not a span
    abcd, t_abcd = layout("ABCD")
    assert tokens == abcd
    h, h_abcd = span_hashes(hashing, tokens, table), span_hashes(hashing, abcd, t_abcd)
    assert h[-1] != h_abcd[-1]


def test_context_between_two_plus_groups_chains_on_the_first_group(hashing):
    """`[anchor] A B [ctx] C D [tail]`: ctx depends on A, B and their order; C and D still hash as spans."""
    ctx = block_tokens(1, 7000)

    def build(first: str, second: str):
        tokens, spans = list(ANCHOR), []
        for name in first:
            spans.append((len(tokens), len(tokens) + len(SPANS[name])))
            tokens += SPANS[name]
        ctx_block = len(tokens) // BS
        tokens += ctx
        for name in second:
            spans.append((len(tokens), len(tokens) + len(SPANS[name])))
            tokens += SPANS[name]
        table = SpanTable(BS, tuple(spans)).validate(len(tokens) + len(TAIL))
        return span_hashes(hashing, tokens + TAIL, table), ctx_block, table

    h_ab, ctx_ab, table = build("AB", "CD")
    h_ba, ctx_ba, _ = build("BA", "CD")
    h_ab_dc, _, table_dc = build("AB", "DC")
    assert ctx_ab == ctx_ba
    assert h_ab[ctx_ab] != h_ba[ctx_ba]
    assert h_ab[ctx_ab] == h_ab_dc[ctx_ab]
    assert h_ab[-1] != h_ab_dc[-1]  # the block after the second group depends on its order
    prepare_c = stock_hashes(hashing, ANCHOR + SPANS["C"])[ANCHOR_BLOCKS:]
    assert h_ab[blocks_of(table, 2)] == prepare_c
    assert h_ab_dc[blocks_of(table_dc, 3)] == prepare_c


# --------------------------------------------------------------------------------------------- (c) the prefix


def test_context_before_the_first_span_hashes_exactly_as_stock(hashing):
    tokens, table = layout("ABCD")
    assert (
        span_hashes(hashing, tokens, table)[:ANCHOR_BLOCKS] == stock_hashes(hashing, tokens)[:ANCHOR_BLOCKS]
    )


def test_no_anchor_spans_chain_from_the_start(hashing):
    tokens = SPANS["A"] + SPANS["B"] + TAIL
    table = SpanTable(BS, ((0, 32), (32, 48))).validate(len(tokens))
    hashes = span_hashes(hashing, tokens, table)
    assert hashes[2:3] == stock_hashes(hashing, SPANS["B"])  # B hashes as a prompt of its own
    assert hashes[0:2] == stock_hashes(hashing, SPANS["A"])


# --------------------------------------------------------------------------------------------- (d) the plugin


def test_plugin_hasher_is_stock_for_requests_without_spans(hashing):
    tokens, _ = layout("ABCD")
    tokens = tokens + list(range(20))  # several full blocks and a partial one
    for salt, extra in ((None, None), ("salty", None), (None, {"other": 1})):
        stock = request(tokens, hashing.stock, cache_salt=salt, extra=extra)
        plugin = request(tokens, hashing.plugin, cache_salt=salt, extra=extra)
        assert len(plugin.block_hashes) == len(tokens) // BS
        assert plugin.block_hashes == stock.block_hashes
        stock.append_output_token_ids(list(range(40)))
        plugin.append_output_token_ids(list(range(40)))
        assert plugin.block_hashes == stock.block_hashes


def test_plugin_hasher_treats_an_empty_span_list_as_stock(hashing):
    tokens, _ = layout("ABCD")
    plugin = request(tokens, hashing.plugin, table=SpanTable(BS, ()))
    assert plugin.block_hashes == stock_hashes(hashing, tokens)


def test_plugin_hasher_gives_span_hashes_for_requests_with_a_span_table(hashing):
    tokens, table = layout("DCBA")
    req = request(tokens, hashing.plugin, table=table)
    assert req.sampling_params.extra_args[EXTRA_ARGS_KEY] == table.to_extra_args()
    assert req.block_hashes == span_hashes(hashing, tokens, table)
    assert req.block_hashes != stock_hashes(hashing, tokens)
    for i, name in enumerate("DCBA"):
        assert (
            req.block_hashes[blocks_of(table, i)]
            == stock_hashes(hashing, ANCHOR + SPANS[name])[ANCHOR_BLOCKS:]
        )


def test_a_hasher_whose_engine_has_not_confirmed_spans_hashes_span_tables_as_stock(hashing):
    """Spans are off until the engine's workers said they move keys (the hasher's default)."""
    from vllm.v1.core import kv_cache_utils as kcu

    unchecked = engine_core.make_hasher_factory(kcu.get_request_block_hasher)(BS, hashing.fn)
    assert not unchecked.support.enabled
    tokens, table = layout("DCBA")
    req = request(tokens, unchecked, table=table)
    assert req.block_hashes == stock_hashes(hashing, tokens)
    assert engine_core.span_table_of(req) is None  # the other hooks see a stock request too


def test_spans_with_explicit_anchor_tokens_hash_as_their_prepare_request_after_any_prefix(hashing):
    """An anchor that is not the request's prefix (the chat template's opening, say) travels as tokens: each
    span hashes as `[anchor tokens][span]` does, whatever the request holds before it."""
    canonical = tuple(block_tokens(1, 7000))
    for prefix in (block_tokens(1, 8000), block_tokens(3, 8100)):  # two different questions, other lengths
        tokens = list(prefix)
        spans = []
        for name in "CA":
            spans.append((len(tokens), len(tokens) + len(SPANS[name])))
            tokens += SPANS[name]
        tokens += TAIL
        table = SpanTable(BS, tuple(spans), (canonical, canonical)).validate(len(tokens))
        req = request(tokens, hashing.plugin, table=table)
        for i, name in enumerate("CA"):
            prepare = stock_hashes(hashing, list(canonical) + SPANS[name])
            assert req.block_hashes[blocks_of(table, i)] == prepare[len(canonical) // BS :], (prefix[:1], name)
        assert req.block_hashes[: len(prefix) // BS] == stock_hashes(hashing, prefix)  # the prefix: stock
    too_long = SpanTable(BS, ((BS, 2 * BS),), (tuple(range(BS * 1025)),))
    with pytest.raises(SpanTableError, match="at most"):
        too_long.validate(4 * BS)


def test_plugin_span_hashes_keep_the_cache_salt(hashing):
    """A salted request's spans match its salted prepare requests, and nothing unsalted."""
    tokens, table = layout("BA")
    salted = request(tokens, hashing.plugin, table=table, cache_salt="tenant-1")
    unsalted = request(tokens, hashing.plugin, table=table)
    prepare_a = stock_hashes(hashing, ANCHOR + SPANS["A"], cache_salt="tenant-1")
    assert salted.block_hashes[blocks_of(table, 1)] == prepare_a[ANCHOR_BLOCKS:]
    assert salted.block_hashes[blocks_of(table, 1)] != unsalted.block_hashes[blocks_of(table, 1)]


def test_anchor_hashes_kept_across_requests_follow_each_requests_salt_and_lora(hashing):
    """The hasher keeps explicit anchors' hashes across requests (a call's answer and recompute runs each carry
    every span's anchor): a request finds only what was hashed with its own extra keys. Each span still hashes as
    its own prepare request `[anchor][span]` with that request's salt or LoRA, whatever came before; a hasher that
    kept anchors by their tokens alone fails it."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    lead_in = tuple(block_tokens(3, 7000))
    tokens = block_tokens(1, 8000) + SPANS["C"] + TAIL
    table = SpanTable(BS, ((BS, BS + len(SPANS["C"])),), (lead_in,)).validate(len(tokens))
    lora = LoRARequest("adapter", 1, "/nonexistent/adapter")

    def req(hasher, ids, salt=None, lora_request=None, table=None):
        extra = {EXTRA_ARGS_KEY: table.to_extra_args()} if table is not None else None
        params = SamplingParams(max_tokens=1, extra_args=extra)
        return Request(f"r{next(_ids)}", list(ids), params, None, cache_salt=salt, block_hasher=hasher,
                       lora_request=lora_request)

    def check(hasher) -> None:
        for salt, adapter in ((None, None), ("tenant-1", None), (None, lora), ("tenant-2", lora), (None, None)):
            got = req(hasher, tokens, salt, adapter, table).block_hashes[blocks_of(table, 0)]
            prepare = req(hashing.stock, list(lead_in) + SPANS["C"], salt, adapter).block_hashes
            assert got == prepare[len(lead_in) // BS :], (salt, adapter)

    kept = engine_core.make_hasher_factory(kcu.get_request_block_hasher)(BS, hashing.fn)
    kept.support = SpanSupport(True)
    check(kept)
    assert len(kept._anchor_chains) == 4  # one per distinct (salt, LoRA), the last request found it kept

    # Bounded by the tokens kept (a client may send anchors of up to 16384 tokens each): the least recently used go
    kept.ANCHOR_TOKENS = 2 * len(lead_in)
    for base in (20000, 21000, 22000):
        other = tuple(block_tokens(3, base))
        t = SpanTable(BS, table.spans, (other,)).validate(len(tokens))
        assert req(kept, tokens, table=t).block_hashes[blocks_of(t, 0)] == req(
            hashing.stock, list(other) + SPANS["C"]).block_hashes[len(other) // BS :]
    assert kept._anchor_tokens == sum(len(k[0]) for k in kept._anchor_chains) <= kept.ANCHOR_TOKENS
    assert [k[0][0] for k in kept._anchor_chains] == [21000, 22000]

    by_tokens: dict = {}

    class TokensOnly(type(kept)):  # broken: kept by the anchor's tokens alone
        def _kept_anchors(self, request, extra_keys):
            inner = super()._kept_anchors(request, extra_keys)
            return None if inner is None else (lambda anchor: by_tokens.setdefault(anchor, inner(anchor)))

    broken = TokensOnly(kept.stock, BS, hashing.fn, SpanSupport(True))
    with pytest.raises(AssertionError):
        check(broken)


def test_plugin_hasher_ignores_a_table_it_cannot_trust(hashing):
    """A table for another block size, or one that does not fit the prompt, is ignored: stock hashes."""
    tokens, _ = layout("AB")
    stock = request(tokens, hashing.stock).block_hashes
    assert request(tokens, hashing.plugin, table=SpanTable(32, ((32, 64),))).block_hashes == stock
    past_the_end = SpanTable(BS, ((BS, len(tokens) + 2 * BS),))
    assert request(tokens, hashing.plugin, table=past_the_end).block_hashes == stock
    # A malformed table from a client is not an error of the engine: the request runs as stock.
    for raw in ({"v": 1, "block_size": "x", "spans": []}, {"v": 2}, "not a table", {"v": 1, "spans": [[1]]}):
        assert request(tokens, hashing.plugin, extra={EXTRA_ARGS_KEY: raw}).block_hashes == stock


# --------------------------------------------------------------------------------------------- (e) incremental


def test_incremental_hashing_equals_one_pass(hashing):
    tokens, table = layout("CADB")
    output = list(range(100, 100 + 3 * BS + 7))
    req = request(tokens, hashing.plugin, table=table)
    req.append_output_token_ids(output[:5])
    req.append_output_token_ids(output[5 : 5 + BS + 3])
    for t in output[5 + BS + 3 :]:
        req.append_output_token_ids([t])
    one_pass = span_hashes(hashing, tokens + output, table)
    assert len(one_pass) == (len(tokens) + len(output)) // BS
    assert req.block_hashes == one_pass
    # and a request whose prompt already held those tokens hashes the same
    assert request(tokens + output, hashing.plugin, table=table).block_hashes == one_pass


def test_span_block_hashes_continues_from_done(hashing):
    tokens, table = layout("ABCD")
    everything = span_hashes(hashing, tokens, table)
    for k in range(len(everything) + 1):
        done = everything[:k]
        assert done + span_block_hashes(tokens, table, hashing.block, done=done) == everything, k


def test_generated_blocks_chain_on_the_prompt(hashing):
    """Generated blocks after a plus group differ by span order too (their KV attended to it)."""
    out = list(range(100, 100 + 2 * BS))
    abcd, t_abcd = layout("ABCD")
    dcba, t_dcba = layout("DCBA")
    h1, h2 = span_hashes(hashing, abcd + out, t_abcd), span_hashes(hashing, dcba + out, t_dcba)
    assert h1[-2:] != h2[-2:]
    assert h1[-1] != h2[-1]


# --------------------------------------------------------------------------------------------- re-keying


@pytest.fixture
def rekey(hashing):
    return engine_core.rekey_missed_spans  # with the hash function the request's hasher recorded


def test_rekeying_leaves_hit_blocks_and_requests_without_spans_alone(hashing, rekey):
    tokens, table = layout("ABCD")
    req = request(tokens, hashing.plugin, table=table)
    before = list(req.block_hashes)
    all_spans_hit = table.spans[-1][1]
    assert rekey(req, all_spans_hit) == 0
    assert req.block_hashes == before
    plain = request(tokens, hashing.plugin)
    before = list(plain.block_hashes)
    assert rekey(plain, 0) == 0
    assert plain.block_hashes == before


def test_blocks_from_the_first_missed_span_are_rekeyed_in_place(hashing, rekey):
    tokens, table = layout("ABCD")
    req = request(tokens, hashing.plugin, table=table)
    hashes = req.block_hashes  # vLLM holds this very list
    before = list(hashes)
    hit = table.spans[1][0]  # anchor and A hit; B missed
    j0 = hit // BS
    assert rekey(req, hit) == len(before) - j0
    assert req.block_hashes is hashes and len(hashes) == len(before)
    assert hashes[:j0] == before[:j0]
    stock = stock_hashes(hashing, tokens)
    for j in range(j0, len(before)):
        assert hashes[j] != before[j] and hashes[j] != stock[j], j
    # a second lookup of the same request changes nothing more
    again = list(hashes)
    assert rekey(req, hit) == 0
    assert hashes == again


def test_rekeyed_blocks_depend_on_every_span_before_them(hashing, rekey):
    """Blocks computed in context attended to all spans before them; their keys must say so.

    `[anchor] A B [tail]` with A hit and B computed in context, and `[anchor] C A B [tail]` with C and A hit
    and B computed in context: B's KV differs (it attended to C too, at other positions), so the re-keyed
    hashes must differ, or a later lookup of one (after preemption) reads the other's KV.
    """
    short, t_short = layout("AB")
    long, t_long = layout("CAB")
    r_short = request(short, hashing.plugin, table=t_short)
    r_long = request(long, hashing.plugin, table=t_long)
    rekey(r_short, t_short.spans[1][0])
    rekey(r_long, t_long.spans[2][0])
    b_short = r_short.block_hashes[blocks_of(t_short, 1)]
    b_long = r_long.block_hashes[blocks_of(t_long, 2)]
    assert b_short != b_long


def test_rekeyed_blocks_depend_on_how_the_blocks_before_them_were_read(hashing, rekey):
    """The same tokens, B computed in context after A: A read as a cached span, A computed in context too, A a
    span of another anchor, or another tenant's cache salt — each is other KV for B, so each gets other keys.
    They were a chain over the tokens alone (the same in all four): a later lookup of one (after a preemption, or
    a request not admitted at once) read another's KV."""
    tokens, table = layout("AB")
    lead_in = tuple(block_tokens(2, 500))
    other_anchor = SpanTable(BS, table.spans, (lead_in, lead_in)).validate(len(tokens))
    a_hit, b_start = table.spans[1][0], table.spans[0][0]
    cases = {
        "A a cached span": (request(tokens, hashing.plugin, table=table), a_hit),
        "A in context": (request(tokens, hashing.plugin, table=table), b_start),
        "A of another anchor": (request(tokens, hashing.plugin, table=other_anchor), a_hit),
        "tenant 1": (request(tokens, hashing.plugin, table=table, cache_salt="tenant-1"), a_hit),
        "tenant 2": (request(tokens, hashing.plugin, table=table, cache_salt="tenant-2"), a_hit),
    }
    b = blocks_of(table, 1)
    keys = {}
    for name, (req, hit) in cases.items():
        rekey(req, hit)
        keys[name] = tuple(req.block_hashes[b.start :])  # B and the tail's full block
    assert len(set(keys.values())) == len(keys), "two ways of reading the same tokens share re-keyed blocks"


def test_rekeying_again_from_an_earlier_block_gives_the_keys_of_one_rekeying(hashing, rekey):
    """After a preemption a request can be looked up again with less of it cached: re-keyed from an earlier
    block, it must get the keys a request re-keyed there at once gets (the same KV), not keys built on its
    first re-keying's, which no other request shares."""
    tokens, table = layout("ABCD")
    twice = request(tokens, hashing.plugin, table=table)
    rekey(twice, table.spans[2][0])  # C missed
    rekey(twice, table.spans[1][0])  # then, looked up again, B missed
    once = request(tokens, hashing.plugin, table=table)
    rekey(once, table.spans[1][0])
    assert twice.block_hashes == once.block_hashes


def test_a_tier_lookup_after_a_preemption_keeps_the_blocks_computed_in_context_keyed_as_context(hashing):
    """A span tier's lookup restores a request's span keys before it looks them up again. After a preemption the
    engine's own lookup has already found the request's blocks computed in context (under their context keys) past
    the first re-keyed one: restoring then put span keys back, and the question's blocks it computed next were
    cached under the keys a query reading every span from the cache looks up."""
    from types import SimpleNamespace

    from spanq_backend.vllm_integration.tier import SpanTierConnector

    tokens, table = layout("AB")
    connector = SimpleNamespace(block_size=BS, tier=SimpleNamespace(holds=lambda h: False),  # an empty tier
                                in_flight_by=lambda found, rid: None, _kv_cache_manager=None, deferred_lookups=0,
                                _lookups={})  # fmt: skip
    pure = request(tokens, hashing.plugin, table=table)  # every span cached: its keys are the span layout's
    resumed = request(tokens, hashing.plugin, table=table)
    a_hit, b_end = table.spans[1][0], table.spans[1][1]
    assert SpanTierConnector.get_num_new_matched_tokens(connector, resumed, a_hit) == (0, False)  # B missed
    context_keys = list(resumed.block_hashes)
    assert context_keys[b_end // BS] != pure.block_hashes[b_end // BS]
    # Preempted, then looked up again: the engine's lookup, with the re-keyed keys, finds its own B (computed in
    # context) and stops at the tail's block, evicted first.
    assert SpanTierConnector.get_num_new_matched_tokens(connector, resumed, b_end) == (0, False)
    assert list(resumed.block_hashes) == context_keys
    # Looked up again with nothing more found (not admitted at first): restored, then re-keyed alike.
    again = request(tokens, hashing.plugin, table=table)
    SpanTierConnector.get_num_new_matched_tokens(connector, again, a_hit)
    SpanTierConnector.get_num_new_matched_tokens(connector, again, a_hit)
    assert list(again.block_hashes) == context_keys


# --------------------------------------------------------------------------------------------- (f) the table


def test_span_table_round_trips_through_extra_args():
    table = SpanTable(BS, ((32, 64), (64, 80)))
    extra = {EXTRA_ARGS_KEY: table.to_extra_args()}
    assert SpanTable.from_extra_args(extra) == table
    # msgpack turns tuples into lists on the way to the engine core
    assert (
        SpanTable.from_extra_args({EXTRA_ARGS_KEY: {"v": 1, "block_size": BS, "spans": [[32, 64], [64, 80]]}})
        == table
    )
    assert table.anchor_len == 32
    assert [table.span_at(t) for t in (0, 31, 32, 63, 64, 79, 80)] == [None, None, 0, 0, 1, 1, None]
    # Explicit anchors: one list for the spans that share one, its own for another, a length
    lead, other = tuple(block_tokens(2, 7000)), tuple(block_tokens(1, 7500))
    anchored = SpanTable(BS, ((32, 48), (48, 64), (64, 80), (80, 96)), (lead, other, lead, 32))
    raw = anchored.to_extra_args()
    assert raw["anchors"][0] is raw["anchors"][2] and raw["anchors"][1] is not raw["anchors"][0]
    assert SpanTable.from_extra_args({EXTRA_ARGS_KEY: raw}) == anchored
    copied = {**raw, "anchors": [a if isinstance(a, int) else list(a) for a in raw["anchors"]]}  # as msgpack delivers
    assert SpanTable.from_extra_args({EXTRA_ARGS_KEY: copied}) == anchored


def test_anchor_lists_read_lately_are_kept_within_a_token_budget(monkeypatch):
    """Anchor token lists are looked up by value once read (a call's requests carry the same ones); however many
    a client sends, no more than `READ_ANCHOR_TOKENS` of their tokens are kept, and each reads as it did."""
    from spanq_backend.kv import span_table

    monkeypatch.setattr(span_table, "READ_ANCHOR_TOKENS", 3 * 2 * BS)
    monkeypatch.setattr(span_table, "_READ_ANCHORS", {})
    monkeypatch.setattr(span_table, "_read_anchor_tokens", 0)
    for base in range(10000, 18000, 1000):
        anchor = block_tokens(2, base)
        raw = {"v": 1, "block_size": BS, "spans": [[32, 48]], "anchors": [anchor]}
        assert SpanTable.from_extra_args({EXTRA_ARGS_KEY: raw}).anchors == (tuple(anchor),)
        assert sum(map(len, span_table._READ_ANCHORS)) == span_table._read_anchor_tokens <= 3 * 2 * BS
    # One longer than an anchor may be (refused by `validate`) is read, not kept, and drops nothing
    held = dict(span_table._READ_ANCHORS)
    huge = {"v": 1, "block_size": BS, "spans": [[32, 48]], "anchors": [list(range(span_table.MAX_ANCHOR_TOKENS + BS))]}
    with pytest.raises(SpanTableError, match="at most"):
        SpanTable.from_extra_args({EXTRA_ARGS_KEY: huge}).validate(64)
    assert span_table._READ_ANCHORS == held


def test_from_extra_args_without_a_table_is_none():
    assert SpanTable.from_extra_args(None) is None
    assert SpanTable.from_extra_args({}) is None
    assert SpanTable.from_extra_args({"kv_transfer_params": {}}) is None


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "spans",
        [[0, 16]],
        {"v": 2, "block_size": BS, "spans": []},
        {"block_size": BS, "spans": []},
        {"v": 1, "spans": [[0, 16]]},
        {"v": 1, "block_size": BS},
        {"v": 1, "block_size": "sixteen", "spans": []},
        {"v": 1, "block_size": BS, "spans": [[0, 16, 32]]},
        {"v": 1, "block_size": BS, "spans": [16]},
        {"v": 1, "block_size": BS, "spans": 16},
        {"v": 1, "block_size": BS, "spans": [["a", 16]]},
        {"v": 1, "block_size": BS, "spans": [[16, 32]], "anchors": [["a"] * BS]},
        {"v": 1, "block_size": BS, "spans": [[16, 32]], "anchors": [{"tokens": 1}]},
    ],
)
def test_from_extra_args_refuses_malformed_tables(raw):
    with pytest.raises(SpanTableError):
        SpanTable.from_extra_args({EXTRA_ARGS_KEY: raw})


@pytest.mark.parametrize(
    "spans, prompt_len, words",
    [
        (((8, 32),), 64, "not aligned"),
        (((16, 40),), 64, "not aligned"),
        (((16, 48), (32, 64)), 64, "overlaps"),
        (((32, 48), (16, 32)), 64, "overlaps"),  # not ascending
        (((16, 16),), 64, "overlaps"),  # empty
        (((48, 80),), 64, "outside the prompt"),
        (((-16, 16),), 64, "outside the prompt"),
    ],
)
def test_validate_refuses_bad_layouts(spans, prompt_len, words):
    with pytest.raises(SpanTableError, match=words):
        SpanTable(BS, spans).validate(prompt_len)


def test_validate_refuses_a_bad_block_size():
    with pytest.raises(SpanTableError, match="block_size must be positive"):
        SpanTable(0, ()).validate(10)


def test_validate_accepts_adjacent_spans_up_to_the_prompt_end():
    table = SpanTable(BS, ((16, 32), (32, 64)))
    assert table.validate(64) is table
