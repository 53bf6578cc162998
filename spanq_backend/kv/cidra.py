"""CIDRA planning: concurrent requests that need one cached block at different positions.

A cached span block holds keys rotated for one position. When the scheduler admits a request whose
prefix-cache hit includes a block that running requests read at another position, rotating that block in
place would corrupt them. The planner decides, per hit block:
- *in place*: nobody running reads the block, or they read it at the position this request needs — the
  runner rotates it (if needed) before the forward pass;
- *duplicate*: the block is in use at another position, or this request reads it twice (two spans whose
  first blocks hold the same tokens share one cached block) — the scheduler gives this request a private copy
  (vLLM's copy-on-write path: a block from the pool, counted against KV capacity before the request is
  admitted, copied before the forward pass, freed with the request), which the runner then rotates.

With vLLM's block tables every request reads blocks through its own indirection, so relocation never has
to move a block's contents into another block's slot: every rotation is in place on a block this request
owns or shares at one position. The reposition graph is therefore a set of self-loops once duplicates are
split off — the cycles that a slot-permuting CIDRA must break (strongly connected components) cannot arise,
and all rotations of a step are independent and run as one batch (`relocation.KVRelocator`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["CidraPlanner", "StepPlan"]


@dataclass
class StepPlan:
    """What one admission needs: hit-block indices to duplicate (the rest are used in place), and the block ids
    used in place at another position than their keys sit at (rotated in place: `CidraPlanner.moved`)."""

    duplicate: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    hits: int = 0  # the request's blocks its lookup found cached (those after it are allocated anew)


@dataclass(eq=False)
class CidraPlanner:
    """Tracks at which position running requests read each block, and plans admissions against it.

    `users_of(block_id)` says how many running requests hold the block (vLLM's ref count): positions recorded
    for blocks nobody holds any more are stale and ignored.

    `max_moves` (None: unbounded): how many times one cached block's keys may be rotated in place before `moved`
    reports it worn — a cache below float32 rounds the keys once per move, so a hot span read at ever new
    positions would drift without end; the engine then drops the block from its prefix cache, and the next
    reader prepares it again, exact. Positions recorded for a block (`in_use_at`) are where its keys sit now.
    """

    block_size: int
    users_of: Callable[[int], int]
    in_use_at: dict[int, int] = field(default_factory=dict)  # block id -> position its readers need
    duplicates_made: int = 0  # private copies given to admitted requests (counted where they are made)
    max_moves: int | None = None
    moves: dict[int, int] = field(default_factory=dict)  # block id -> in-place moves since it was computed

    def plan(self, hit_block_ids: Sequence[int]) -> StepPlan:
        """Decide, for a request about to read `hit_block_ids` as its logical blocks 0..n-1."""
        dup, moved = [], []
        in_use_at, bs = self.in_use_at, self.block_size
        first_use: dict[int, int] = {}  # block -> the first logical index this request reads it at
        for j, b in enumerate(hit_block_ids):
            if first_use.setdefault(b, j) != j:  # read twice by this request: the second use gets a copy
                dup.append(j)
                continue
            have = in_use_at.get(b)
            # The ref count (a call into vLLM's block pool) only where the recorded position differs.
            if have is not None and have != j * bs and self.users_of(b) > 0:
                dup.append(j)
            elif have is not None and have != j * bs:
                moved.append(b)
        return StepPlan(duplicate=dup, moved=moved, hits=len(hit_block_ids))

    def moved_in_place(self, block_ids: Sequence[int]) -> list[int]:
        """An admitted request's blocks rotated in place (`StepPlan.moved`): counted, and those now moved
        `max_moves` times returned (worn: to be dropped from the prefix cache)."""
        if self.max_moves is None:
            return []
        worn = []
        for b in block_ids:
            self.moves[b] = n = self.moves.get(b, 0) + 1
            if n >= self.max_moves:
                worn.append(b)
                del self.moves[b]
        return worn

    def fresh(self, block_ids: Sequence[int]) -> None:
        """`block_ids` were just allocated (to be computed anew): no moves yet."""
        if self.moves:
            for b in block_ids:
                self.moves.pop(b, None)

    def admitted(self, block_ids: Sequence[int], first_index: int = 0) -> None:
        """The request now holds `block_ids` as its logical blocks `first_index...` (after duplication)."""
        bs = self.block_size
        self.in_use_at.update((b, j * bs) for j, b in enumerate(block_ids, start=first_index))
