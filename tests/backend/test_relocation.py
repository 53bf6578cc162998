"""spanq_backend.kv.relocation and kv_layout: which cached blocks must move, and moving them in a CPU KV cache.

`BlockPositionTracker` is fed scheduler-like events and must give exactly the moves a cache hit at another
position needs. `KVRelocator` works on synthetic KV caches written by vLLM's own CPU cache kernel, in the K
layout `discover_cpu_k_layout` finds: moved K equals RoPE at the new position, V and other blocks stay bit for bit.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spanq_backend.kv.kernels import relocate_keys_op
from spanq_backend.kv.relocation import BlockPositionTracker, KLayout, KVRelocator, Move
from spanq_backend.kv.rerope import RelocationError, RopeSpec, rerope_

BS = 32
HEAD_DIM = 64


# --------------------------------------------------------------------------------------------- the tracker


def positions(tracker: BlockPositionTracker, blocks: list[int]) -> list[int]:
    return [tracker.position_of(b) for b in blocks]


def test_computed_blocks_record_their_positions():
    t = BlockPositionTracker(BS)
    assert t.new_request("prep-a", [1, 2, 3, 4], 0) == []
    assert positions(t, [1, 2, 3, 4]) == [0, BS, 2 * BS, 3 * BS]
    assert t.readers(3) == 1


def test_hits_at_another_position_yield_exactly_the_moves():
    """Prepare `[anchor][A]` and `[anchor][B]`, then run `[anchor][B][A][tail]` with every span hit."""
    t = BlockPositionTracker(BS)
    t.new_request("prep-a", [1, 2, 10, 11], 0)  # anchor 1,2; A = 10,11 at positions 2..3 (blocks)
    t.new_request("prep-b", [1, 2, 20], 0)  # B = 20 at block 2
    t.finish("prep-a")
    t.finish("prep-b")

    moves = t.new_request("main", [1, 2, 20, 10, 11, 30], 5 * BS)

    assert moves == [Move(10, BS), Move(11, BS)]
    assert positions(t, [1, 2, 20, 10, 11, 30]) == [0, BS, 2 * BS, 3 * BS, 4 * BS, 5 * BS]
    assert t.conflicts == 0


def test_moves_are_relative_to_where_the_block_is_now():
    t = BlockPositionTracker(BS)
    t.new_request("prep", [1, 10], 0)
    t.finish("prep")
    assert t.new_request("r1", [1, 5, 6, 10], 4 * BS) == [Move(10, 2 * BS)]
    t.finish("r1")
    # later moved back forward: the delta is from the block's current position, not its first one
    assert t.new_request("r2", [1, 10], 2 * BS) == [Move(10, -2 * BS)]
    assert t.position_of(10) == BS


def test_hits_at_the_same_position_need_no_move():
    t = BlockPositionTracker(BS)
    t.new_request("a", [1, 2, 3], 0)
    assert t.new_request("b", [1, 2, 3, 4], 3 * BS) == []
    assert t.conflicts == 0  # shared at the same position: no conflict


def test_blocks_past_the_hit_are_recomputed_not_moved():
    """A block id reused for new content (evicted, reallocated) takes the position it is computed at."""
    t = BlockPositionTracker(BS)
    t.new_request("old", [7, 8, 9], 0)
    t.finish("old")
    moves = t.new_request("new", [1, 2, 3, 9, 8], BS)  # only block 1 is a hit; 9 and 8 are recomputed
    assert moves == []
    assert positions(t, [9, 8]) == [3 * BS, 4 * BS]


def test_extend_request_places_new_blocks_at_the_next_logical_indices():
    t = BlockPositionTracker(BS)
    t.new_request("r", [1, 2], 0)
    t.extend_request("r", [5])
    t.extend_request("r", [])
    t.extend_request("r", [9, 4])
    assert positions(t, [1, 2, 5, 9, 4]) == [0, BS, 2 * BS, 3 * BS, 4 * BS]
    assert all(t.readers(b) == 1 for b in (1, 2, 5, 9, 4))


def test_extend_request_never_moves_even_a_known_block():
    t = BlockPositionTracker(BS)
    t.new_request("a", [3], 0)
    t.finish("a")
    t.new_request("r", [1, 2], 0)
    t.extend_request("r", [3])  # block 3 is recomputed here by r
    assert t.position_of(3) == 2 * BS


def test_finish_releases_the_request_from_its_blocks():
    t = BlockPositionTracker(BS)
    t.new_request("a", [1, 2], 0)
    t.new_request("b", [1, 2, 3], 2 * BS)
    t.finish("a")
    assert t.readers(1) == 1 and t.readers(3) == 1
    t.finish("b")
    assert t.readers(1) == t.readers(2) == t.readers(3) == 0
    t.finish("b")  # finishing twice is harmless
    t.finish("never-seen")
    # positions outlive the requests: the blocks stay cached
    assert positions(t, [1, 2, 3]) == [0, BS, 2 * BS]


def test_a_resumed_request_is_placed_again():
    """vLLM replaces a resumed request's blocks: the old ones are released, the new hits may move."""
    t = BlockPositionTracker(BS)
    t.new_request("p", [1, 10], 0)
    t.finish("p")
    t.new_request("r", [1, 2, 3], 0)
    moves = t.new_request("r", [1, 4, 10, 5], 3 * BS)  # resumed: new blocks, 1/4/10 hit
    assert moves == [Move(10, BS)]
    assert t.readers(2) == t.readers(3) == 0
    assert t.readers(10) == 1
    assert positions(t, [1, 4, 10, 5]) == [0, BS, 2 * BS, 3 * BS]


