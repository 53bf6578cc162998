"""`make demo`'s three questions on the span engine and on stock, engines alternating (spans, stock, spans, stock), each
started alone in this process: per question its TTFT, how the span engine read it (`cold_spans`) and where its
time went (`phases_s`). A single demo run puts each engine's process speed into its ratios; alternating shows it.

    .venv/bin/python scripts/demo_alternating.py [--model default|tiny|PATH] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "rag" / "demo.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("spanq_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # type: ignore[union-attr]

    from spanq_backend.serving.embedded import EmbeddedBackend
    from spanq_integrations import execute, generate, user

    docs = json.loads((DEMO.parent / "documents.json").read_text())
    orders = demo.document_orders(docs)
    for _ in range(args.rounds):
        for name, spans in (("spans", True), ("stock", False)):
            backend = EmbeddedBackend(args.model, spans=spans)
            execute(generate(user(demo.WARM_UP), max_tokens=1, temperature=0.0), backend)
            cells = []
            for i, (question, order) in enumerate(zip(demo.QUESTIONS, orders)):
                call = execute(demo.rag_query(order, question, 32), backend).calls[-1]
                if spans:
                    backend.engine.settle()  # as the demo does: the deferred prepares between questions
                phases = " ".join(f"{k}={v * 1000:.1f}" for k, v in call.extra.get("phases_s", {}).items() if v is not None)
                cells.append(f"Q{i + 1} {call.ttft_s * 1000:.0f} ms [{call.extra.get('cold_spans')}] {phases}")
            print(f"{name}: " + " | ".join(cells), flush=True)
            backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
