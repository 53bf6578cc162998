"""The span-affinity policy on its own (no engine; no Ray but where a test loads a router): which replica a span
query is sent to."""

from __future__ import annotations

import importlib
import json
import random

import pytest

from spanq_backend.cluster.policy import Recent, ReplicaView, mark_failing, query_span_digests, rank_replicas
from spanq_backend.serving.lowering import span_digest
from spanq_integrations import cross, fragment, generate, plus, system, user
from spanq_integrations.query.spnl_json import to_json


def _body(*docs: str) -> bytes:
    q = generate(cross(system("s"), plus(*[fragment(d) for d in docs]), user("q")))
    return json.dumps(to_json(q)).encode()


def test_the_spans_of_a_query_are_its_plus_children_by_text_digest():
    assert query_span_digests(_body("doc a", "doc b", "doc a")) == [span_digest("doc a"), span_digest("doc b")]
    assert query_span_digests(b"{not json") == []
    assert query_span_digests(json.dumps({"g": {"model": "", "input": {"user": "hi"}}})) == []


def test_the_replica_holding_most_spans_comes_first():
    a, b, c = (span_digest(x) for x in "abc")
    replicas = [ReplicaView("r1", 0, cached={a}), ReplicaView("r2", 1, cached={b, c})]
    assert rank_replicas([a, b, c], replicas, max_imbalance=4) == [["r2"], ["r1"]]
    # what the router sent since the last report counts as held
    replicas = [ReplicaView("r1", 0, recent={a, b, c}), ReplicaView("r2", 0, cached={b})]
    assert rank_replicas([a, b, c], replicas, max_imbalance=4)[0] == ["r1"]


def test_a_hot_replica_is_passed_over():
    a = span_digest("a")
    replicas = [ReplicaView("hot", 9, cached={a}), ReplicaView("idle", 2)]
    assert rank_replicas([a], replicas, max_imbalance=4) == [["idle"], ["hot"]]
    assert rank_replicas([a], replicas, max_imbalance=7) == [["hot"], ["idle"]]


def test_queries_on_new_spans_go_where_the_same_spans_will_go_again():
    replicas = [ReplicaView(f"r{i}", 0) for i in range(4)]
    spans = [span_digest(f"doc {i}") for i in range(3)]
    first = rank_replicas(spans, replicas, 4)[0]
    assert all(rank_replicas(list(reversed(spans)), replicas, 4)[0] == first for _ in range(3))
    # and different new spans spread over the fleet
    chosen = {rank_replicas([span_digest(f"other {i}")], replicas, 4)[0][0] for i in range(40)}
    assert len(chosen) >= 3


def test_a_failing_replica_goes_last_and_no_spans_means_least_busy_first():
    a = span_digest("a")
    replicas = [ReplicaView("r1", 0, cached={a}, failing=True), ReplicaView("r2", 3)]
    assert rank_replicas([a], replicas, 4) == [["r2"], ["r1"]]
    assert rank_replicas([], [ReplicaView("r1", 5), ReplicaView("r2", 1)], 4) == [["r2"], ["r1"]]
    mark_failing("r-x", seconds=30)
    from spanq_backend.cluster.policy import is_failing

    assert is_failing("r-x") and not is_failing("r-y")


def test_default_routing_tries_a_failing_replica_last_as_affinity_does():
    """`--routing default` (Ray Serve's power of two choices) with the ingress's marks: a replica whose server died
    answers Ray's queue probe with the shortest queue, so its pick would be the dead one on every retry."""
    from spanq_backend.cluster.policy import healthy_first

    dead = {"r1"}
    failing = dead.__contains__
    rng = random.Random(0)
    # Ray's pick of two, the dead one among them: the other alone (Ray's ranks as they were, the way before, fail
    # this: the dead one is in them). Where that one is full Ray asks again, as without failures.
    assert healthy_first([["r1", "r2"]], ["r1", "r2", "r3"], failing, rng) == [["r2"]]
    # Ray's pick held only the dead one: two others instead.
    for _ in range(20):
        (first,) = healthy_first([["r1"]], ["r1", "r2", "r3"], failing, rng)
        assert sorted(first) == ["r2", "r3"]
    # None failing: Ray's own choice, unchanged; all failing: they are all there is.
    assert healthy_first([["r3", "r2"]], ["r2", "r3"], failing, rng) == [["r3", "r2"]]
    assert healthy_first([["r1"]], ["r1"], failing, rng) == [["r1"]]