def test_conflicts_count_moves_of_blocks_another_running_request_reads_elsewhere():
    t = BlockPositionTracker(BS)
    t.new_request("a", [1, 10, 11], 0)  # running, reads 10 at block 1
    moves = t.new_request("b", [1, 2, 10], 3 * BS)  # wants 10 at block 2 while a runs
    assert moves == [Move(10, BS)]
    assert t.conflicts == 1
    t.finish("a")
    t.finish("b")
    t.new_request("c", [1, 10], 2 * BS)  # nobody else reads it now
    assert t.conflicts == 1


def test_no_conflict_with_the_request_itself_when_resumed():
    t = BlockPositionTracker(BS)
    t.new_request("p", [1, 10], 0)
    t.finish("p")
    t.new_request("r", [1, 10], 2 * BS)
    t.new_request("r", [1, 2, 10], 3 * BS)  # resumed with 10 one block later
    assert t.conflicts == 0


def test_a_copied_block_encodes_its_sources_position_and_moves_from_there():
    """CIDRA's duplicate: the copy's keys are the source's, so a hit on the copy moves it from there."""
    t = BlockPositionTracker(BS)
    t.new_request("p", [1, 10], 0)
    t.new_request("a", [1, 2, 10], 3 * BS)  # running, reads 10 at block 2
    assert t.position_of(10) == 2 * BS
    t.copied(10, 20)
    assert t.position_of(20) == 2 * BS
    moves = t.new_request("b", [1, 20], 2 * BS)  # b reads its private copy at block 1
    assert moves == [Move(20, -BS)]
    assert t.position_of(10) == 2 * BS  # a's block is untouched


class _ReferenceTracker:
    """The tracker's rules written the plain way (a dict and a set of readers per block), to check it against."""

    def __init__(self):
        self.position: dict[int, int] = {}
        self.readers: dict[int, set[str]] = {}
        self.held: dict[str, list[int]] = {}
        self.conflicts = 0

    def place(self, req: str, blocks: list[int], first: int, hits: int) -> list[Move]:
        moves = []
        for j, b in enumerate(blocks, start=first):
            have = self.position.get(b)
            if j - first < hits and have is not None and have != j * BS:
                self.conflicts += bool(self.readers.get(b, set()) - {req})
                moves.append(Move(b, j * BS - have))
            self.position[b] = j * BS
            self.readers.setdefault(b, set()).add(req)
        self.held.setdefault(req, []).extend(blocks)
        return moves

    def finish(self, req: str) -> None:
        for b in self.held.pop(req, []):
            self.readers.get(b, set()).discard(req)


_event = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 5), st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True),
              st.integers(0, 8)),
    st.tuples(st.just("extend"), st.integers(0, 5), st.lists(st.integers(0, 40), max_size=3, unique=True)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("copy"), st.integers(0, 40), st.integers(0, 40)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=40), st.sampled_from([0, 8, 64]))
