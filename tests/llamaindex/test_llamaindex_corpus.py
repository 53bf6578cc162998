"""A LlamaIndex index compiled ahead of its queries: the texts a tier is given are the spans the synthesizer sends."""

from __future__ import annotations

import pytest
from llama_index.core.schema import MetadataMode, TextNode

from spanq_backend.serving.prepare import read_corpus
from spanq_integrations.llamaindex import SpanQueryLLM, SpanQuerySynthesizer, corpus_texts


def test_the_compiled_texts_are_the_spans_the_synthesizer_sends_for_what_it_retrieves(town_index, tmp_path):
    synthesizer = SpanQuerySynthesizer(llm=SpanQueryLLM(backend="http://127.0.0.1:9"))  # never called
    nodes = town_index.as_retriever(similarity_top_k=2).retrieve("Which town hall is painted red?")
    sent = [f.text for f in synthesizer.node_fragments(nodes)]
    compiled = corpus_texts(town_index)
    assert len(compiled) == 4 and set(sent) <= set(compiled)
    assert not set(sent) & set(corpus_texts(town_index, MetadataMode.NONE)), "another metadata mode: never found"
    town_index.storage_context.persist(str(tmp_path / "index"))
    assert corpus_texts(tmp_path / "index") == compiled, "read back from the folder it was persisted to"
    assert read_corpus(tmp_path / "index") == (compiled, []), "what spanq prepare reads from that folder"
    assert corpus_texts([TextNode(text="a"), TextNode(text=" ")]) == ["a"]


def test_what_is_not_an_index_or_nodes_is_named(tmp_path):
    with pytest.raises(ValueError, match="no docstore.json"):
        corpus_texts(tmp_path)
    with pytest.raises(TypeError, match="got str"):
        corpus_texts(["text"])
