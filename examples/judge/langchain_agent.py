"""A LangChain agent on spanq (`langchain.agents.create_agent`): its tool retrieves documents, read as spans; N
agents answer, and a span-query judge ensemble chooses the final answer.

- The model is `ChatSpanQuery` (the embedded engine, SmolLM2 by default): it calls the `search_towns` tool
  through constrained decoding (`bind_tools`), so even a 135M model writes a well-formed call.
- The tool returns the documents it found as its artifact, as `create_retriever_tool(...,
  response_format="content_and_artifact")` does; `SpanCacheMiddleware` turns them into span blocks, so every agent
  reads them as order-free spans: only the first agent computes them; the others read them from the span cache.
- `SearchFirst`, the app's own middleware, makes the agent search before it answers (small models otherwise answer
  from memory) and answer once it has searched.
- `JudgeEnsemble` reads the N answers as a `plus` of candidates and picks one.

    .venv/bin/python examples/judge/langchain_agent.py               # embedded default model (SmolLM2)
    .venv/bin/python examples/judge/langchain_agent.py --n 2 --model tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from spanq_integrations.langchain import ChatSpanQuery, JudgeEnsemble, JudgeVerdict, SpanCacheMiddleware

DOCUMENTS = Path(__file__).parent.parent / "rag" / "documents.json"
QUESTION = "Which town can only be reached by ferry, and from where?"
SYSTEM = "You answer questions about towns. Search the town documents for what the question asks."
ANSWER = "Answer the question in one sentence, from the documents the search returned."


def load_documents() -> list[dict[str, str]]:
    return json.loads(DOCUMENTS.read_text())


class Search(BaseModel):
    query: str = Field(description="words to look for", max_length=40)  # bounded: a call always ends


@tool(args_schema=Search, response_format="content_and_artifact")
def search_towns(query: str) -> tuple[str, list[Document]]:
    """Finds documents about towns that share words with the query."""
    words = {w.strip("?.,").lower() for w in query.split() if len(w) > 3}
    docs = load_documents()
    ranked = sorted(docs, key=lambda d: (-len(words & set(d["text"].lower().split())), d["id"]))
    found = [Document(d["text"], id=d["id"]) for d in ranked[:3]]
    return "\n\n".join(d.page_content for d in found), found


class SearchFirst(AgentMiddleware):
    """Search before answering, then answer from what was found: the first model call must call a tool; after a
    search the model answers from the documents and the question alone, with no tools and no tool call in its
    prompt (a small model shown a call of its own imitates it instead of answering). The documents stay the
    span blocks `SpanCacheMiddleware` made of them."""

    def wrap_model_call(self, request, handler):
        found = [m for m in request.messages if isinstance(m, ToolMessage)]
        if not found:  # the search, greedy: every agent looks for the same documents (their answers are sampled)
            greedy = request.model.model_copy(update={"temperature": 0.0})
            return handler(request.override(model=greedy, tool_choice="any"))
        question = next(m for m in request.messages if isinstance(m, HumanMessage))
        blocks = [b for m in found for b in (m.content if isinstance(m.content, list) else [m.content])]
        ask = HumanMessage([*blocks, f"Question: {question.text}"])
        return handler(request.override(messages=[ask], tools=[], tool_choice=None, system_prompt=ANSWER))


def build_agent(llm: ChatSpanQuery):
    """The agent: `create_agent` with the search tool, the app's rule and spanq's middleware."""
    return create_agent(llm, tools=[search_towns], system_prompt=SYSTEM,
                        middleware=[SearchFirst(), SpanCacheMiddleware()])  # fmt: skip


def answer_once(llm: ChatSpanQuery, question: str, seed: int) -> dict[str, Any]:
    """One agent run. Returns its answer, whether it searched, and the span work of its model calls."""
    state = build_agent(llm.model_copy(update={"seed": seed})).invoke({"messages": [HumanMessage(question)]})
    ai = [m for m in state["messages"] if isinstance(m, AIMessage)]
    return {
        "answer": ai[-1].text if ai else "",
        "searched": [c["args"].get("query", "") for m in ai for c in m.tool_calls],
        "calls": [m.response_metadata.get("spanq", {}) for m in ai],
    }


def run(llm: ChatSpanQuery, judge_llm: ChatSpanQuery, n: int = 3, question: str = QUESTION) -> dict[str, Any]:
    """N agents answer; the judge ensemble picks one."""
    runs = [answer_once(llm, question, seed) for seed in range(n)]
    verdict: JudgeVerdict = JudgeEnsemble(llm=judge_llm).invoke(
        {"question": question, "candidates": [r["answer"] or "(no answer)" for r in runs]}
    )
    return {"runs": runs, "verdict": verdict}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, tiny-<family>, a folder or an id")
    ap.add_argument("--n", type=int, default=3, help="agents answering")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    backend = None  # the embedded engine on --model
    if args.model.startswith("tiny"):
        # A random model pads a tool call's JSON with whitespace until max_tokens: with JSON written compactly
        # (README, "Tools"), its calls are whole and its agents search
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(args.model, compact_json=True)
    llm = ChatSpanQuery(backend=backend, model=args.model, max_tokens=args.max_tokens, temperature=0.5)
    judge_llm = ChatSpanQuery(backend=backend, model=args.model, max_tokens=args.max_tokens, temperature=0)
    result = run(llm, judge_llm, n=args.n)
    verdict = result["verdict"]
    chosen = verdict.selection.index if verdict.selection else None
    for i, r in enumerate(result["runs"]):
        spans = [(c.get("spans", 0), c.get("prepared_spans", 0) + c.get("deferred_spans", 0)) for c in r["calls"]]
        mark = "*" if i == chosen else " "
        print(f"{mark} agent {i}: {r['answer'].strip()!r}  (searched: {r['searched']}; spans, computed per call: {spans})")
    print(f"\nverdict: {verdict.verdict.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