def test_default_routing_runs_rays_own_router_with_the_ingress_marks():
    """`--routing default` loads, by the path Ray Serve loads it by, Ray Serve's default router with the marks."""
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install 'spanq[cluster]'")
    from ray.serve.config import RequestRouterConfig

    from spanq_backend.cluster.app import DEFAULT_ROUTER_CLASS
    from spanq_backend.cluster.routing import HealthyFirstRouter
    module, name = DEFAULT_ROUTER_CLASS.split(":")
    assert getattr(importlib.import_module(module), name) is HealthyFirstRouter
    ray_default = RequestRouterConfig().request_router_class  # what `--routing default` ran before
    module, name = ray_default.split(":")
    assert issubclass(HealthyFirstRouter, getattr(importlib.import_module(module), name))


def test_recent_sends_move_with_the_span_and_are_bounded():
    recent = Recent(limit=3)
    recent.note(["a", "b"], "r1")
    recent.note(["b", "c"], "r2")
    assert set(recent.of("r1")) == {"a"} and set(recent.of("r2")) == {"b", "c"}
    recent.note(["d"], "r1")  # "a" is the oldest: forgotten
    assert set(recent.of("r1")) == {"d"}
    recent.forget("r2")
    assert set(recent.of("r2")) == set() and list(recent.where) == ["d"]


def _simulate(choose, queries: list[list[str]], replicas: int) -> int:
    """Prepared spans over a workload, where each replica caches what it prepared (no eviction)."""
    caches = [set() for _ in range(replicas)]
    recent = Recent()
    prepared = 0
    for i, spans in enumerate(queries):
        views = [ReplicaView(f"r{k}", 0, cached=caches[k], recent=recent.of(f"r{k}")) for k in range(replicas)]
        target = int(choose(spans, views, i)[1:])
        recent.note(spans, f"r{target}")
        prepared += len(set(spans) - caches[target])
        caches[target] |= set(spans)
    return prepared


def test_affinity_prepares_each_span_once_where_round_robin_does_not():
    """The check the cluster test makes (each span prepared once across the fleet), on a model of the fleet: it
    holds for the policy and fails for round-robin routing."""
    rng = random.Random(7)
    pool = [span_digest(f"doc {i}") for i in range(6)]
    groups = [pool[:3], pool[3:]]
    queries = [rng.sample(groups[rng.randrange(2)], 3) for _ in range(24)]
    affinity = _simulate(lambda spans, views, i: rank_replicas(spans, views, 4)[0][0], queries, 2)
    round_robin = _simulate(lambda spans, views, i: f"r{i % 2}", queries, 2)
    assert affinity == len({s for q in queries for s in q})
    assert round_robin > affinity


def test_new_spans_are_placed_on_the_replica_holding_fewest_not_on_the_shorter_queue():
    """Where a query's documents first go, the next queries on them follow: placing them by a moment's queue
    length gave one replica 5 of 8 topics (more than its cache held) and the other 3 (`spanq bench cluster`)."""
    held = {span_digest(f"held {i}") for i in range(40)}
    few = {span_digest(f"few {i}") for i in range(8)}
    new = [span_digest(f"new {i}") for i in range(4)]
    replicas = [ReplicaView("full", 0, cached=held), ReplicaView("roomy", 2, recent=few)]
    assert rank_replicas(new, replicas, max_imbalance=4)[0] == ["roomy"]
    # spans a replica holds still go there, busier or not (within the bound)
    assert rank_replicas([*new, next(iter(held))], replicas, max_imbalance=4)[0] == ["full"]
    # and beyond the bound the roomy replica is passed over
    replicas = [ReplicaView("full", 0, cached=held), ReplicaView("roomy", 5, recent=few)]
    assert rank_replicas(new, replicas, max_imbalance=4)[0] == ["full"]


