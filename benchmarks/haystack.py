"""`spanq bench haystack`: needle in a haystack, lost in the middle — one flat judge vs tree reduction.

Each run hides a few random names ("I am a cat, and my name is Ada Moreau.") at random places in the filler
text ("hay") of several inner generations; a judge must extract every name. The same haystacks are judged
flat (one call reads all of them) and as k-ary trees of judges (`judge(..., k)`), at each hay size. Reported
per point: mean precision and recall, the fraction of runs with precision (recall) >= a threshold, and the
cost per run — calls, prompt and generated tokens, wall time. A table is printed; `haystack[-TAG].json` (every
run in `rows`, one entry per point in `summary`) and a PNG plot are written into --out (default: results/haystack/).

    spanq bench haystack --runs 100 --hay 50,100,200,400 --k 2,4            # the full run (see docs/haystack.md)
    spanq bench haystack --runs 10 --hay 50,200 --model default             # a quick look
    spanq bench haystack --backend http://127.0.0.1:8000/v1 --model NAME    # any OpenAI-compatible server
    spanq bench haystack --task select --docs 8                             # one needle: which text has it?

Every tree runs twice by default (`--combine model,code`): with model calls at every level, and with the
model at the leaves only and the answers combined in code (`extract`: the union; `select`: the highest score).

`--task select`: one of the inner generations hides a name, the others are hay; the judge must say which one
(`select`): accuracy is the fraction of runs that name it (reported as P and R), and leaf R the fraction whose
leaf judge reading it ranked it first among its inputs.

The inner generations are, by default, `Assistant` nodes with the synthetic text (`--inner synthetic`): what
a generation returns, without paying for it, so the cost measured is the judge's. `--inner generate` makes
them real generations (the model is asked to repeat the text); the names to find are still the ones hidden
in what it was asked to repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import (
    BenchReport,
    base_parser,
    format_table,
    int_list,
    make_backend,
    new_figure,
    positive_int,
    progress,
)
from spanq_integrations.backends.protocol import Backend
from spanq_integrations.query.errors import ReducerParseError
from spanq_integrations.query.ir import Assistant, Node, cross, generate, system, user
from spanq_integrations.runtime.judge import JudgeResult, ajudge
from spanq_integrations.runtime.reducers import ExtractReducer, Selection

__all__ = ["Haystack", "RunRecord", "main", "make_haystack", "score", "summarize"]

INSTRUCTION = "Tell me the names of the cats mentioned."
SELECT_INSTRUCTION = "Which candidate mentions a cat?"
NEEDLE = "I am a cat, and my name is {name}."
NAME_PATTERN = r"\b[A-Z][a-z]+ [A-Z][a-z]+\b"
"""What counts as a name the judge reports: two capitalised words (the extract reducer's `item_pattern`)."""


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


FIRST_NAMES = _words(
    "Ada Basil Clara Dario Edith Felix Greta Hugo Ines Jonas Kira Lars Mila Nils Olga Pavel Quinn Rosa Silas "
    "Tessa Umar Vera Wendel Xenia Yusuf Zora Alma Bruno Cyra Dmitri Elin Fabio Gemma Harald Ilse Jasper Kalle "
    "Livia Marek Nadia"
)
LAST_NAMES = _words(
    "Moreau Lindqvist Okafor Brandt Castillo Novak Haddad Ferreira Kowalski Aalto Bianchi Dubois Eriksen "
    "Fontaine Gallo Horvat Ivanova Jensen Keller Laine Marsh Nakamura Oyelaran Petrov Quist Rinaldi Sato "
    "Tanaka Ueda Varga Weber Yilmaz Zeller Abbott Becker Costa Duarte Engel Falk Gruber"
)
FILLER = _words(
    "the of and a to in is you that it was for on are as with they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which do how their if will up other about "
    "out many then them these so some would make like into time has look two more write go see number no way "
    "could people than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after thing our just "
    "great where help through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should world"
)


# --------------------------------------------------------------------------------------------- haystacks


@dataclass(frozen=True)
class Haystack:
    """One run's inner texts and the names hidden in them."""

    documents: tuple[str, ...]
    names: tuple[str, ...]
    needle: int | None = None  # --task select: the index of the one text that hides a name


def _filler_sentences(rng: random.Random, words: int) -> list[str]:
    sentences: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(5, 12))
        chosen = [rng.choice(FILLER) for _ in range(n)]
        sentences.append(" ".join([chosen[0].capitalize(), *chosen[1:]]) + ".")
        left -= n
    return sentences


