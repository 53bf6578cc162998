"""The main job: a RAG query on the embedded default model (SmolLM2-135M-Instruct), showing the span cache.

Three questions: two over the same eight documents, retrieved in different orders, and one over five of them. With
spans, each document is a commutative span. The first question's documents are new and small (about 600 tokens in
all), so by default the span engine reads them in context as stock does (the same answer at the same speed) and then computes each
document's KV once, on its own (after the template's opening and a neutral lead-in), while it is idle. The second
question finds the documents cached both ways: in context, in Q1's order (a `plus` is order-free), and as spans;
it reads them in context (no dearer here), so its answer is full attention's, stock's over that order (with
`read_in_context=False`, as spans moved to the new order). The third reads five of the documents in another order:
not cached so in context. As spans it would read them at their new positions, but these documents are small (two
blocks and a bit each), and the default recompute computes most of their blocks in context again: the stock prompt
computes nearly as much (`SpanGenerator.as_stock`), so it is read so, with stock's answer (with `recompute=0`, as
spans). The same queries run on a stock vLLM engine (prefix caching on) beside it: there the reordered documents
miss the prefix cache. Both engines' answers are printed side by side.

    make demo            # or: .venv/bin/python examples/rag/demo.py [--model default|tiny|PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from spanq_integrations import cross, execute, fragment, generate, plus, system, user

HERE = Path(__file__).parent
QUESTIONS = [
    "What color is the town hall of Corrow Ridge?",
    "Which town can only be reached by ferry, and from where?",
    "What color is the town hall of Sarn Well?",
]
SUBSET = ("island", "desert", "orchard", "forest", "river")  # Q3 reads five of the eight documents


def document_orders(docs: list[dict]) -> list[list[dict]]:
    """The documents each question reads, in the order its retrieval gives them: all eight (Q1), the same eight
    reordered (Q2), five of them in another order (Q3)."""
    return [list(docs), random.Random(7).sample(docs, len(docs)),
            random.Random(3).sample([d for d in docs if d["id"] in SUBSET], len(SUBSET))]


WARM_UP = " ".join(f"Line {i} of a warm-up text that is not about any town." for i in range(50))


def rag_query(docs: list[dict], question: str, max_tokens: int):
    return generate(
        cross(
            system("Answer the question using only the documents. Be brief."),
            plus(*[fragment(d["text"], id=d["id"]) for d in docs]),
            user(f"Question: {question}"),
        ),
        max_tokens=max_tokens,
        temperature=0.0,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-stock", action="store_true", help="skip the stock vLLM comparison")
    args = ap.parse_args(argv)

    from spanq_backend.serving import logs

    try:
        logs.level()  # a bad SPANQ_LOG_LEVEL is named at once, not after vLLM's import (~15 s)
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    from spanq_backend.serving.embedded import EmbeddedBackend
    from spanq_integrations import SpanQueryError

    docs = json.loads((HERE / "documents.json").read_text())
    orders = document_orders(docs)
    # Each engine is started when its turn comes and closed after it: measured alone in the process, neither
    # beside the other's idle engine.
    engines = [("spans", lambda: EmbeddedBackend(args.model))]
    if not args.no_stock:
        engines.append(("stock", lambda: EmbeddedBackend(args.model, spans=False)))

    rows = []
    answers: dict[tuple[str, str], str] = {}
    for name, start in engines:
        try:
            backend = start()
        except SpanQueryError as e:  # a model that cannot run, a bad SPANQ_LOG_LEVEL: one line, not a traceback
            print(f"demo: error: {e}", file=sys.stderr)
            return 2
        # Warm-up, not measured: a prompt about as long as Q1's, of other text (the documents stay cold). The
        # first long prefill in a process pays a one-time cost (~0.5 s here) that a short warm-up leaves to
        # whichever engine reads Q1 first.
        execute(generate(user(WARM_UP), max_tokens=1, temperature=0.0), backend)
        for question, order in zip(QUESTIONS, orders):
            result = execute(rag_query(order, question, args.max_tokens), backend)
            call = result.calls[-1]
            rows.append((name, question, call))
            answers[(name, question)] = result.answer.strip()
            # By default (cold_spans="auto") the span engine reads Q1's small new documents in context, as stock
            # does, and prepares them as spans once it is idle; a user's next question comes seconds later: wait.
            if name == "spans":
                backend.engine.settle()
        backend.close()

    for question in QUESTIONS:
        print(question)
        for name, _ in engines:
            print(f"  [{name}] {answers[(name, question)]}")
    print(f"{'engine':<7} {'query':<6} {'TTFT s':>8} {'prompt':>7} {'cached':>7} {'padded':>7} {'new docs':>9}")
    for i, (name, _question, call) in enumerate(rows):
        ttft = f"{call.ttft_s:.2f}" if call.ttft_s is not None else "-"
        new_docs = call.prepared_spans + call.deferred_spans
        print(
            f"{name:<7} {'Q' + str(i % len(QUESTIONS) + 1):<6} {ttft:>8} {call.prompt_tokens:>7} {call.cached_tokens:>7} "
            f"{call.padded_tokens:>7} {new_docs:>9}"
        )
    n = len(QUESTIONS)
    spans_q1, spans_q2, spans_q3 = (call for _, _, call in rows[:n])

    def how(call) -> str:
        return {
            "in-context": "found them cached in context in Q1's order and read them so (full attention, nothing moved)",
            "warm": "read them as cached spans, moved to the new order",
            "stock": "read them as stock does (cached as spans, but small: the default recompute would compute most "
                     "of their blocks again, so the stock prompt computes nearly as much, with full attention)",
        }.get(call.extra.get("cold_spans"), f"read them {call.extra.get('cold_spans')}")

    print(
        f"\nWith spans, Q1 read its {spans_q1.deferred_spans or spans_q1.prepared_spans} new documents "
        f"{'in context, as stock does, and prepared them as spans afterwards' if spans_q1.deferred_spans else 'as spans'}; "
        f"Q2 (the documents reordered) {how(spans_q2)}: {spans_q2.cached_tokens} of {spans_q2.prompt_tokens} prompt "
        f"tokens from the cache; Q3 (five of them, in another order) {how(spans_q3)}: {spans_q3.cached_tokens} of "
        f"{spans_q3.prompt_tokens}."
    )
    if len(rows) == 2 * n:
        stock_q1, stock_q2, stock_q3 = (call for _, _, call in rows[n:])
        ttfts = [
            f"{label} {s.ttft_s:.2f} vs {t.ttft_s:.2f} s ({t.ttft_s / s.ttft_s:.1f}x)"
            for label, s, t in (("Q1", spans_q1, stock_q1), ("Q2", spans_q2, stock_q2), ("Q3", spans_q3, stock_q3))
            if s.ttft_s and t.ttft_s
        ]
        print(f"Stock vLLM reused {stock_q2.cached_tokens} of {stock_q2.prompt_tokens} for Q2 and "
              f"{stock_q3.cached_tokens} of {stock_q3.prompt_tokens} for Q3. TTFT, spans vs stock: " + "; ".join(ttfts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
