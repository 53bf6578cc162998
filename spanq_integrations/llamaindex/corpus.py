"""A LlamaIndex index's nodes as the texts spanq compiles into a span tier ahead of the queries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore
from llama_index.core.storage.docstore import BaseDocumentStore, SimpleDocumentStore

__all__ = ["corpus_texts"]


def corpus_texts(source: Any, metadata_mode: MetadataMode = MetadataMode.LLM) -> list[str]:
    """The texts of an index's nodes as `SpanQuerySynthesizer` sends them as spans (`node.get_content` in the same
    `metadata_mode`, the synthesizer's default `LLM`), to compile into a span tier (`SpanEngine.compile`, `spanq
    prepare`): what the tier holds is then exactly what the query engine's queries read.

    `source`: an index (its document store's nodes: a `VectorStoreIndex` over LlamaIndex's own vector store keeps
    them there), a document store, the folder an index was persisted to (`storage_context.persist(DIR)`: its
    `docstore.json`), or the nodes themselves. An index whose vector store keeps the nodes instead (it stores
    text) is named: pass its nodes. Empty nodes are left out."""
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not (folder / "docstore.json").is_file():
            raise ValueError(f"{folder} holds no docstore.json (not a folder a LlamaIndex index was persisted to)")
        source = SimpleDocumentStore.from_persist_dir(str(folder))
    if isinstance(source, BaseDocumentStore):
        nodes = list(source.docs.values())
    elif hasattr(source, "docstore") and isinstance(source.docstore, BaseDocumentStore):
        nodes = list(source.docstore.docs.values())
        if not nodes:
            raise ValueError(
                f"this {type(source).__name__}'s document store holds no nodes (its vector store keeps them): "
                "pass the nodes themselves"
            )
    else:
        nodes = [n.node if isinstance(n, NodeWithScore) else n for n in source]
    texts = []
    for node in nodes:
        if not isinstance(node, BaseNode):
            raise TypeError(f"corpus_texts takes an index, a document store or nodes, got {type(node).__name__}")
        text = node.get_content(metadata_mode=metadata_mode)
        if text.strip():
            texts.append(text)
    return texts
