"""The span-affinity policy, without Ray: send a span query to the replica whose KV cache holds most of its
spans, unless that replica is much busier than the least busy one (`rank_replicas`, a pure function).
`routing.SpanAffinityRouter` runs it inside Ray Serve's request router.

Cost: per replica, one set of span digests (24 hex characters each) as large as the spans its cache holds; per
routed query, one pass over its spans per candidate replica.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar

from spanq_backend.serving.cluster_options import TIER_COST
from spanq_backend.serving.lowering import span_digest

UNKNOWN_QUEUE = 1 << 20  # a replica whose queue length could not be read: ranked last

__all__ = [
    "TIER_COST", "Recent", "ReplicaView", "addressed_to", "footprint", "healthy_first", "is_failing", "mark_failing",
    "query_span_digests", "rank_replicas", "replica_died", "replicas_running", "running_replicas",
]


@dataclass
class ReplicaView:
    """What the policy knows of one replica."""

    id: str
    queue_len: int
    cached: AbstractSet[str] = frozenset()  # span digests its engine reported as held
    recent: AbstractSet[str] = frozenset()  # span digests this router sent it (its placements, evicted ones too)
    unreported: AbstractSet[str] = frozenset()  # of those, sent since its last report (not in `cached` yet)
    tier: AbstractSet[str] = frozenset()  # span digests its span tier holds (loaded, not computed, where not cached)
    failing: bool = False  # it just failed a request: tried last until Ray's health check decides
    extra: dict[str, Any] = field(default_factory=dict)


# Replicas that failed a request, by full id, until a monotonic time. The ingress (`app.SpanIngress`) marks them;
# the router of its deployment handle runs in the same process and reads them.
_FAILING: dict[str, float] = {}
FAILING_FOR_S = 30.0


def mark_failing(replica_id: str, seconds: float = FAILING_FOR_S) -> None:
    _FAILING[replica_id] = time.monotonic() + seconds


def is_failing(replica_id: str) -> bool:
    until = _FAILING.get(replica_id)
    if until is None:
        return False
    if until < time.monotonic():
        _FAILING.pop(replica_id, None)
        return False
    return True


# The replicas Ray runs, by full id, as its routers last heard (the ingress asks each of them for the cluster's
# /metrics and /v1/spans: `gather.py`).
_RUNNING: frozenset[str] = frozenset()


def replicas_running(live: AbstractSet[str]) -> None:
    """Ray's set of running replicas, as a router heard it: kept for the ingress (replaced whole: the ingress reads
    it from another thread); the failure marks of replicas that are gone (Ray replaced them: new ids) dropped."""
    global _RUNNING
    _RUNNING = frozenset(live)
    for rid in [r for r in list(_FAILING) if r not in live]:  # (list(): the ingress may mark one meanwhile)
        _FAILING.pop(rid, None)


def running_replicas() -> list[str]:
    return sorted(_RUNNING)


def replica_died(replica_id: str) -> None:
    """A replica whose actor died, before Ray's next set of running replicas says so: not asked any more."""
    global _RUNNING
    _RUNNING = _RUNNING - {replica_id}


def addressed_to(args: Sequence[Any]) -> str | None:
    """The replica a request is addressed to (`ForwardedRequest.replica`: one of the ingress's reads of every
    replica), or None: routed as the router sees fit."""
    for arg in args:
        replica = getattr(arg, "replica", None)
        if isinstance(replica, str):
            return replica
    return None


R = TypeVar("R")


def healthy_first(
    ranks: list[list[R]], candidates: Sequence[R], failing: Callable[[R], bool], rng: random.Random | None = None
) -> list[list[R]]:
    """Another router's ranks (Ray Serve's power of two choices, `--routing default`) without the replicas the
    ingress saw fail, while any other is left: the choice among the others is that router's; where it chose only
    failing ones, two others at random (its own rule) instead. Where the ones kept are all full, Ray backs off and
    asks again (a new pick), as it does without failures: not the failing one. Unchanged where none is failing;
    where all are, the failing ones. A replica whose server died answers Ray's queue probe from its actor, with
    the shortest queue: without this the ingress's retries could go to it every time."""
    if not any(failing(c) for c in candidates):
        return ranks
    healthy = [c for c in candidates if not failing(c)]
    if not healthy:
        return [list(candidates)]
    kept = [rank for rank in ([r for r in rank if not failing(r)] for rank in ranks) if rank]
    return kept or [(rng or random).sample(healthy, min(2, len(healthy)))]


def _rendezvous(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}|{replica_id}".encode()).digest()[:8], "big")


def footprint(r: ReplicaView) -> int:
    """About how many spans a replica's cache holds: its last report, plus what this router sent it since that
    the report does not hold. Not everything ever sent there: a replica that restarted empty (a new id) next to
    one that was sent 5,000 spans over its life, of which its cache holds 200, would take every new document
    until it held 5,000 — thrashing its cache while the other's idles. O(spans sent since the report)."""
    return len(r.cached) + sum(1 for s in r.unreported if s not in r.cached)