def test_tracker_follows_the_reference_rules(events, num_blocks):
    """Random admissions, extensions, finishes and copies: the array-backed tracker gives the same moves,
    positions, reader counts and conflicts as the rules written block by block."""
    t, ref = BlockPositionTracker(BS, num_blocks), _ReferenceTracker()
    for event in events:
        kind, *args = event
        if kind == "new":
            req, blocks, hits = f"r{args[0]}", args[1], args[2]
            ref.finish(req)
            assert t.new_request(req, blocks, hits * BS) == ref.place(req, blocks, 0, hits)
        elif kind == "extend":
            req, blocks = f"r{args[0]}", args[1]
            if req in ref.held and not set(blocks) & set(ref.held[req]):
                t.extend_request(req, blocks)
                ref.place(req, blocks, len(ref.held[req]), 0)
        elif kind == "finish":
            t.finish(f"r{args[0]}")
            ref.finish(f"r{args[0]}")
        else:
            src, dst = args
            t.copied(src, dst)
            if src in ref.position:
                ref.position[dst] = ref.position[src]
            else:
                ref.position.pop(dst, None)
        for b in range(41):
            assert t.position_of(b) == ref.position.get(b), b
            assert t.readers(b) == len(ref.readers.get(b, ())), b
        assert t.conflicts == ref.conflicts


# --------------------------------------------------------------------------------------------- the relocator


@pytest.fixture(params=["compiled", "torch"])
def compiled(request) -> bool:
    """Each relocator test runs on spanq's compiled CPU op and on the plain torch passes."""
    if request.param == "compiled":
        if os.environ.get("SPANQ_NO_KERNELS", "") not in ("", "0"):
            pytest.skip("SPANQ_NO_KERNELS is set")
        relocate_keys_op(required=True)  # setup builds it on this machine: fail loudly, do not fall back
    return request.param == "compiled"


@pytest.fixture(scope="module")
def ops():
    from vllm import _custom_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return SimpleNamespace(write=_custom_ops.cpu_attn_reshape_and_cache, isa=_get_attn_isa)


def write_cache(
    ops, kv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]
) -> None:
    """Write `[blocks, heads, BS, D]` keys and values into blocks of a CPU_ATTN cache with vLLM's kernel."""
    nb, heads, bs, two_d = kv.shape
    d = two_d // 2
    key_cache, value_cache = kv.view(nb, heads, 2 * bs, d).chunk(2, dim=2)
    k = keys.permute(0, 2, 1, 3).reshape(-1, heads, d).contiguous()  # [tokens, heads, D]
    v = values.permute(0, 2, 1, 3).reshape(-1, heads, d).contiguous()
    slots = torch.cat([torch.arange(bs) + b * bs for b in block_ids]).long()
    ops.write(k, v, key_cache, value_cache, slots, ops.isa(kv.dtype, bs, d))


def plain_spec(n: int = 4096) -> RopeSpec:
    """A plain RoPE table in float32, as vLLM keeps one. Worked out in float64: a process's first float32 `cos`
    on this machine's two threads came out ~3e-4 off in some runs (`RopeSpec` refused it, and collection failed:
    `_Rope()` below builds one when the module is imported); float64's is exact to float32's rounding."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float()
    return RopeSpec.from_cos_sin_cache(table, HEAD_DIM, HEAD_DIM, True)


@pytest.fixture(scope="module")
def layout(ops):
    from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

    kv = torch.zeros(4, 2, BS, 2 * HEAD_DIM)
    return discover_cpu_k_layout(SimpleNamespace(kv_caches=[kv]), BS, HEAD_DIM)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "dtype, bs, head_dim",
    [
        (torch.float32, 32, 64),  # isa "vec"
        (torch.float32, 32, 80),  # isa "vec16"
        (torch.float32, 16, 64),  # isa "vec16"
        (torch.float32, 128, 128),
        (torch.bfloat16, 32, 64),  # SmolLM2's own dtype
    ],
    ids=["fp32-32x64", "fp32-32x80", "fp32-16x64", "fp32-128x128", "bf16-32x64"],
)
def test_discovered_layout_reads_back_what_the_kernel_wrote(ops, dtype, bs, head_dim):
    """The layout maps (token, dim) to where vLLM's own kernel put it, for the cache dtypes models use."""
    from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

    heads = 2
    kv = torch.zeros(3, heads, bs, 2 * head_dim, dtype=dtype)
    layout = discover_cpu_k_layout(SimpleNamespace(kv_caches=[kv]), bs, head_dim)
    assert layout.flat_index.shape == (bs, head_dim)
    assert sorted(layout.flat_index.reshape(-1).tolist()) == list(range(bs * head_dim))
    keys = torch.randn(1, heads, bs, head_dim).to(dtype)
    write_cache(ops, kv, keys, torch.zeros_like(keys), [1])
    k_region = kv[1].reshape(heads, -1)[:, : bs * head_dim]
    assert torch.equal(k_region[:, layout.flat_index], keys[0])