def make_haystack(seed: str, documents: int, names_per_document: int, hay_words: int) -> Haystack:
    """`documents` texts of about `hay_words` filler words each, with `names_per_document` distinct names
    hidden at random sentence boundaries. The same seed gives the same haystack."""
    rng = random.Random(seed)
    pool = [f"{a} {b}" for a in FIRST_NAMES for b in LAST_NAMES]
    names = rng.sample(pool, documents * names_per_document)
    texts = []
    for d in range(documents):
        sentences = _filler_sentences(rng, hay_words)
        for name in names[d * names_per_document : (d + 1) * names_per_document]:
            sentences.insert(rng.randint(0, len(sentences)), NEEDLE.format(name=name))
        texts.append(" ".join(sentences))
    return Haystack(documents=tuple(texts), names=tuple(names))


def make_select_haystack(seed: str, documents: int, hay_words: int) -> Haystack:
    """`documents` texts of filler, one of them (at a random index) hiding one name: the one to select."""
    rng = random.Random(seed)
    needle = rng.randrange(documents)
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    texts = []
    for d in range(documents):
        sentences = _filler_sentences(rng, hay_words)
        if d == needle:
            sentences.insert(rng.randint(0, len(sentences)), NEEDLE.format(name=name))
        texts.append(" ".join(sentences))
    return Haystack(documents=tuple(texts), names=(name,), needle=needle)


def inner_generations(haystack: Haystack, inner: str, model: str) -> list[Node]:
    """The judge's candidates: finished generations (synthetic) or generations to run (the model repeats)."""
    if inner == "synthetic":
        return [Assistant(text=t) for t in haystack.documents]
    return [
        generate(
            cross(system("Repeat the user's text exactly, word for word, and nothing else."), user(t)),
            model=model,
            max_tokens=2 * len(t.split()) + 32,
            temperature=0.0,
        )
        for t in haystack.documents
    ]


# --------------------------------------------------------------------------------------------- scoring


def _norm(name: str) -> str:
    return " ".join(name.split()).casefold()


def score(expected: Sequence[str], found: Sequence[str]) -> tuple[float, float]:
    """(precision, recall) of the names found (case-insensitive, exact); precision is 0 when none were found."""
    truth = {_norm(n) for n in expected}
    got = {_norm(n) for n in found}
    hits = len(truth & got)
    precision = hits / len(got) if got else 0.0
    recall = hits / len(truth) if truth else 1.0
    return precision, recall


@dataclass
class RunRecord:
    hay: int
    method: str  # "flat", "k=2 model", "k=2 code", …
    run: int
    precision: float
    recall: float
    leaf_recall: float  # recall of the union of what the judges reading candidates found (flat: = recall)
    calls: int
    judge_calls: int
    levels: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    found: list[str] = field(default_factory=list)
    answer: str = ""  # the root judge's raw answer (clipped), to see what the model said
    error: str | None = None


