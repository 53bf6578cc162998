"""A judge ensemble: several generations answer one question, a judge picks the best — flat, and as a tree.

The candidates are inner generations (the same question sampled with different seeds) inside the judge's query,
so they run concurrently and the judges read them as they finish. With `k`, the one wide judge becomes a k-ary
tree of narrow judges (attention locality); it needs nothing from the server, so the same script runs on the
embedded default model and against any OpenAI-compatible URL (stock vLLM, `spanq serve`, Ollama, …).

    .venv/bin/python examples/judge/judge_ensemble.py                                 # embedded SmolLM2
    .venv/bin/python examples/judge/judge_ensemble.py --model tiny                    # the tiny test model
    .venv/bin/python examples/judge/judge_ensemble.py --backend http://127.0.0.1:8000/v1 --model NAME
    .venv/bin/python examples/judge/judge_ensemble.py --backend spanq+http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

from spanq_integrations import ReducerParseError, cross, generate, system, user
from spanq_integrations.runtime.judge import JudgeResult, judge

QUESTION = "Why is the sky blue?"
CRITERION = "Which answer explains it most accurately and clearly?"


def candidates(question: str, n: int, model: str, max_tokens: int) -> list:
    """`n` answers to `question`, sampled with different seeds: the ensemble to judge."""
    return [
        generate(
            cross(system("Answer in one or two sentences."), user(question)),
            model=model,
            max_tokens=max_tokens,
            temperature=0.9,
            seed=seed,
        )
        for seed in range(n)
    ]


def _read(parsed: object) -> str:
    """What a judge's answer said: the label it picked, or (a leaf of a select combined in code) its scores."""
    if parsed is None:
        return " (no label)"
    if isinstance(parsed, dict):
        return " (scores " + ", ".join(f"#{label}: {score}" for label, score in parsed.items()) + ")"
    return f" (picks #{parsed.index})"


def show(title: str, result: JudgeResult) -> None:
    print(f"\n== {title}")
    for level in result.levels:
        in_code = sum(call.kind == "code" for call in level.calls)
        print(f"level {level.level}: {len(level.calls) - in_code} model call(s)"
              + (f", {in_code} combined in code" if in_code else ""))
        for call in level.calls:
            read = ", ".join(f"#{i.index}" if i.kind == "candidate" else "answer of the level below" for i in call.inputs)
            picked = _read(call.parsed)
            how = " [combined in code, no model call]" if call.kind == "code" else ""
            print(f"  {call.path}  reads {read}  ->  {call.output.strip()[:60]!r}{picked}{how}")
    m = result.metrics
    if result.verdict is not None:
        print(f"verdict: candidate #{result.verdict.index}: {result.verdict.text.strip()!r}")
    print(
        f"cost: {m.calls} calls ({m.judge_calls} of them judges, in {m.levels} level(s)), "
        f"{m.prompt_tokens} prompt + {m.generated_tokens} generated tokens, {m.wall_s:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", help="an OpenAI-compatible URL, or spanq+http://host:port; default: embedded")
    ap.add_argument("--model", default="", help="embedded: default, tiny or a model folder; with --backend: the "
                    "model name the server knows (default: its first)")  # fmt: skip
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("-n", type=int, default=8, help="candidates in the ensemble (default 8)")
    ap.add_argument("-k", type=int, default=2, help="tree fan-in: each judge reads at most k (default 2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    backend = args.backend
    model = args.model
    if backend is None and model:  # embedded on a named model (otherwise the shared default)
        from spanq_backend.serving.embedded import EmbeddedBackend

        backend, model = EmbeddedBackend(model), ""

    ensemble = candidates(args.question, args.n, model, args.max_tokens)
    print(f"question: {args.question}\ncandidates: {args.n} sampled answers; judge: {CRITERION!r}")
    for title, k in ((f"tree of judges, k={args.k}", args.k), ("one flat judge", None)):
        try:
            result = judge(ensemble, CRITERION, k=k, reducer="select", backend=backend, model=model,
                           max_tokens=args.max_tokens)  # fmt: skip
        except ReducerParseError as e:  # a small model may answer without a label: show what it did say
            show(title, e.result)
            print(f"no verdict: {e}")
            continue
        show(title, result)
    if hasattr(backend, "close"):
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
