"""spanq's span counters in vLLM's Prometheus registry: served on `spanq serve`'s `/metrics` beside vLLM's own,
and readable in process (`snapshot()`).

| metric (all counters)                    | what it counts                                                        |
|------------------------------------------|-----------------------------------------------------------------------|
| `spanq_span_calls_total`                 | calls laid out with a span table                                      |
| `spanq_spans_prepared_total`             | spans whose KV a call had to compute (sealed generated outputs too)   |
| `spanq_spans_hit_total`                  | spans a call found in the cache                                       |
| `spanq_prepared_tokens_total`            | tokens computed to prepare spans                                      |
| `spanq_padding_tokens_total`             | padding tokens laid out so spans start on a KV block                  |
| `spanq_prepare_requests_saved_total`     | prepare requests skipped because the cache probe saw the span cached  |
| `spanq_deferred_spans_total`             | cold spans a call computed in context, to be prepared alone when idle  |
| `spanq_in_context_calls_total`           | calls that read cached documents as the stock prompt (no span read)   |
| `spanq_blocks_relocated_total`           | KV blocks whose keys were moved to a new position (ReRoPE)            |
| `spanq_span_duplicates_total`            | private block copies made for concurrent readers (CIDRA)              |
| `spanq_span_worn_blocks_total`           | span blocks let go after 8 in-place moves in a cache below float32    |
| `spanq_relocation_seconds_total`         | host time spent moving keys (on a GPU: launching the moves)           |
| `spanq_tier_loaded_blocks_total`, `spanq_tier_saved_blocks_total`, `spanq_tier_failed_loads_total`, `spanq_tier_failed_saves_total`, `spanq_tier_evicted_blocks_total`, `spanq_tier_bytes_read_total`, `spanq_tier_bytes_written_total` | an engine with a span tier: blocks loaded instead of computed, written, refused, not written, evicted; bytes |
| `spanq_tier_blocks` (a gauge)            | the blocks its span tier holds                                        |

The first eight are counted where prompts are laid out (the process of `spanq serve`'s API server, or of an
embedded engine). The others are counted by the engine core and its workers (the tier's only on an engine with one): read directly when they run
in this process (an embedded engine), and through vLLM's `collective_rpc` after each query otherwise (`spanq
serve`, whose engine core runs in a process of its own): a scrape shows them as of the last finished query.
Before any engine has reported them they are absent, rather than a wrong zero.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "LayoutCounters",
    "count_call",
    "count_prepared",
    "count_saved_prepare",
    "register",
    "set_engine_stats",
    "snapshot",
]


@dataclass
class LayoutCounters:
    span_calls: int = 0
    spans_prepared: int = 0
    spans_hit: int = 0
    prepared_tokens: int = 0
    padding_tokens: int = 0
    prepare_requests_saved: int = 0
    deferred_spans: int = 0
    in_context_calls: int = 0


_counters = LayoutCounters()
_lock = threading.Lock()  # the counters
_register_lock = threading.Lock()  # registration (the registry reads the collector while registering it)
_registered = False

_HELP = {
    "span_calls": "Calls laid out with a span table.",
    "spans_prepared": "Spans whose KV a call had to compute (sealed generated outputs included).",
    "spans_hit": "Spans a call found in the KV cache.",
    "prepared_tokens": "Tokens computed to prepare spans.",
    "padding_tokens": "Padding tokens laid out so that spans start on a KV block.",
    "prepare_requests_saved": "Prepare requests skipped because the cache probe saw the span cached.",
    "deferred_spans": "Cold spans a call computed in context, prepared alone later when the engine was idle.",
    "in_context_calls": "Calls that read cached documents as the stock prompt: in context again, in an order the cache "
    "holds, or small documents cached as spans whose span layout would compute nearly as much (no span read, none "
    "counted as hit).",
}
_WORKER_HELP = {
    "blocks_relocated": ("moved_blocks", "KV blocks whose keys were moved to a new position (ReRoPE)."),
    "span_duplicates": ("duplicates", "Private block copies made for concurrent readers (CIDRA)."),
    "span_worn_blocks": ("worn_blocks", ("Span blocks dropped from the prefix cache after 8 in-place moves in a KV "
                                         "cache below float32 (each rounds the keys once more); prepared again.")),
    "relocation_seconds": ("relocation_seconds", "Host time spent moving keys (on a GPU: launching the moves)."),
    "tier_loaded_blocks": ("tier_loaded_blocks", "KV blocks loaded from the span tier instead of computed."),
    "tier_saved_blocks": ("tier_saved_blocks", "KV blocks of prepared spans written to the span tier."),
    "tier_failed_loads": ("tier_failed_loads", "Span tier blocks refused (checksum, header, read error); computed instead."),
    "tier_failed_saves": ("tier_failed_saves", "Span tier blocks that could not be written (a full or read-only disk, or more waiting for a slow one than the writer holds)."),
    "tier_evicted_blocks": ("tier_evicted_blocks", "Span tier blocks removed to keep it under its capacity (least recently used first)."),
    "tier_bytes_read": ("tier_bytes_read", "Bytes of span tier blocks read."),
    "tier_bytes_written": ("tier_bytes_written", "Bytes of span tier blocks written."),
}
_TIER_GAUGE = ("tier_blocks", "KV blocks the span tier holds (as this engine last read its folder and wrote to it).")


def count_call(
    *, spans: int, prepared: int, prepared_tokens: int, padding_tokens: int, deferred: int = 0,
    in_context: bool = False,
) -> None:
    """Count one call: `spans` it read, `prepared` of them it computed alone first and `deferred` cold ones it
    computed in context (prepared alone later: `count_prepared`); the rest were hits. A call that read cached
    documents `in_context`, as the stock prompt, read no span (again in an order the prefix cache holds, or small
    documents whose span layout would compute nearly as much): it is counted as such, its cold spans as deferred,
    and no hit."""
    with _lock:
        if in_context:
            _counters.in_context_calls += 1
        elif spans:
            _counters.span_calls += 1
            _counters.spans_hit += max(0, spans - prepared - deferred)
        _counters.spans_prepared += prepared
        _counters.prepared_tokens += prepared_tokens
        _counters.padding_tokens += padding_tokens
        _counters.deferred_spans += deferred


def count_prepared(spans: int, tokens: int) -> None:
    """Count spans prepared alone off every call's path (deferred prepares, when the engine was idle)."""
    with _lock:
        _counters.spans_prepared += spans
        _counters.prepared_tokens += tokens


