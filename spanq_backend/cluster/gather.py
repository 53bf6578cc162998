"""A cluster's reads that speak for every replica, not the one a request reaches: `GET /metrics` (each replica's
samples, labelled with the replica) and `GET /v1/spans` (the spans the replicas hold, together and each).
Pure functions over the replicas' answers; the ingress (`app.SpanIngress`) asks each replica and merges here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GATHERED = frozenset({"metrics", "v1/spans"})  # GET routes the ingress answers from every replica
REPLICA_LABEL = "replica"


def short_id(replica_id: str) -> str:
    """A replica's name in labels and reports: the last part of Ray Serve's full id (`...#SpanReplica#abc123`)."""
    return replica_id.rpartition("#")[2] or replica_id


def merge_metrics(texts: Mapping[str, str]) -> str:
    """One Prometheus text exposition of several replicas' (by replica id): each sample labelled with its replica
    (`replica="abc123"`), each metric family once; a `ValueError` naming a replica whose text does not parse."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for replica, text in texts.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            raise ValueError(f"replica {short_id(replica)}'s /metrics is not Prometheus text: {e}") from e
        label = {REPLICA_LABEL: short_id(replica)}
        for family in parsed:
            samples = [s._replace(labels={**s.labels, **label}) for s in family.samples]
            if family.name in families:
                families[family.name].samples.extend(samples)
            else:
                family.samples = samples
                families[family.name] = family

    class _Gathered:
        def collect(self) -> Any:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Gathered())  # type: ignore[arg-type]
    return generate_latest(registry).decode("utf-8")


def merge_spans(answers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The cluster's `GET /v1/spans`: the spans any replica holds (`spans`; `tier`: those any replica's tier holds),
    each once, and per replica what it holds (`replicas`: counts and its tier's folder id)."""
    spans: dict[str, None] = {}
    tier: dict[str, None] = {}
    replicas = {}
    for replica, answer in answers.items():
        own, own_tier = list(answer.get("spans") or ()), list(answer.get("tier") or ())
        spans.update(dict.fromkeys(own))
        tier.update(dict.fromkeys(own_tier))
        replicas[short_id(replica)] = {"spans": len(own), "tier": len(own_tier), "tier_id": answer.get("tier_id")}
    tier_ids = {r["tier_id"] for r in replicas.values()}
    return {
        "spans": list(spans),
        "probe": all(a.get("probe", False) for a in answers.values()) if answers else False,
        "tier": list(tier),
        "tier_id": next(iter(tier_ids)) if len(tier_ids) == 1 else None,
        "replicas": replicas,
    }