def test_row_major_layout_is_token_major():
    layout = KLayout.row_major(4, 3)
    assert layout.flat_index.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def logical_k(kv: torch.Tensor, layout: KLayout, block: int) -> torch.Tensor:
    heads = kv.shape[1]
    return kv[block].reshape(heads, -1)[:, : BS * HEAD_DIM][:, layout.flat_index]  # [heads, BS, D]


def v_region(kv: torch.Tensor, block: int) -> torch.Tensor:
    return kv[block].reshape(kv.shape[1], -1)[:, BS * HEAD_DIM :]


@pytest.fixture
def caches(ops):
    """Two layers, 6 blocks, 2 KV heads, filled with random K/V by vLLM's kernel; and the K/V written."""
    gen = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(2):
        kv = torch.zeros(6, 2, BS, 2 * HEAD_DIM)
        keys = torch.randn(6, 2, BS, HEAD_DIM, generator=gen)
        values = torch.randn(6, 2, BS, HEAD_DIM, generator=gen)
        write_cache(ops, kv, keys, values, list(range(6)))
        layers.append(SimpleNamespace(kv=kv, keys=keys, values=values))
    return layers


@pytest.mark.vllm
def test_relocating_one_block_rotates_its_keys_and_nothing_else(ops, layout, caches, compiled):
    spec = plain_spec()
    before = [c.kv.clone() for c in caches]
    relocator = KVRelocator([c.kv for c in caches], layout, spec, compiled=compiled)

    relocator.apply([Move(2, 96)])

    for c, old in zip(caches, before):
        expected = rerope_(c.keys[2].clone(), 96, spec)
        torch.testing.assert_close(logical_k(c.kv, layout, 2), expected, rtol=0, atol=1e-5)
        assert torch.equal(v_region(c.kv, 2), v_region(old, 2))
        for b in (0, 1, 3, 4, 5):
            assert torch.equal(c.kv[b], old[b]), b
    assert relocator.moved_blocks == 1


@pytest.mark.vllm
def test_relocation_equals_writing_the_moved_keys_with_the_kernel(ops, layout, caches, compiled):
    """Layout-independent check: the cache after a move is the cache vLLM writes for the re-roped keys."""
    spec = plain_spec()
    deltas = {1: 32, 3: -64, 4: 32, 5: 1000}
    KVRelocator([c.kv for c in caches], layout, spec, compiled=compiled).apply([Move(b, d) for b, d in deltas.items()])
    for c in caches:
        expected = torch.zeros_like(c.kv)
        moved_keys = c.keys.clone()
        for b, d in deltas.items():
            rerope_(moved_keys[b], d, spec)
        write_cache(ops, expected, moved_keys, c.values, list(range(6)))
        torch.testing.assert_close(c.kv, expected, rtol=0, atol=1e-5)
        for b in range(6):
            assert torch.equal(v_region(c.kv, b), v_region(expected, b))
        assert torch.equal(c.kv[0], expected[0]) and torch.equal(c.kv[2], expected[2])


@pytest.mark.vllm
def test_zero_moves_touch_nothing(layout, caches, compiled):
    before = [c.kv.clone() for c in caches]
    relocator = KVRelocator([c.kv for c in caches], layout, plain_spec(), compiled=compiled)
    relocator.apply([])
    relocator.apply([Move(1, 0), Move(4, 0)])
    for c, old in zip(caches, before):
        assert torch.equal(c.kv, old)
    assert relocator.moved_blocks == 0


@pytest.mark.vllm
def test_two_moves_of_one_block_add_up(layout, caches, compiled):
    """Two requests placed in one step can move the same block twice: the block must end at the sum."""
    spec = plain_spec()
    KVRelocator([c.kv for c in caches], layout, spec, compiled=compiled).apply([Move(3, 64), Move(3, 64)])
    for c in caches:
        torch.testing.assert_close(
            logical_k(c.kv, layout, 3), rerope_(c.keys[3].clone(), 128, spec), rtol=0, atol=1e-5
        )


@pytest.mark.vllm
def test_tracker_moves_applied_by_the_relocator_put_keys_at_the_new_position(layout, caches, compiled):
    """End to end without vLLM's engine: computed at one place, hit at another, moved, equals fresh RoPE there."""
    spec = plain_spec()
    tracker = BlockPositionTracker(BS)
    tracker.new_request("prep", [0, 1, 2], 0)  # block 2 = a span computed at logical block 2
    tracker.finish("prep")
    moves = tracker.new_request("main", [0, 5, 4, 2, 3], 4 * BS)  # the span now sits at logical block 3
    assert moves == [Move(2, BS)]
    KVRelocator([c.kv for c in caches], layout, spec, compiled=compiled).apply(moves)
    for c in caches:
        torch.testing.assert_close(
            logical_k(c.kv, layout, 2), rerope_(c.keys[2].clone(), BS, spec), rtol=0, atol=1e-5
        )