def count_saved_prepare() -> None:
    with _lock:
        _counters.prepare_requests_saved += 1


_engine_stats: dict[str, float] | None = None  # the last counters read from an engine in other processes


def set_engine_stats(per_worker: list[dict[str, Any]]) -> None:
    """Counters read from the workers of an engine that runs in other processes (`spanq serve` reads them
    through `collective_rpc` after each query): summed over the workers."""
    global _engine_stats
    keys = ("runtimes", "moved_blocks", "duplicates", "worn_blocks", "relocation_seconds", *(k for k, _ in _WORKER_HELP.values()
                                                                             if k.startswith("tier_")), _TIER_GAUGE[0])
    with _lock:  # a counter no worker reports (the tier's, without one) stays absent
        _engine_stats = {k: sum(float(w.get(k, 0)) for w in per_worker) for k in keys if any(k in w for w in per_worker)}


def _worker_stats() -> dict[str, float] | None:
    """The engine-side counters: of this process when a span runtime runs here, else the last ones read from
    the engine's processes, else None."""
    from spanq_backend import vllm_integration

    stats = vllm_integration.stats()
    if stats.get("runtimes", 0):
        return stats
    with _lock:
        return _engine_stats if _engine_stats and _engine_stats.get("runtimes") else None


def snapshot() -> dict[str, Any]:
    """Every counter of this process by name (the engine-side ones when the engine runs here)."""
    with _lock:
        out: dict[str, Any] = asdict(_counters)
    worker = _worker_stats()
    if worker is not None:
        out.update({name: worker[key] for name, (key, _) in _WORKER_HELP.items() if key in worker})
        if _TIER_GAUGE[0] in worker:
            out[_TIER_GAUGE[0]] = worker[_TIER_GAUGE[0]]
    return out


class _SpanCollector:
    """A Prometheus collector read at scrape time (one per process, in vLLM's default registry)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        values = snapshot()
        for name, text in _HELP.items():
            yield CounterMetricFamily(f"spanq_{name}", text, value=values[name])
        for name, (_, text) in _WORKER_HELP.items():
            if name in values:
                yield CounterMetricFamily(f"spanq_{name}", text, value=values[name])
        if _TIER_GAUGE[0] in values:
            from prometheus_client.core import GaugeMetricFamily

            yield GaugeMetricFamily(f"spanq_{_TIER_GAUGE[0]}", _TIER_GAUGE[1], value=values[_TIER_GAUGE[0]])


def register() -> None:
    """Add spanq's collector to vLLM's registry (prometheus_client's default one), once per process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        from prometheus_client import REGISTRY

        REGISTRY.register(_SpanCollector())  # type: ignore[arg-type]
        _registered = True
