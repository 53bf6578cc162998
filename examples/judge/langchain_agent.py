"""A LangGraph agent on spanq: its tool retrieves documents (returned as span blocks), N agents answer, and a
span-query judge ensemble chooses the final answer.

- The model is `ChatSpanQuery` (the embedded engine, SmolLM2 by default): it calls the `search_towns` tool
  through constrained decoding (`bind_tools`), so even a 135M model writes a well-formed call.
- The tool returns the documents it found as span blocks (`format_docs_as_spans`): every agent reads them as
  order-free spans, so only the first agent computes them; the others read them from the span cache.
- `JudgeEnsemble` reads the N answers as a `plus` of candidates and picks one.

    .venv/bin/python examples/judge/langchain_agent.py               # embedded default model (SmolLM2)
    .venv/bin/python examples/judge/langchain_agent.py --n 2 --model tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel, Field

from spanq_integrations.langchain import ChatSpanQuery, JudgeEnsemble, JudgeVerdict, format_docs_as_spans

DOCUMENTS = Path(__file__).parent.parent / "rag" / "documents.json"
QUESTION = "Which town can only be reached by ferry, and from where?"
SYSTEM = "You answer questions about towns. Search the town documents for what the question asks."
ANSWER = "Answer the question in one sentence, from the documents the search returned."


def load_documents() -> list[dict[str, str]]:
    return json.loads(DOCUMENTS.read_text())


class Search(BaseModel):
    query: str = Field(description="words to look for", max_length=40)  # bounded: a call always ends


@tool(args_schema=Search)
def search_towns(query: str) -> list[dict[str, Any]]:
    """Finds documents about towns that share words with the query."""
    words = {w.strip("?.,").lower() for w in query.split() if len(w) > 3}
    docs = load_documents()
    ranked = sorted(docs, key=lambda d: (-len(words & set(d["text"].lower().split())), d["id"]))
    return format_docs_as_spans([d["text"] for d in ranked[:3]])


def build_agent(llm: ChatSpanQuery):
    """A two-step LangGraph agent: call the search tool (a call is required: small models otherwise answer from
    memory), run it (`ToolNode`), then answer from what it returned."""
    searcher = llm.bind_tools([search_towns], tool_choice="search_towns")

    def search(state: MessagesState) -> dict:
        return {"messages": [searcher.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    def answer(state: MessagesState) -> dict:
        return {"messages": [llm.invoke([SystemMessage(ANSWER), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("search", search)
    graph.add_node("tools", ToolNode([search_towns]))
    graph.add_node("answer", answer)
    graph.add_edge(START, "search")
    graph.add_edge("search", "tools")
    graph.add_edge("tools", "answer")
    graph.add_edge("answer", END)
    return graph.compile()


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

    llm = ChatSpanQuery(model=args.model, max_tokens=args.max_tokens, temperature=0.5)
    judge_llm = ChatSpanQuery(model=args.model, max_tokens=args.max_tokens, temperature=0)
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