def test_topics_placed_while_one_replica_is_busy_end_up_split_evenly():
    """A model of the cluster benchmark's start: the replica that took the hot topic reads as busy, yet the
    other topics are spread so that each replica is sent half of them."""
    topics = [[span_digest(f"topic {t} doc {d}") for d in range(4)] for t in range(8)]
    recent = Recent()
    for t, spans in enumerate(topics):
        views = [ReplicaView(f"r{k}", (1 if t % 3 else 0) if k == 0 else 0, recent=recent.of(f"r{k}"),
                             unreported=recent.unreported_of(f"r{k}")) for k in range(2)]  # fmt: skip
        recent.note(spans, rank_replicas(spans, views, 4)[0][0])
    assert len(recent.of("r0")) == len(recent.of("r1")) == 16


def test_a_replica_restarted_empty_is_filled_to_its_peers_cache_not_to_what_its_peer_was_ever_sent():
    """A replica's footprint is what its cache holds (its report, plus sends since): not every span the router
    ever sent it. Counting those, a replica restarted empty beside one sent 5,000 spans over its life (its cache
    holds 200) took every new document, thrashing its own 200-span cache while the other's stayed as it was."""
    capacity = 200
    old_cache = [span_digest(f"old {i}") for i in range(capacity)]
    recent = Recent()
    recent.note([span_digest(f"long ago {i}") for i in range(4800)] + old_cache, "A")
    recent.reported("A")
    caches = {"A": list(old_cache), "B": []}  # B: the restarted replica (a new id, nothing cached)
    sent = {"A": 0, "B": 0}
    for t in range(150):
        spans = [span_digest(f"topic {t} doc {d}") for d in range(4)]
        views = [ReplicaView(k, 0, cached=frozenset(caches[k]), recent=recent.of(k),
                             unreported=recent.unreported_of(k)) for k in "AB"]  # fmt: skip
        target = rank_replicas(spans, views, 4)[0][0]
        recent.note(spans, target)
        caches[target] = (caches[target] + spans)[-capacity:]  # an LRU cache of `capacity` spans
        recent.reported(target)
        sent[target] += 1
    assert sent["B"] >= 50, "the empty replica is filled first"
    assert sent["A"] >= 40, f"then new documents go to both, not all to the restarted one: {sent}"


def test_a_span_the_tier_holds_costs_a_load_cheaper_than_a_miss_and_dearer_than_a_cached_span():
    """Replica A's cache holds the two documents the span tier lost (evicted), B's three the tier still holds: A
    would compute none and load six, B compute two. Counting every span not cached as a miss (a router that
    ignores the tier) sends the query to B, which computes two documents."""
    docs = [span_digest(f"doc {i}") for i in range(8)]
    tier = frozenset(docs[2:])
    replicas = [ReplicaView("A", 0, cached=set(docs[:2]), tier=tier), ReplicaView("B", 0, cached=set(docs[2:5]), tier=tier)]
    assert rank_replicas(docs, replicas, 4, tier_cost=0.1)[0] == ["A"]
    assert rank_replicas(docs, replicas, 4, tier_cost=1.0)[0] == ["B"]  # a load as dear as computing: the tier ignored
    no_tier = [ReplicaView("A", 0, cached=set(docs[:2])), ReplicaView("B", 0, cached=set(docs[2:5]))]
    assert rank_replicas(docs, no_tier, 4, tier_cost=0.1)[0] == ["B"]
    # and what a replica's cache holds stays cheaper than loading it from the tier
    both = [ReplicaView("A", 0, tier=tier), ReplicaView("B", 0, cached=set(docs[2:3]), tier=tier)]
    assert rank_replicas(docs[2:], both, 4)[0] == ["B"]


def test_a_busier_replica_is_kept_for_spans_it_would_save_computing_not_for_spans_another_loads():
    """Two requests queued on the replica whose cache holds the query's documents: worth waiting for where the
    other replica would compute them (within --max-imbalance 4), not where it would load them from the tier (0.1 of
    computing: 0.4 requests' worth). Documents half in the tier are worth 2.2 requests."""
    docs = [span_digest(f"doc {i}") for i in range(8)]

    def first(queue: int, tier: frozenset[str], tier_cost: float = 0.1) -> str:
        replicas = [ReplicaView("holder", queue, cached=set(docs), tier=tier), ReplicaView("idle", 0, tier=tier)]
        return rank_replicas(docs, replicas, 4, tier_cost)[0][0]

    everything, half = frozenset(docs), frozenset(docs[:4])
    assert first(2, frozenset()) == "holder" and first(4, frozenset()) == "holder" and first(5, frozenset()) == "idle"
    assert first(0, everything) == "holder"
    assert first(1, everything) == "idle"
    assert first(1, everything, tier_cost=1.0) == "holder"
    assert first(2, half) == "holder" and first(3, half) == "idle"