def summarize(records: Sequence[RunRecord], threshold: float) -> list[dict[str, Any]]:
    """One row per (hay, method): means, the fractions of runs at or above `threshold`, and the mean cost."""
    groups: dict[tuple[int, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.hay, r.method), []).append(r)
    rows = []
    for (hay, method), rs in groups.items():
        rows.append(
            {
                "hay": hay,
                "method": method,
                "runs": len(rs),
                "errors": sum(r.error is not None for r in rs),
                "precision": statistics.fmean(r.precision for r in rs),
                "recall": statistics.fmean(r.recall for r in rs),
                "leaf_recall": statistics.fmean(r.leaf_recall for r in rs),
                "precision_at_threshold": sum(r.precision >= threshold for r in rs) / len(rs),
                "recall_at_threshold": sum(r.recall >= threshold for r in rs) / len(rs),
                "calls": statistics.fmean(r.calls for r in rs),
                "levels": statistics.fmean(r.levels for r in rs),
                "prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
                "generated_tokens": statistics.fmean(r.generated_tokens for r in rs),
                "wall_s": statistics.fmean(r.wall_s for r in rs),
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]], threshold: float) -> str:
    t = f"{threshold:g}"
    header = ("hay", "method", "runs", "P", "R", f"P>={t}", f"R>={t}", "leaf R", "calls", "prompt tok", "gen tok",
              "wall s")  # fmt: skip
    body = [
        (
            str(r["hay"]),
            r["method"],
            str(r["runs"]) + (f" ({r['errors']} err)" if r["errors"] else ""),
            f"{r['precision']:.3f}",
            f"{r['recall']:.3f}",
            f"{r['precision_at_threshold']:.2f}",
            f"{r['recall_at_threshold']:.2f}",
            f"{r['leaf_recall']:.3f}",
            f"{r['calls']:.1f}",
            f"{r['prompt_tokens']:.0f}",
            f"{r['generated_tokens']:.0f}",
            f"{r['wall_s']:.2f}",
        )
        for r in rows
    ]
    return format_table(header, body, left=2)


