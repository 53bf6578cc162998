"""LlamaIndex adapters: spanq as a LlamaIndex LLM, span-aware response synthesizers, an order-free judge and an
offline embedding model. Needs the `llamaindex` extra: `pip install 'spanq[llamaindex]'`.

    from spanq_integrations.llamaindex import MiniLMEmbedding, SpanQueryLLM, SpanQuerySynthesizer

    llm = SpanQueryLLM()                        # the embedded span-aware engine on the default model
    index = VectorStoreIndex.from_documents(docs, embed_model=MiniLMEmbedding())
    engine = index.as_query_engine(llm=llm, response_synthesizer=SpanQuerySynthesizer(llm=llm))
    response = engine.query("…")                # response.metadata["spanq"]: cached tokens, TTFT, …
"""

from __future__ import annotations

try:
    import llama_index.core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "spanq_integrations.llamaindex needs llama-index-core: pip install 'spanq[llamaindex]'"
    ) from e

from spanq_integrations.llamaindex.corpus import corpus_texts
from spanq_integrations.llamaindex.embeddings import MiniLMEmbedding, minilm_model_path
from spanq_integrations.llamaindex.judge import SpanJudgeResult, SpanQueryPairwiseEvaluator, copied_candidate
from spanq_integrations.llamaindex.llm import SpanQueryLLM, messages_to_nodes
from spanq_integrations.llamaindex.synthesizer import NoNodesError, SpanQuerySynthesizer
from spanq_integrations.llamaindex.tree_synthesizer import SpanQueryTreeSynthesizer
from spanq_integrations.llamaindex.usage import METADATA_KEY, usage_of

__all__ = [
    "METADATA_KEY",
    "MiniLMEmbedding",
    "NoNodesError",
    "SpanJudgeResult",
    "SpanQueryLLM",
    "SpanQueryPairwiseEvaluator",
    "SpanQuerySynthesizer",
    "SpanQueryTreeSynthesizer",
    "copied_candidate",
    "corpus_texts",
    "messages_to_nodes",
    "minilm_model_path",
    "usage_of",
]