def test_the_router_pools_tier_reports_of_replicas_on_one_folder_and_forgets_a_replica_gone():
    """Each replica reports the spans it prepared that its tier holds; replicas on one folder (one `tier_id`) load
    what any of them wrote, so the router pools their reports — and only theirs."""
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install 'spanq[cluster]'")
    import asyncio

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from spanq_backend.cluster.routing import SpanAffinityRouter

    router = SpanAffinityRouter(DeploymentID(name="SpanReplica", app_name="spanq"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(max_imbalance=4, tier_cost=0.1)
    a, b, c = (span_digest(x) for x in "abc")
    reports = {"r1": {"spans": [], "tier": [a], "tier_id": "shared"}, "r2": {"spans": [], "tier": [b], "tier_id": "shared"},
               "r3": {"spans": [], "tier": [c], "tier_id": "its own"}, "r4": {"spans": [a]}}  # fmt: skip
    for rid, stats in reports.items():
        router._tier_of(rid, stats)
    assert router._tier_of("r1", reports["r1"]) == router._tier_of("r2", reports["r2"]) == {a, b}
    assert router._tier_of("r3", reports["r3"]) == {c}
    assert router._tier_of("r4", reports["r4"]) == frozenset()  # no tier

    async def only_r1_left() -> None:
        router.update_replicas([])  # (Ray's replica objects; none here: every replica is gone)
        router._tier_of("r1", reports["r1"])

    asyncio.run(only_r1_left())
    assert router._tier_of("r1", reports["r1"]) == {a}


def test_replicas_on_one_machine_get_their_own_cores(monkeypatch):
    from spanq_backend.cluster.app import split_cores

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert split_cores(2, [0, 1]) == ["0", "1"]  # not both engines on core 0 (vLLM's `auto` on this machine)
    assert split_cores(3, range(8)) == ["0-2", "3-5", "6-7"]
    assert split_cores(2, [0, 2, 3, 5]) == ["0,2", "3,5"]
    assert split_cores(4, [0, 1]) == []  # fewer cores than replicas: left to vLLM
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert split_cores(2, [0, 1]) == []  # the user's binding is kept


def test_the_ingress_reads_a_stream_request_as_the_server_does():
    """An SSE answer is relayed as it comes only if the ingress sees it is one: `?stream=` as the server's
    boolean reads it, or `"stream": true` in a JSON body however it is spaced or its content type cased."""
    from spanq_backend.cluster.app import ForwardedRequest, flag_value

    def streams(query: str = "", body: bytes = b"", content_type: str = "application/json") -> bool:
        return ForwardedRequest("POST", "/v1/chat/completions", query, content_type, body).streams

    assert all(streams(f"stream={v}") for v in ("true", "1", "yes", "on", "True", "t"))
    assert not any(streams(q) for q in ("stream=false", "stream=0", "upstream=true", ""))
    assert streams(body=b'  \n{"stream": true}', content_type="Application/JSON; charset=utf-8")
    assert not streams(body=b'{"stream": "true"}') and not streams(body=b"[1]")
    assert flag_value(["--api-key", "k", "--port", "1"], "--api-key") == "k"
    assert flag_value(["--api-key=a", "--api-key", "b"], "--api-key") == "b"
    assert flag_value(["--api-keys", "x"], "--api-key") is None


def test_the_cluster_merges_its_replicas_metrics_and_spans_without_losing_or_doubling_any():
    """`gather.py`: every replica's samples kept, labelled with the replica, each metric family said once; a text
    that is not Prometheus's named by its replica; the spans of all replicas, each once, and per replica."""
    from prometheus_client.parser import text_string_to_metric_families

    from spanq_backend.cluster.gather import merge_metrics, merge_spans

    def text(running: float, tokens: float) -> str:
        return ("# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                "# HELP vllm:prompt_tokens_total Prompt tokens.\n# TYPE vllm:prompt_tokens_total counter\n"
                f'vllm:prompt_tokens_total{{model_name="m"}} {tokens}\n'
                "# HELP t Time.\n# TYPE t histogram\n"
                f't_bucket{{le="1.0"}} {tokens}\nt_bucket{{le="+Inf"}} {tokens}\nt_count {tokens}\nt_sum 2.0\n')

    merged = merge_metrics({"SERVE_REPLICA::spanq#SpanReplica#aaa": text(1, 10), "SERVE_REPLICA::spanq#SpanReplica#bbb": text(2, 20)})
    samples = {(s.name, s.labels.get("le", ""), s.labels["replica"]): s.value
               for f in text_string_to_metric_families(merged) for s in f.samples}  # fmt: skip
    assert samples[("vllm:num_requests_running", "", "aaa")] == 1 and samples[("vllm:num_requests_running", "", "bbb")] == 2
    assert samples[("vllm:prompt_tokens_total", "", "aaa")] == 10 and samples[("vllm:prompt_tokens_total", "", "bbb")] == 20
    assert samples[("t_bucket", "+Inf", "bbb")] == 20 and len(samples) == 12
    assert merged.count("# TYPE vllm:prompt_tokens_total counter") == 1 and merged.count("# TYPE t histogram") == 1
    with pytest.raises(ValueError, match="replica bbb's /metrics is not Prometheus text"):
        merge_metrics({"x#aaa": text(1, 1), "x#bbb": "<html>oops</html>\n"})

    spans = merge_spans({"x#aaa": {"spans": ["d1", "d2"], "probe": True, "tier": ["d1"], "tier_id": "T"},
                         "x#bbb": {"spans": ["d2", "d3"], "probe": True, "tier": [], "tier_id": "T"}})  # fmt: skip
    assert spans["spans"] == ["d1", "d2", "d3"] and spans["tier"] == ["d1"] and spans["tier_id"] == "T"
    assert spans["replicas"] == {"aaa": {"spans": 2, "tier": 1, "tier_id": "T"}, "bbb": {"spans": 2, "tier": 0, "tier_id": "T"}}


_ADDRESSED_TO_A_GONE_REPLICA = """
import asyncio, sys
from types import SimpleNamespace
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from spanq_backend.cluster.app import ForwardedRequest
from spanq_backend.cluster.routing import HealthyFirstRouter, SpanAffinityRouter

cls = {"affinity": SpanAffinityRouter, "default": HealthyFirstRouter}[sys.argv[1]]
router = cls(deployment_id=DeploymentID(name="SpanReplica", app_name="spanq"),
             handle_source=DeploymentHandleSource.UNKNOWN)
here = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "x#here"))
router._replicas = {"x#here": here}
router._replicas_list = [here]

async def main():
    if cls is SpanAffinityRouter:
        router.initialize_state()
    ticks = 0

    async def other():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    beside = asyncio.create_task(other())
    for to, found in (("x#here", True), ("x#gone", False)):
        request = PendingRequest(args=[ForwardedRequest("GET", "/metrics", "", "", b"", replica=to)], kwargs={},
                                 metadata=RequestMetadata(request_id="r", internal_request_id="r"))
        choices = router._choose_replicas_with_backoff(request)
        try:
            chosen = await asyncio.wait_for(choices.__anext__(), timeout=1.0)
            assert found and chosen == [here], chosen
        except TimeoutError:
            assert not found
    beside.cancel()
    print("ticks", ticks)

asyncio.run(main())
"""


@pytest.mark.parametrize("routing", ["affinity", "default"])
def test_a_read_addressed_to_a_replica_that_is_gone_waits_without_stopping_the_router(routing):
    """The ingress asks each replica for its metrics in a request addressed to it; one that has gone since is no
    candidate: Ray's routing loop must back off and let its event loop run (it asked again at once, never
    yielding: that loop, which routes every request, spun and routed nothing more)."""
    pytest.importorskip("ray.serve", reason="the cluster extra: pip install 'spanq[cluster]'")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ADDRESSED_TO_A_GONE_REPLICA, routing], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 20, done.stdout  # the loop ran other tasks while the read waited
