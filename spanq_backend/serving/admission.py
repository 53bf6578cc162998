"""The one admission step for an engine, before vLLM starts: the model a user named, resolved to a folder; an
architecture vLLM runs; spans possible on it (where asked for); and the KV-cache flag spans need. `SpanEngine`
(embedded) and `spanq serve` both admit a model here, so a model refused by one is refused by the other, in the
same words. What only the loaded model can say (its RoPE tables, its cache layout, a sliding window shorter than
the context) is checked at start-up by the workers (`vllm_integration.worker`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Admitted", "admit"]


@dataclass(frozen=True)
class Admitted:
    """A model admitted: its folder, and the hybrid KV-cache manager setting it needs (True: off, so that
    sliding-window layers share the KV cache group spans are moved in; None: vLLM's own choice)."""

    path: Path
    disable_hybrid_kv_cache_manager: bool | None


def admit(spec: str | Path, *, spans: bool = True) -> Admitted:
    """Admit the model `spec` names (`default`, `tiny`, a folder, a Hugging Face id) for an engine with or without
    spans. Raises `models.ModelNotFoundError` (nothing by that name), `families.UnsupportedModelError` (an
    architecture vLLM does not run) or, with `spans`, `RelocationError` (a family or RoPE spans are refused on)."""
    from spanq_backend.serving.families import check_loadable, check_spans
    from spanq_backend.serving.models import resolve_model
    from spanq_backend.vllm_integration.kv_layout import has_sliding_window_layers

    path = resolve_model(str(spec))
    check_loadable(path)
    if spans:
        check_spans(path)
    return Admitted(path, True if spans and has_sliding_window_layers(path) else None)
