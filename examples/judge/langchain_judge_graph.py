"""A LangGraph map-reduce with spanq: `Send` fans the question out to N generator nodes, a judge reduces.

The map step is N ordinary `ChatSpanQuery` calls (one per `Send`, each with its own seed), all reading the same
documents as spans: the first call computes them, the others reuse them. The reduce step is `JudgeEnsemble`
given the candidates: one span query with the candidates in a `plus`, tree-reduced with `--k`.

    .venv/bin/python examples/judge/langchain_judge_graph.py                # embedded default model (SmolLM2)
    .venv/bin/python examples/judge/langchain_judge_graph.py --model tiny
"""

from __future__ import annotations

import argparse
import json
import operator
from pathlib import Path
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from spanq_integrations.langchain import ChatSpanQuery, JudgeEnsemble, JudgeVerdict, format_docs_as_spans

DOCUMENTS = Path(__file__).parent.parent / "rag" / "documents.json"
QUESTION = "Which town can only be reached by ferry, and from where?"


class State(TypedDict):
    question: str
    documents: list[str]
    n: int
    candidates: Annotated[list[str], operator.add]  # the map step's outputs, gathered
    verdict: JudgeVerdict | None


class Draft(TypedDict):
    question: str
    documents: list[str]
    seed: int


def build_graph(llm: ChatSpanQuery, k: int | None = 2, temperature: float = 0.8):
    """question → N × generate (Send) → judge."""
    judge = JudgeEnsemble(llm=llm, k=k)

    def fan_out(state: State) -> list[Send]:
        return [
            Send("generate", Draft(question=state["question"], documents=state["documents"], seed=i))
            for i in range(state["n"])
        ]

    def generate(draft: Draft) -> dict:
        messages = [
            SystemMessage("Answer the question briefly, using the documents."),
            HumanMessage([*format_docs_as_spans(draft["documents"]), f"Question: {draft['question']}"]),
        ]
        answer = llm.invoke(messages, seed=draft["seed"], temperature=temperature)
        return {"candidates": [answer.text]}

    def judge_candidates(state: State) -> dict:
        return {"verdict": judge.invoke({"question": state["question"], "candidates": state["candidates"]})}

    graph = StateGraph(State)
    graph.add_node("generate", generate)
    graph.add_node("judge", judge_candidates)
    graph.add_conditional_edges(START, fan_out, ["generate"])
    graph.add_edge("generate", "judge")
    graph.add_edge("judge", END)
    return graph.compile()


def run(llm: ChatSpanQuery, n: int = 4, k: int | None = 2, documents: int = 2) -> State:
    docs = [row["text"] for row in json.loads(DOCUMENTS.read_text())[:documents]]
    return build_graph(llm, k).invoke({"question": QUESTION, "documents": docs, "n": n, "candidates": []})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--k", type=int, default=2, help="tree reduction fan-in of the judge (0: one judge)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    backend = None  # the embedded default
    if args.model != "default":
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend = EmbeddedBackend(args.model)
    state = run(ChatSpanQuery(backend=backend, max_tokens=args.max_tokens), n=args.n, k=args.k or None)
    verdict = state["verdict"]
    chosen = verdict.selection.index if verdict.selection else None
    for i, candidate in enumerate(verdict.candidates):
        print(f"{'*' if i == chosen else ' '} candidate {i}: {candidate.strip()}")
    if verdict.parsed is not None:
        print(f"\nverdict: {verdict.verdict.strip()}")
    else:  # SmolLM2-135M often cannot follow a judge's format (docs/haystack.md): say what it answered
        print(f"\nno verdict: {verdict.parse_error}")
    print(
        f"judge calls: {len(verdict.calls)}, prompt tokens the judges took from the cache: {verdict.judge_cached_tokens}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