def test_relocator_with_a_token_major_layout(compiled):
    """Without vLLM: a cache whose K region is token-major, described by `KLayout.row_major`."""
    bs, heads = 4, 3
    spec = plain_spec()
    kv = torch.randn(5, heads, bs, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    before = kv.clone()
    k_of = lambda t, b: t.view(5, heads, 2, bs, HEAD_DIM)[b, :, 0]
    relocator = KVRelocator([kv], KLayout.row_major(bs, HEAD_DIM), spec, compiled=compiled)

    relocator.apply([Move(1, 7), Move(4, -3)])

    torch.testing.assert_close(k_of(kv, 1), rerope_(k_of(before, 1).clone(), 7, spec), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_of(kv, 4), rerope_(k_of(before, 4).clone(), -3, spec), rtol=0, atol=1e-5)
    for b in (0, 2, 3):
        assert torch.equal(kv[b], before[b])
    assert torch.equal(
        kv.view(5, heads, 2, bs, HEAD_DIM)[:, :, 1], before.view(5, heads, 2, bs, HEAD_DIM)[:, :, 1]
    )
    assert relocator.moved_blocks == 2


def gptj_spec(n: int = 4096) -> RopeSpec:
    plain = plain_spec(n)
    return RopeSpec.from_cos_sin_cache(plain.cos_sin_cache, HEAD_DIM, HEAD_DIM, False)


def layout_of(kind: str, bs: int) -> KLayout:
    if kind == "row_major":
        index = torch.arange(bs * HEAD_DIM).view(bs, HEAD_DIM)
    elif kind == "transposed":  # dim d of token t at d * bs + t, CPU attention's "vec" layout
        index = torch.arange(bs * HEAD_DIM).view(HEAD_DIM, bs).t()
    else:  # any other permutation
        index = torch.randperm(bs * HEAD_DIM, generator=torch.Generator().manual_seed(5)).view(bs, HEAD_DIM)
    return KLayout(bs, HEAD_DIM, index)


@pytest.mark.parametrize("kind", ["row_major", "transposed", "permuted"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_relocator_in_any_layout(kind, neox, dtype, compiled):
    """Synthetic caches in a given K layout: each moved block's keys are re-roped by their net delta."""
    bs, heads, nb = 8, 2, 7
    spec = plain_spec() if neox else gptj_spec()
    layout = layout_of(kind, bs)
    gen = torch.Generator().manual_seed(7)
    logical = [torch.randn(nb, heads, bs, HEAD_DIM, generator=gen).to(dtype) for _ in range(2)]
    caches = []
    for keys in logical:
        kv = torch.randn(nb, heads, bs, 2 * HEAD_DIM, generator=gen).to(dtype)
        k_region = kv.view(nb, heads, -1)[:, :, : bs * HEAD_DIM]
        k_region[:, :, layout.flat_index.reshape(-1)] = keys.reshape(nb, heads, -1)
        caches.append(kv)
    before = [kv.clone() for kv in caches]
    moves = [Move(1, 40), Move(3, -7), Move(5, 40), Move(3, 2), Move(6, 5), Move(6, -5), Move(0, 0)]
    net = {1: 40, 3: -5, 5: 40}

    relocator = KVRelocator(caches, layout, spec, compiled=compiled)
    assert relocator.uses_compiled_kernel == (compiled and kind != "permuted")
    relocator.apply(moves)

    for kv, old, keys in zip(caches, before, logical):
        k_now = kv.view(nb, heads, -1)[:, :, : bs * HEAD_DIM][:, :, layout.flat_index]
        for b in range(nb):
            if b in net:
                expected = rerope_(keys[b].clone(), net[b], spec)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(k_now[b], expected, rtol=tol, atol=tol)
            else:
                assert torch.equal(kv[b], old[b]), b
        v_now, v_old = (
            kv.view(nb, heads, -1)[:, :, bs * HEAD_DIM :],
            old.view(nb, heads, -1)[:, :, bs * HEAD_DIM :],
        )
        assert torch.equal(v_now, v_old)


def test_relocator_moves_many_blocks(compiled):
    """More blocks than one chunk of work: every one of them moves, and only those."""
    bs, heads, nb = 32, 2, 400
    spec = plain_spec()
    layout = layout_of("transposed", bs)
    kv = torch.randn(nb, heads, bs, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(9))
    before = kv.clone()
    moved = list(range(3, nb, 2))
    relocator = KVRelocator([kv], layout, spec, compiled=compiled)
    relocator.apply([Move(b, 32 * (b % 5 + 1)) for b in moved])
    k_of = lambda t: t.view(nb, heads, -1)[:, :, : bs * HEAD_DIM][:, :, layout.flat_index]
    expected = k_of(before).clone()
    for b in moved:
        rerope_(expected[b], 32 * (b % 5 + 1), spec)
    torch.testing.assert_close(k_of(kv), expected, rtol=0, atol=1e-5)
    assert torch.equal(kv[0::2], before[0::2]) and torch.equal(kv[1:3], before[1:3])
    assert relocator.moved_blocks == len(moved)


def test_compiled_op_refuses_bad_input_before_touching_the_cache():
    """Bad block ids, deltas past the table or caches of mixed dtypes: a clear error and the cache unchanged."""
    op = relocate_keys_op(required=True)
    spec = plain_spec(256)
    table = spec.cos_sin_cache.float().contiguous()
    kv = torch.randn(4, 2, BS, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(4))
    before = kv.clone()
    ids = lambda *b: list(b)
    cases = [
        (([kv], ids(1, 4), ids(32, 32), table), "block id 4 out of range"),
        (([kv], ids(1, 2), ids(32, 256), table), "delta 256 exceeds the table"),
        (([kv, kv.to(torch.bfloat16)], ids(1), ids(32), table), "share dtype"),
        (([kv], ids(1, 2), ids(32), table), "one length"),
        (([kv], ids(1), ids(32), table.double()), "float32"),
        (([kv.double()], ids(1), ids(32), table), "not supported"),
    ]
    for (caches, block_ids, deltas, tab), message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(caches, block_ids, deltas, tab, BS, HEAD_DIM, HEAD_DIM, True, True)
        assert torch.equal(kv, before), message


def test_relocator_refuses_a_delta_past_the_rotary_table(compiled):
    kv = torch.randn(4, 2, BS, 2 * HEAD_DIM)
    before = kv.clone()
    relocator = KVRelocator([kv], layout_of("transposed", BS), plain_spec(256), compiled=compiled)
    with pytest.raises(RelocationError, match="exceeds the rotary table"):
        relocator.apply([Move(1, 32), Move(2, 300)])
    assert torch.equal(kv, before) and relocator.moved_blocks == 0


# --------------------------------------------------------------------------------------------- the runner hook


class _Rope(torch.nn.Module):
    """The attributes `rope_spec_of_model` reads from a vLLM rotary embedding."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", plain_spec(256).cos_sin_cache)
        self.rotary_dim = self.head_size = HEAD_DIM
        self.is_neox_style = True


def _stock_step():
    return SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id="stock", block_ids=([1, 2],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        kv_cache_block_copies=None,
    )


@pytest.mark.vllm
@pytest.mark.parametrize(
    "model, dtype",
    [(_Rope(), torch.float32), (torch.nn.Linear(2, 2), torch.float32), (_Rope(), torch.bfloat16)],
    ids=["fp32-rope-model", "no-rope-model", "bf16-cache"],
)
def test_stock_steps_run_on_a_runner_whose_keys_cannot_move(monkeypatch, model, dtype):
    """Invariant 7 (docs/design.md): with the plugin installed, a model spanq cannot relocate still serves stock requests."""
    from spanq_backend.vllm_integration import worker

    ran = []
    execute_model = worker.wrap_execute_model(lambda self, step, *a, **k: ran.append(step) or "output")

    class Runner(SimpleNamespace):  # a model runner: hashed by identity, as vLLM's are
        __hash__ = object.__hash__
        __eq__ = object.__eq__

    runner = Runner(
        kv_caches=[torch.zeros(4, 2, BS, 2 * HEAD_DIM, dtype=dtype)],
        cache_config=SimpleNamespace(block_size=BS),
        get_model=lambda: model,
    )
    step = _stock_step()
    assert execute_model(runner, step) == "output"
    assert ran == [step]


# --------------------------------------------------------------------------------------------- self-check


def cpu_check(kv, layout, make_relocator=None):
    from spanq_backend.kv.relocation import KVRelocator
    from spanq_backend.vllm_integration import kv_layout

    kv_layout.self_check(
        [kv], plain_spec(), write_keys=kv_layout.cpu_write_keys, read_keys=kv_layout.cpu_read_keys(layout),
        make_relocator=make_relocator or (lambda caches: KVRelocator(caches, layout, plain_spec())), block_size=BS,
    )


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_start_up_self_check_passes_on_a_real_cpu_cache_and_leaves_it_unchanged(ops, dtype):
    from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

    kv = torch.randn(6, 2, BS, 2 * HEAD_DIM).to(dtype)
    before = kv.clone()
    layout = discover_cpu_k_layout(SimpleNamespace(kv_caches=[kv]), BS, HEAD_DIM)
    cpu_check(kv, layout)
    assert torch.equal(kv, before), "the checked block is restored"


@pytest.mark.vllm
def test_the_self_check_refuses_a_misread_layout_and_a_wrong_relocator(ops):
    """What keeps a user on untested hardware safe: a layout that does not match what the backend's op writes,
    or a relocator that moves keys wrongly, fails the check (and the engine then turns spans off)."""
    from spanq_backend.kv.relocation import KLayout, KVRelocator
    from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

    kv = torch.zeros(6, 2, BS, 2 * HEAD_DIM)
    right = discover_cpu_k_layout(SimpleNamespace(kv_caches=[kv]), BS, HEAD_DIM)
    wrong = KLayout.row_major(BS, HEAD_DIM) if right.kind == "transposed" else KLayout.transposed(BS, HEAD_DIM)
    with pytest.raises(RelocationError, match="not where the K layout says"):
        cpu_check(kv, wrong)

    class Unmoved(KVRelocator):
        def apply(self, moves):  # keys left where they were
            return None

    class Backwards(KVRelocator):
        def apply(self, moves):
            super().apply([m._replace(delta=-m.delta) for m in moves])

    for broken in (Unmoved, Backwards):
        with pytest.raises(RelocationError, match="differ from the reference rotation"):
            cpu_check(kv, right, lambda caches, broken=broken: broken(caches, right, plain_spec()))
    assert not kv.any(), "restored after a failed check too"


@pytest.mark.vllm
def test_the_self_check_covers_every_layer_both_directions_and_each_block_of_a_step(ops):
    """#32 item 10: a relocator that is right on layer 0, for a forward move of one block (all the check used to
    try), but wrong on a later layer, backwards, or for a step's second block, is refused, naming the layer."""
    from spanq_backend.kv.relocation import KVRelocator
    from spanq_backend.vllm_integration import kv_layout
    from spanq_backend.vllm_integration.kv_layout import discover_cpu_k_layout

    layers = [torch.zeros(6, 2, BS, 2 * HEAD_DIM) for _ in range(3)]
    layout = discover_cpu_k_layout(SimpleNamespace(kv_caches=layers[:1]), BS, HEAD_DIM)

    def check(make_relocator):
        kv_layout.self_check(
            layers, plain_spec(), write_keys=kv_layout.cpu_write_keys, read_keys=kv_layout.cpu_read_keys(layout),
            make_relocator=make_relocator, block_size=BS,
        )

    check(lambda caches: KVRelocator(caches, layout, plain_spec()))  # the real one passes on every layer

    class ForwardOnly(KVRelocator):
        def apply(self, moves):
            super().apply([m for m in moves if m.delta > 0])

    class FirstMoveOnly(KVRelocator):
        def apply(self, moves):
            super().apply(list(moves)[:1])

    broken = {
        "layer 2": lambda caches: KVRelocator(caches[:-1], layout, plain_spec()),  # the last layer left unmoved
        "moved by -": lambda caches: ForwardOnly(caches, layout, plain_spec()),
        "by -37 positions": lambda caches: FirstMoveOnly(caches, layout, plain_spec()),
    }
    for where, make in broken.items():
        with pytest.raises(RelocationError, match=where):
            check(make)
        assert not any(kv.any() for kv in layers), f"restored after the failed check ({where})"


def logical_writer(kv, keys, block):
    """What the GPU backends' cache-write ops do (FlashAttention's `reshape_and_cache_flash`): K of token t, dim d
    at its logical place."""
    kv[block, :, :, : keys.shape[-1]] = keys.transpose(0, 1).to(kv.dtype)


@pytest.mark.vllm
def test_the_gpu_path_self_check_passes_in_every_kv_cache_layout_and_refuses_the_cpu_order(ops):
    """The GPU path's check (keys written by the backend, read at their logical place, moved by the strided
    relocator) on CPU tensors in each KVCacheLayout; the CPU backend's own op, which keeps K in another order,
    is refused by the same check."""
    from spanq_backend.kv.strided import StridedKVRelocator
    from spanq_backend.vllm_integration import kv_layout
    from tests.backend.kv_layout_cases import HEAD_DIM as HD
    from tests.backend.kv_layout_cases import LAYOUTS, caches, spec_of

    spec = spec_of("neox")
    for name in LAYOUTS:
        kv = caches(name, torch.float32)
        before = [k.clone() for k in kv]
        kv_layout.self_check(
            kv, spec, write_keys=logical_writer, read_keys=kv_layout.logical_read_keys(HD),
            make_relocator=lambda c: StridedKVRelocator(c, spec), block_size=kv[0].shape[2],
        )
        assert all(torch.equal(a, b) for a, b in zip(kv, before)), name
    cpu_cache = torch.zeros(6, 2, BS, 2 * HEAD_DIM)
    with pytest.raises(RelocationError, match="not where the K layout says"):
        kv_layout.self_check(
            [cpu_cache], plain_spec(), write_keys=kv_layout.cpu_write_keys,
            read_keys=kv_layout.logical_read_keys(HEAD_DIM),
            make_relocator=lambda c: StridedKVRelocator(c, plain_spec()), block_size=BS,
        )


class LogicalWriter:
    """A GPU backend's `do_kv_cache_update`, in torch (what FlashAttention's `reshape_and_cache_flash` does): key
    and value of each slot at their logical place. `scale` stands for a quantized cache (K stored divided by its
    scale), `shuffle` for a backend that keeps K in another order inside a block."""

    def __init__(self, scale: float = 1.0, shuffle: bool = False):
        self.scale, self.shuffle = scale, shuffle

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        bs, hd = kv_cache.shape[2], key.shape[-1]
        for i, slot in enumerate(slot_mapping.tolist()):
            b, t = divmod(slot, bs)
            t = bs - 1 - t if self.shuffle else t
            kv_cache[b, :, t, :hd] = key[i] / self.scale
            kv_cache[b, :, t, hd:] = value[i]


def gpu_like_runner(kv_caches, impl):
    layer = SimpleNamespace(impl=impl, kv_cache=[kv_caches[0]])
    other = SimpleNamespace(impl=impl, kv_cache=[kv_caches[-1]])
    context = {"model.layers.1.self_attn.attn": other, "model.layers.0.self_attn.attn": layer, "lm_head": object()}
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))


