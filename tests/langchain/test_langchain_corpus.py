"""A LangChain corpus compiled ahead of its queries: the texts a tier is given are the spans the chain sends."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore

from spanq_backend.serving.prepare import read_corpus
from spanq_integrations.langchain import corpus_texts, format_docs_as_spans
from tests.langchain.rag_app import town_documents

DOCUMENT_PROMPT = "[{source}] {page_content}"


@pytest.fixture
def store() -> InMemoryVectorStore:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([d.model_copy(update={"metadata": {**d.metadata, "source": f"s{i}"}})
                         for i, d in enumerate(town_documents("corpus"))])
    return store


def test_the_compiled_texts_are_the_spans_the_chain_sends_for_what_it_retrieves(store):
    retrieved = store.as_retriever(search_kwargs={"k": 2}).invoke("Which town hall is painted red?")
    sent = format_docs_as_spans(retrieved, DOCUMENT_PROMPT).texts
    compiled = corpus_texts(store, DOCUMENT_PROMPT)
    assert len(compiled) == 4 and set(sent) <= set(compiled)
    assert not set(sent) & set(corpus_texts(store)), "compiled without the chain's document prompt: never found"
    assert corpus_texts([Document(page_content="a"), "b", Document(page_content=" ")]) == ["a", "b"]


def test_spanq_prepare_reads_a_vector_store_dump_as_the_chain_sends_its_documents(store, tmp_path):
    store.dump(str(tmp_path / "store.json"))
    assert read_corpus(tmp_path / "store.json") == (corpus_texts(store), [])


def test_a_vector_store_that_cannot_list_its_documents_is_named():
    class Listless(VectorStore):
        def add_texts(self, texts, metadatas=None, **kwargs):
            return []

        def similarity_search(self, query, k=4, **kwargs):
            return []

        @classmethod
        def from_texts(cls, texts, embedding, metadatas=None, **kwargs):
            return cls()

    with pytest.raises(TypeError, match="Listless cannot list its documents"):
        corpus_texts(Listless())