def rank_replicas(
    spans: Sequence[str], replicas: Sequence[ReplicaView], max_imbalance: int, tier_cost: float = TIER_COST
) -> list[list[str]]:
    """Replica ids, best first: each replica in a rank of its own.

    Replicas marked failing go last. Among the others, those whose queue is at most `max_imbalance` longer than the
    shortest, the one that would compute least of `spans` comes first: a span its cache holds (or was recently sent)
    costs nothing, one its span tier holds `tier_cost`, any other 1 (without tiers: the one holding most of them).
    Ties go to the shorter queue, then to the replica a hash of the query's spans picks (rendezvous hashing), so a
    query on new documents goes where the next query on the same documents will go too. Busier replicas follow,
    least busy first; with no spans, least busy first.

    `max_imbalance` is what computing the spans a replica holds is worth in queued requests. A span the tiers hold
    is worth only loading it elsewhere, so a replica whose held spans are all in the tiers is preferred only while
    its queue is at most `tier_cost * max_imbalance` longer than the shortest (in proportion where some are): the
    query goes to a less busy replica that loads them, rather than wait behind a queue to save a load.

    A query none of whose spans any eligible replica holds places them for good (the next queries on them follow
    them there): it goes to the replica holding the fewest spans in all (`footprint`), then to the shorter queue.
    A queue length is a moment's; where documents are placed decides what each cache must hold from then on, so
    placing them by queue length alone gave one replica 5 of 8 topics, more than its cache held, and the other 3
    (`spanq bench cluster`: 125 spans prepared for 64 documents; 70 placing by footprint).
    """
    if not replicas:
        return []
    healthy = [r for r in replicas if not r.failing] or list(replicas)
    shortest = min(r.queue_len for r in healthy)
    wanted = set(spans)
    key = "\n".join(sorted(wanted))

    held: dict[str, int] = {}  # per replica: how many of the spans it holds
    cost: dict[str, float] = {}  # of getting the spans' KV there: computing and loading
    allowed: dict[str, float] = {}  # how much longer its queue may be than the shortest: what its spans save
    for r in healthy:
        held_in_tier = held_not = load = compute = 0  # (counts: equal costs compare equal)
        for s in wanted:
            in_tier = s in r.tier
            if s in r.cached or s in r.recent:
                held_in_tier, held_not = held_in_tier + in_tier, held_not + (not in_tier)
            else:
                load, compute = load + in_tier, compute + (not in_tier)
        n = held_in_tier + held_not
        held[r.id], cost[r.id] = n, compute + tier_cost * load
        allowed[r.id] = max_imbalance * (held_not + tier_cost * held_in_tier) / n if n else max_imbalance

    eligible = [r for r in healthy if r.queue_len - shortest <= allowed[r.id]] if wanted else []
    placing = not any(held[r.id] for r in eligible)  # new spans: balance what the caches hold, not the queues
    eligible.sort(key=lambda r: (cost[r.id], footprint(r) if placing else 0, r.queue_len, -_rendezvous(key, r.id)))
    chosen = {r.id for r in eligible}
    rest = sorted((r for r in replicas if r.id not in chosen), key=lambda r: (r.failing, r.queue_len, r.id))
    return [[r.id] for r in (*eligible, *rest)]


def query_span_digests(body: bytes | str) -> list[str]:
    """The digests of the spans a span query's body asks for (the children of its `plus` groups, as the server
    lowers them); empty for a body that is not a span query (the server will say what is wrong with it)."""
    from spanq_integrations.query.errors import SpanQueryError
    from spanq_integrations.query.flatten import block_text
    from spanq_integrations.query.ir import Plus, walk
    from spanq_integrations.query.spnl_json import from_json

    try:
        query = from_json(json.loads(body))
    except (ValueError, SpanQueryError, RecursionError):
        return []
    digests: list[str] = []
    for _, node in walk(query):
        if isinstance(node, Plus):
            for child in node.children:
                try:
                    text = block_text(child)
                except SpanQueryError:
                    continue
                if text:
                    digests.append(span_digest(text))
    return list(dict.fromkeys(digests))


class Recent:
    """Span digest -> the replica this router last sent it to (bounded; oldest forgotten first)."""

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self.where: OrderedDict[str, str] = OrderedDict()
        self.by_replica: dict[str, set[str]] = {}
        self.unreported: dict[str, set[str]] = {}  # per replica: sent since its last report (`reported`)

    def note(self, spans: Iterable[str], replica_id: str) -> None:
        for s in spans:
            before = self.where.get(s)
            if before is not None and before != replica_id:
                self.by_replica[before].discard(s)
                self.unreported.get(before, set()).discard(s)
            self.where[s] = replica_id
            self.where.move_to_end(s)
            self.by_replica.setdefault(replica_id, set()).add(s)
            self.unreported.setdefault(replica_id, set()).add(s)
        while len(self.where) > self.limit:
            s, replica = self.where.popitem(last=False)
            self.by_replica[replica].discard(s)
            self.unreported.get(replica, set()).discard(s)

    def reported(self, replica_id: str) -> None:
        """A new report from the replica: what was sent before it is in it, or was evicted."""
        self.unreported.pop(replica_id, None)

    def of(self, replica_id: str) -> AbstractSet[str]:
        return self.by_replica.get(replica_id, frozenset())

    def unreported_of(self, replica_id: str) -> AbstractSet[str]:
        return self.unreported.get(replica_id, frozenset())

    def forget(self, replica_id: str) -> None:
        for s in self.by_replica.pop(replica_id, set()):
            self.where.pop(s, None)
        self.unreported.pop(replica_id, None)