@pytest.mark.vllm
def test_the_gpu_runtime_path_checks_the_backends_own_write_op_then_moves_keys_in_every_layout():
    """The runtime's GPU path (`backend_relocator`), driven on CPU tensors through a backend write op that puts K
    at its logical place: accepted in every KVCacheLayout, and its relocator moves keys exactly; a backend that
    stores K in another order, or scaled (a quantized cache), is refused before any span is honoured."""
    from spanq_backend.kv.strided import StridedKVRelocator
    from spanq_backend.vllm_integration import kv_layout
    from tests.backend.kv_layout_cases import LAYOUTS, MOVES, caches, reference, spec_of

    spec = spec_of("gptj")
    for name in LAYOUTS:
        kv = caches(name, torch.float32)
        relocator = kv_layout.backend_relocator(gpu_like_runner(kv, LogicalWriter()), kv, spec, kv[0].shape[2])
        assert isinstance(relocator, StridedKVRelocator)
        want = reference(kv, spec)
        relocator.apply(MOVES)
        assert max(float((a - b).abs().max()) for a, b in zip(kv, want)) <= 1e-5, name
    for broken, why in ((LogicalWriter(shuffle=True), "not where the K layout says"), (LogicalWriter(scale=2.0), "not where")):
        kv = caches("LBNHC", torch.float32)
        with pytest.raises(RelocationError, match=why):
            kv_layout.backend_relocator(gpu_like_runner(kv, broken), kv, spec, kv[0].shape[2])


def test_caches_off_the_cpu_take_the_backend_path(monkeypatch):
    from spanq_backend.vllm_integration import kv_layout

    taken = []
    monkeypatch.setattr(kv_layout, "backend_relocator", lambda *a: taken.append("backend") or "backend")
    monkeypatch.setattr(kv_layout, "cpu_relocator", lambda *a: taken.append("cpu") or "cpu")
    meta = [torch.empty(4, 2, BS, 2 * HEAD_DIM, device="meta")]
    cpu = [torch.empty(4, 2, BS, 2 * HEAD_DIM)]
    assert kv_layout.checked_relocator(None, meta, plain_spec(), BS) == "backend"
    assert kv_layout.checked_relocator(None, cpu, plain_spec(), BS) == "cpu"
