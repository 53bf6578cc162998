"""Span-affinity routing on Ray Serve: `SpanAffinityRouter` is a Ray Serve request router (the
`ray.serve.request_router.RequestRouter` hook) that ranks a deployment's replicas with `policy.rank_replicas`.

Ray gives it the live replicas, their queue lengths (from its cache, or probed as its own routers do) and the
routing stats each replica reports (`SpanReplica.record_routing_stats`: the digests of the spans its engine still
holds, read from vLLM's KV cache events, every `request_routing_stats_period_s`). Between two reports the router
also remembers where it sent each span itself, so a burst of queries on new documents does not spread them over
the fleet before the first report arrives. A replica the ingress saw fail is tried last until Ray's health check
decides about it; one Ray reports dead is forgotten.

`HealthyFirstRouter` is Ray Serve's own router (power of two choices on queue length: `--routing default`, the
baseline of `spanq bench cluster`) with the same rule for failing replicas (`policy.healthy_first`).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

from ray.serve._private.request_router import (
    PowerOfTwoChoicesRequestRouter,  # `RequestRouterConfig`'s default
)
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from spanq_backend.cluster.policy import (
    TIER_COST,
    UNKNOWN_QUEUE,
    Recent,
    ReplicaView,
    addressed_to,
    healthy_first,
    is_failing,
    query_span_digests,
    rank_replicas,
    replica_died,
    replicas_running,
)

__all__ = ["HealthyFirstRouter", "SpanAffinityRouter"]


class SpanAffinityRouter(RequestRouter):
    """Ray Serve's request router for `SpanReplica`s: span affinity balanced against queue length."""

    def initialize_state(self, max_imbalance: int = 4, tier_cost: float = TIER_COST, **_: Any) -> None:
        self.max_imbalance = int(max_imbalance)
        self.tier_cost = float(tier_cost)
        self.recent = Recent()
        self._reports: dict[str, tuple[Any, AbstractSet[str]]] = {}
        # Span tiers: per replica, its last report of what its tier holds (the report's list, the tier's folder id,
        # the list as a set); per folder, what its replicas reported, pooled (each knows only what it prepared, and
        # any replica on the folder loads any of it).
        self._tier_reports: dict[str, tuple[Any, str | None, AbstractSet[str]]] = {}
        self._tiers: dict[str, AbstractSet[str]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (addressed := _addressed(candidate_replicas, pending_request)) is not None:
            return addressed
        spans = self._spans_of(pending_request)
        queues = await self._queue_lens(candidate_replicas)
        views = []
        by_id = {}
        for r in candidate_replicas:
            rid = r.replica_id.to_full_id_str()
            by_id[rid] = r
            stats = r.routing_stats or {}
            views.append(
                ReplicaView(
                    id=rid,
                    queue_len=queues.get(rid, UNKNOWN_QUEUE),
                    cached=self._reported(rid, stats),
                    recent=self.recent.of(rid),
                    unreported=self.recent.unreported_of(rid),
                    failing=is_failing(rid),
                    tier=self._tier_of(rid, stats),
                )
            )
        ranked = rank_replicas(spans, views, self.max_imbalance, self.tier_cost)
        if spans and ranked:
            # Where it will most likely go; `on_request_routed` corrects it where Ray sends it elsewhere (the
            # first is full), so that the next query on these spans follows them.
            self.recent.note(spans, ranked[0][0])
        return [[by_id[i] for i in rank] for rank in ranked]

    @staticmethod
    def _spans_of(pending_request: PendingRequest | None) -> list[str]:
        """The span digests of the request's query, computed once per request (Ray asks again on each try)."""
        if pending_request is None:
            return []
        for arg in pending_request.args:
            body = getattr(arg, "span_body", None)
            if body is not None:
                if getattr(arg, "digests", None) is None:
                    arg.digests = query_span_digests(body)
                return arg.digests
        return []

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        spans = self._spans_of(pending_request)
        rid = replica_id.to_full_id_str()
        if spans and any(self.recent.where.get(s) != rid for s in spans):
            self.recent.note(spans, rid)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's set of running replicas: what the router kept about replicas no longer in it (replaced after a
        failed health check, scaled down) goes."""
        super().update_replicas(replicas)
        live = {r.replica_id.to_full_id_str() for r in replicas}
        for gone in [rid for rid in self._reports if rid not in live]:
            del self._reports[gone]
        for gone in [rid for rid in self._tier_reports if rid not in live]:
            self._pool(self._tier_reports.pop(gone)[1])
        for gone in [rid for rid in self.recent.by_replica if rid not in live]:
            self.recent.forget(gone)
        replicas_running(live)

    def _reported(self, replica_id: str, stats: dict[str, Any]) -> AbstractSet[str]:
        """The replica's reported spans as a set, converted once per report."""
        spans = stats.get("spans") or ()
        seen = self._reports.get(replica_id)
        if seen is None or seen[0] is not spans:
            seen = self._reports[replica_id] = (spans, frozenset(spans))
            if stats:  # a new report: the sends before it are in it, or gone
                self.recent.reported(replica_id)
        return seen[1]

    def _tier_of(self, replica_id: str, stats: dict[str, Any]) -> AbstractSet[str]:
        """The spans the replica's span tier holds, as all replicas on its folder reported them (pooled once per
        report); empty for a replica without a tier."""
        spans, tier_id = stats.get("tier") or (), stats.get("tier_id")
        seen = self._tier_reports.get(replica_id)
        if seen is None or seen[0] is not spans or seen[1] != tier_id:
            self._tier_reports[replica_id] = (spans, tier_id, frozenset(spans))
            self._pool(tier_id)
            if seen is not None and seen[1] != tier_id:
                self._pool(seen[1])
        return self._tiers.get(tier_id, frozenset()) if tier_id else frozenset()

    def _pool(self, tier_id: str | None) -> None:
        if tier_id:
            self._tiers[tier_id] = frozenset().union(*(held for _, tid, held in self._tier_reports.values()
                                                       if tid == tier_id))

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Each replica's queue length: from Ray's cache where it has one, else probed (as Ray's own
        routers do); a replica that does not answer is left out (ranked as if busiest)."""
        queues: dict[str, int] = {}
        missing = []
        for r in replicas:
            known = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if known is None:
                missing.append(r)
            else:
                queues[r.replica_id.to_full_id_str()] = int(known)
        if missing:
            for r, known in await self._probe_queue_lens(missing, 0):
                if known is not None:
                    queues[r.replica_id.to_full_id_str()] = int(known)
        return queues

    def on_replica_actor_died(self, replica_id: Any) -> None:
        self.recent.forget(replica_id.to_full_id_str())
        replica_died(replica_id.to_full_id_str())
        super().on_replica_actor_died(replica_id)


def _addressed(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """A request addressed to one replica (the ingress's reads of every replica) goes to it alone; while it is not
    a candidate, Ray backs off and asks again (the ingress bounds the wait). Without the backoff flag Ray asks again
    at once, without yielding: the router's loop spun and routed nothing more. None for any other request."""
    if pending_request is None or (rid := addressed_to(pending_request.args)) is None:
        return None
    chosen = [r for r in candidates if r.replica_id.to_full_id_str() == rid]
    if not chosen:
        pending_request.routing_context.should_backoff = True
    return [chosen] if chosen else []


def _failing(replica: RunningReplica) -> bool:
    return is_failing(replica.replica_id.to_full_id_str())


class HealthyFirstRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default request router, with the replicas the ingress saw fail tried last (`healthy_first`)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (addressed := _addressed(candidate_replicas, pending_request)) is not None:
            return addressed
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        return healthy_first(ranks, candidate_replicas, _failing)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        replicas_running({r.replica_id.to_full_id_str() for r in replicas})

    def on_replica_actor_died(self, replica_id: Any) -> None:
        replica_died(replica_id.to_full_id_str())
        super().on_replica_actor_died(replica_id)
