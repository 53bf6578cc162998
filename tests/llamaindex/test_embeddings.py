"""MiniLMEmbedding: the offline embedding model shipped in a PyPI package, in a LlamaIndex index."""

from __future__ import annotations

import math

from spanq_integrations.llamaindex import MiniLMEmbedding, minilm_model_path


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_it_loads_from_the_package_with_the_hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (minilm_model_path() / "model.safetensors").is_file()
    vector = MiniLMEmbedding().get_query_embedding("Which town hall is red?")
    assert len(vector) == 384
    assert abs(math.sqrt(sum(x * x for x in vector)) - 1.0) < 1e-4  # normalized


def test_similar_texts_are_closer(embed_model):
    red, red_again, bananas = embed_model.get_text_embedding_batch(
        [
            "The town hall is painted red.",
            "The hall of the town has red paint.",
            "Bananas are a yellow fruit.",
        ]
    )
    assert cosine(red, red_again) > cosine(red, bananas) + 0.2


def test_retrieval_ranks_the_matching_document_first(town_index):
    nodes = town_index.as_retriever(similarity_top_k=2).retrieve("Which town lives from mining?")
    assert nodes[0].node.metadata["town"] == "mining"
