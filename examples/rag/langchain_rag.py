"""A LangChain RAG app on spanq: swap the LLM, and documents retrieved in a new order come from the span cache.

Three ways in, from no change at all to a drop-in chain:
1. the RAG chain of LangChain's tutorials, unchanged but for the LLM (`ChatSpanQuery()`);
2. the same chain with `format_docs` replaced by `format_docs_as_spans` (one line; needed when your
   `format_docs` adds text between documents, such as source headers);
3. `create_span_retrieval_chain(retriever, prompt, llm)` instead of
   `create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))`.

    .venv/bin/python examples/rag/langchain_rag.py                # the embedded default model (SmolLM2)
    .venv/bin/python examples/rag/langchain_rag.py --model tiny   # a tiny random model: fast, gibberish
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
from pathlib import Path

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from spanq_integrations.langchain import ChatSpanQuery, create_span_retrieval_chain, format_docs_as_spans

HERE = Path(__file__).parent
QUESTIONS = [
    "What color is the town hall of Corrow Ridge?",
    "Which town can only be reached by ferry, and from where?",
]


class KeywordEmbeddings(Embeddings):
    """Bag-of-words vectors (hashed words, L2-normalized): enough to rank a handful of documents offline."""

    def __init__(self, size: int = 512):
        self.size = size

    def _embed(self, text: str) -> list[float]:
        vector = [0.0] * self.size
        for word in re.findall(r"[a-z]+", text.lower()):
            if len(word) > 3:
                vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % self.size] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)


def load_documents(limit: int | None = None) -> list[Document]:
    rows = json.loads((HERE / "documents.json").read_text())[:limit]
    return [Document(page_content=r["text"], id=r["id"], metadata={"source": r["id"]}) for r in rows]


PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief.\n\nContext:\n{context}"),
        ("human", "{question}"),
    ]
)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def build_retriever(docs: list[Document], k: int):
    store = InMemoryVectorStore(KeywordEmbeddings())
    store.add_documents(docs)
    return store.as_retriever(search_kwargs={"k": k})


def build_chains(llm, retriever) -> dict:
    """The same app three ways; only the marked lines differ from a LangChain app on any other LLM."""
    unchanged = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    one_line = (
        {
            "context": retriever
            | (lambda d: format_docs_as_spans(d, document_prompt="[{source}] {page_content}")),
            "question": RunnablePassthrough(),
        }
        | PROMPT
        | llm
    )
    drop_in_prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer using only this context. Be brief.\n\n{context}"), ("human", "{input}")]
    )
    drop_in = create_span_retrieval_chain(retriever, drop_in_prompt, llm)
    return {"unchanged": unchanged, "one line": one_line, "drop-in": drop_in}


def run(llm, docs: list[Document], k: int, questions: list[str] = QUESTIONS) -> list[dict]:
    """Ask every question through every chain; one row per call with the span cache's numbers."""
    retriever = build_retriever(docs, k)
    rows = []
    for name, chain in build_chains(llm, retriever).items():
        for question in questions:
            order = [d.id for d in retriever.invoke(question)]
            if name == "drop-in":
                last = LastModelCall()
                answer = chain.invoke({"input": question}, config={"callbacks": [last]})["answer"]
                meta, usage = last.response_metadata, last.usage_metadata
            else:
                message = chain.invoke(question)
                answer, meta, usage = message.content, message.response_metadata, message.usage_metadata
            rows.append(
                {
                    "chain": name,
                    "question": question,
                    "order": order,
                    "answer": answer.strip(),
                    "prompt": usage["input_tokens"],
                    "cached": usage["input_token_details"]["cache_read"],
                    "spans": meta["spanq"]["spans"],
                    "prepared": meta["spanq"]["prepared_spans"] + meta["spanq"]["deferred_spans"],  # computed now
                    "ttft_s": meta["spanq"]["ttft_s"],
                }
            )
    return rows


class LastModelCall(BaseCallbackHandler):
    """Keeps the metadata of the model's last message (the drop-in chain's answer is plain text)."""

    def __init__(self) -> None:
        self.response_metadata: dict = {}
        self.usage_metadata: dict = {}

    def on_llm_end(self, response, **kwargs) -> None:
        message = response.generations[0][0].message
        self.response_metadata, self.usage_metadata = message.response_metadata, message.usage_metadata


def print_table(rows: list[dict]) -> None:
    print(
        f"{'chain':<10} {'q':<3} {'order':<44} {'prompt':>6} {'cached':>6} {'spans':>5} {'prep':>4} {'TTFT s':>7}"
    )
    for i, r in enumerate(rows):
        ttft = f"{r['ttft_s']:.2f}" if r["ttft_s"] is not None else "-"
        print(
            f"{r['chain']:<10} {'Q' + str(i % 2 + 1):<3} {','.join(r['order'])[:44]:<44} {r['prompt']:>6} "
            f"{r['cached']:>6} {r['spans']:>5} {r['prepared']:>4} {ttft:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--documents", type=int, default=4, help="how many documents of documents.json to index")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    backend = None  # the embedded default
    if args.model != "default":
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(args.model)
    llm = ChatSpanQuery(backend=backend, max_tokens=args.max_tokens, temperature=0)  # the only change
    docs = load_documents(args.documents)
    rows = run(llm, docs, k=len(docs))
    for r in rows:
        print(f"[{r['chain']}] {r['question']}\n  -> {r['answer']}")
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