def plot(rows: Sequence[dict[str, Any]], threshold: float, title: str) -> Any:
    """The figure: six panels against hay size, one line per method."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    panels = [
        ("recall", "mean recall"),
        ("leaf_recall", "mean recall of the leaf judges (union)"),
        ("precision", "mean precision"),
        ("recall_at_threshold", f"runs with recall >= {threshold:g}"),
        ("prompt_tokens", "prompt tokens per run"),
        ("wall_s", "wall time per run (s)"),
    ]
    fig, axes = new_figure(3, nrows=2, width=13 / 3, height=3.75)
    for ax, (key, label) in zip(axes, panels):
        for method in methods:
            pts = sorted((r["hay"], r[key]) for r in rows if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("hay per inner generation (words)")
        ax.set_title(label, fontsize=10)
        if key not in ("wall_s", "prompt_tokens"):
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- running


def max_tokens_for(names: int) -> int:
    """Room for every name once, even written as a sentence ("my name is Ada Moreau.", ~8 tokens), + slack."""
    return 8 * names + 16


SELECT_MAX_TOKENS = 48
"""`--task select`: a label, or a label and a score per candidate for k <= 4 (a tournament's intermediate
judges are asked to copy the winner's text too; their label, which the parser reads first, comes first)."""


async def judge_one(
    backend: Backend, haystack: Haystack, k: int | None, inner: str, model: str, combine: str = "model",
    task: str = "extract",
) -> tuple[JudgeResult | None, str | None]:  # fmt: skip
    try:
        if task == "select":
            instruction, reducer, max_tokens = SELECT_INSTRUCTION, "select", SELECT_MAX_TOKENS
        else:
            instruction = INSTRUCTION
            reducer, max_tokens = ExtractReducer(item_pattern=NAME_PATTERN), max_tokens_for(len(haystack.names))
        result = await ajudge(
            inner_generations(haystack, inner, model),
            instruction,
            k,
            reducer,
            backend=backend,
            model=model,
            max_tokens=max_tokens,
            temperature=0.0,
            combine=combine,  # type: ignore[arg-type]
        )
        return result, None
    except ReducerParseError as e:  # the root's answer names no candidate: a wrong answer, not a failed run
        return e.result, None  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 — a failed run is recorded (and counted), the benchmark goes on
        return None, f"{type(e).__name__}: {e}"


def _leaf_picks(result: JudgeResult) -> list[int]:
    """The candidate each leaf judge (one reading candidates only) ranks first: a tournament leaf's selection,
    a scoring leaf's highest score (ties: the lower label)."""
    picks = []
    for call in result.judge_calls:
        if call.kind != "model" or not all(i.kind == "candidate" for i in call.inputs):
            continue
        if isinstance(call.parsed, Selection):
            picks.append(call.parsed.index)
        elif isinstance(call.parsed, dict) and call.parsed:
            picks.append(min(call.parsed, key=lambda label: (-call.parsed[label], label)))
    return picks


def _record(hay: int, method: str, run: int, haystack: Haystack, result: JudgeResult | None,
            error: str | None, wall_s: float) -> RunRecord:  # fmt: skip
    if result is None:
        return RunRecord(hay, method, run, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, wall_s, error=error)
    if haystack.needle is not None:  # select: accuracy, as P and R
        correct = float(isinstance(result.verdict, Selection) and result.verdict.index == haystack.needle)
        precision = recall = correct
        leaf_recall = float(haystack.needle in _leaf_picks(result))
        found = [str(result.verdict.index)] if isinstance(result.verdict, Selection) else []
    else:
        precision, recall = score(haystack.names, result.verdict)
        leaves = [c for c in result.judge_calls if c.kind == "model" and all(i.kind == "candidate" for i in c.inputs)]
        _, leaf_recall = score(haystack.names, [item for c in leaves for item in (c.parsed or [])])
        found = list(result.verdict)
    m = result.metrics
    return RunRecord(
        hay, method, run, precision, recall, leaf_recall, m.calls, m.judge_calls, m.levels, m.prompt_tokens,
        m.generated_tokens, m.wall_s, found=found, answer=result.answer[:300],
    )  # fmt: skip


def open_backend(args: argparse.Namespace) -> tuple[Backend, str, str]:
    """(backend, model name for the calls, a description)."""
    if args.backend:
        from spanq_integrations.backends import resolve_backend

        backend, _ = resolve_backend(args.backend)
        model = args.model or ""
        return backend, model, f"{args.backend} (model {model or 'server default'})"
    model = args.model or "default"
    backend = make_backend(model, spans=args.spans, max_model_len=args.max_model_len, max_num_seqs=16)
    kind = "span-aware" if args.spans else "stock vLLM, full attention"
    return backend, "", f"embedded {backend.model_name} ({kind})"


async def run_all(args: argparse.Namespace, backend: Backend, model: str) -> list[RunRecord]:
    """Every (hay, run): one haystack, judged by every method in a random order (so no method always finds the
    prefix cache warmed by another one on the same haystack). `--concurrency` haystacks are in flight at once."""
    methods: list[tuple[str, int | None, str]] = [("flat", None, "model")] + [
        (f"k={k} {combine}", k, combine) for k in args.k for combine in args.combine
    ]
    bar, tick = _progress(len(args.hay) * args.runs * len(methods), quiet=args.no_progress)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(hay: int, run: int) -> list[RunRecord]:
        seed = f"{args.seed}:{hay}:{run}"
        if args.task == "select":
            haystack = make_select_haystack(seed, args.docs, hay)
        else:
            haystack = make_haystack(seed, args.docs, args.names, hay)
        order = random.Random(seed).sample(methods, len(methods))
        out = []
        async with gate:
            for method, k, combine in order:
                started = time.perf_counter()
                result, error = await judge_one(backend, haystack, k, args.inner, model, combine, args.task)
                record = _record(hay, method, run, haystack, result, error, time.perf_counter() - started)
                out.append(record)
                tick(f"hay={hay} {method} run {run + 1}/{args.runs}: P={record.precision:.2f} "
                     f"R={record.recall:.2f}{' ' + error if error else ''}")  # fmt: skip
        return out

    try:
        batches = await asyncio.gather(*(one(hay, run) for hay in args.hay for run in range(args.runs)))
    finally:
        bar.close()
    order = {m: i for i, (m, _, _) in enumerate(methods)}
    return sorted((r for batch in batches for r in batch), key=lambda r: (r.hay, order[r.method], r.run))


def _progress(total: int, *, quiet: bool) -> tuple[Any, Callable[[str], None]]:
    """(bar, tick): the shared progress bar on a terminal; elsewhere (a log file) one line per judge run on stderr,
    since runs are long. `quiet` (--no-progress): neither."""
    bar = progress(total, "haystack", disable=quiet or not sys.stderr.isatty())
    done = 0

    def tick(message: str) -> None:
        nonlocal done
        done += 1
        bar.update(1)
        if not bar.disable:
            bar.set_postfix_str(message[-60:])
        elif not quiet:
            print(f"[{done}/{total}] {message}", file=sys.stderr, flush=True)

    return bar, tick


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(
        "haystack",
        "Needle in a haystack: a flat judge vs tree reduction (k-ary trees of narrow judges).",
        model=None,
        model_help="embedded: tiny, default (SmolLM2-135M-Instruct) or a model folder; with --backend: the model "
        "name the server knows (default: its first)",
        reps=None,  # --runs
    )
    p.add_argument("--runs", type=positive_int, default=100, help="runs per point (hay size x method); default 100")
    p.add_argument("--hay", type=int_list, default=[50, 100, 200, 400],
                   help="filler words per inner generation, comma-separated (default 50,100,200,400)")  # fmt: skip
    p.add_argument("--k", type=int_list, default=[2, 4], help="tree fan-ins to compare with flat (default 2,4)")
    p.add_argument("--combine", type=_combine_list, default=["model", "code"],
                   help="how trees combine answers, comma-separated: model (calls at every level), code (calls "
                        "at the leaves, combined in code); default model,code")  # fmt: skip
    p.add_argument("--task", choices=["extract", "select"], default="extract",
                   help="extract every hidden name (default), or select the one text that hides a name")
    p.add_argument("--docs", type=positive_int, default=8, help="inner generations per run (default 8)")
    p.add_argument("--names", type=positive_int, default=2, help="names hidden in each inner generation (default 2)")
    p.add_argument("--threshold", type=float, default=0.75, help="report runs with P (R) >= this (default 0.75)")
    p.add_argument("--backend", default=None, metavar="URL",
                   help="an OpenAI-compatible server (http://host:port/v1) or spanq+http://host:port; "
                        "default: embedded")  # fmt: skip
    p.add_argument("--spans", action=argparse.BooleanOptionalAction, default=False,
                   help="embedded only: the span-aware engine (each inner generation attends only to the system "
                        "prompt) instead of stock full attention (default: stock)")  # fmt: skip
    p.add_argument("--inner", choices=["synthetic", "generate"], default="synthetic",
                   help="inner generations: synthetic assistant texts (default) or real generations")  # fmt: skip
    p.add_argument("--concurrency", type=positive_int, default=1,
                   help="haystacks judged at once (default 1: wall times of one run alone; more batches "
                        "decoding across runs, but each run's wall time then includes waiting for others)")  # fmt: skip
    p.add_argument("--max-model-len", type=positive_int, default=8192, help="embedded: context window (default 8192)")
    return p


def _combine_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("model", "code")]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"combine modes are model and code, got {text!r}")
    return list(dict.fromkeys(modes))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name in ("runs", "docs", "names", "concurrency"):
        if getattr(args, name) < 1:
            print(f"spanq bench haystack: --{name} must be at least 1", file=sys.stderr)
            return 2
    if any(k < 2 for k in args.k):
        print("spanq bench haystack: every --k must be at least 2", file=sys.stderr)
        return 2

    report = BenchReport("haystack", args, label="")  # haystack[-TAG].json: the model is in the config
    backend, model, described = open_backend(args)
    started = time.perf_counter()
    try:
        records = asyncio.run(run_all(args, backend, model))
    finally:
        asyncio.run(backend.aclose())
    elapsed = time.perf_counter() - started

    rows = summarize(records, args.threshold)
    what = "1 hides a name (select)" if args.task == "select" else f"x {args.names} names"
    title = (
        f"haystack: {args.docs} inner generations {what}, {args.runs} runs/point, "
        f"{described}" + (f", {args.concurrency} runs at once" if args.concurrency > 1 else "")
    )
    print(f"\n{title}\n")
    print(table(rows, args.threshold))
    print(f"\n{len(records)} judge runs in {elapsed:.0f} s")

    instruction = SELECT_INSTRUCTION if args.task == "select" else INSTRUCTION
    report.config.update({"backend_description": described, "instruction": instruction, "elapsed_s": elapsed})
    report.rows = [asdict(r) for r in records]
    report.summary = rows
    try:
        figure = plot(rows, args.threshold, title)
    except ImportError:
        print("matplotlib is not installed (pip install 'spanq[bench]'): no plot", file=sys.stderr)
        figure = None
    report.write(figure)
    report.print_files()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
