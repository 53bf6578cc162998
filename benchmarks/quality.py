"""`spanq bench quality`: what span attention costs in answer quality, measured on the engines, and what
recomputing part of each span (`recompute=`) buys back, against its time to first token.

Each item is a small QA task built here (deterministic for a seed): `--docs` documents, each about a different
invented town (with `--filler` sentences of other facts) and the colour its town hall is painted; the question
asks for one town's colour, so the answer sits in exactly one document. Along a gold answer ("The town hall of X
is painted C."), teacher-forced, each engine gives its next-token distributions (prompt log-probabilities,
`benchmarks/engine_scoring.py`; the span engine reads its cached spans as it does for any query):

- stock, plain: stock vLLM on the prompt a stock user sends (full attention, no padding): the reference;
- stock, layout: stock vLLM fed the span layout's exact tokens (padding included), no span table;
- spans: the span engine on the same tokens with its span table, per anchor policy (`--anchors`) and recompute
  setting (`--recompute`).

Three comparisons separate the two changes: layout only (stock layout vs stock plain), attention only (spans vs
stock layout: the same tokens), both (spans vs stock plain: what a user sees). A `plus` is order-free and the span
engine reads a group in one order per set (`lowering.span_order`), so a fourth reference is stock on the plain
prompt with the documents in that order (full attention, no padding: what stock answers over the same order);
"same order" compares the spans with it, and "order only" says how far the two stock orders are apart. Each reports argmax agreement
along the gold answer, KL(reference || other) per token (over the reference's top 20 tokens and one bucket for
the rest: about a lower bound, since the bucket's mass for the other engine is estimated), and the gold answer's
log-probability; exact match is whether the greedy answer names
the right colour. Means over items come with bootstrap 95% intervals. `--hf-check N` computes the exact KL of
the attention-only comparison with HF transformers on N items (`benchmarks/hf_span.py`), beside the engine's.

The speed side (`--speed-docs` x `--speed-tokens`, as `spanq bench rag`): fresh documents read once by each
engine, then read again in another order with another question — stock vLLM (its prefix cache holds only the
system prompt) and the span engine under each recompute setting (each from an empty cache, the documents prepared
again first, so nothing another setting recomputed is cached): warm time to first token, side by side; the
speedup is the median of per-repetition ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchReport,
    base_parser,
    engine_pair,
    format_table,
    model_label,
    names_from,
    new_figure,
    positive_int,
    progress,
    summarize,
)

__all__ = ["QAItem", "main", "make_items"]

TOWNS = (
    "Alderbrook", "Bramblewick", "Caldermoor", "Dunhollow", "Elmstead", "Fernwick", "Galeford", "Harrowgate",
    "Ivyholm", "Juniper Falls", "Kestrelby", "Larchmere", "Marrowdale", "Nettlecombe", "Oakhurst", "Pebbleton",
    "Quillsby", "Rookhaven", "Saltmarsh", "Thistledown", "Umberlea", "Valewood", "Wrenfield", "Yarrowby",
    "Zephyr Cove", "Ashcombe", "Birchley", "Coldwater", "Drakemoor", "Eastwick",
)
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown", "grey", "gold")
FEATURES = ("river", "lake", "forest", "hill", "coast", "valley", "marsh", "canal")
GOODS = ("cheese", "apples", "wool", "pottery", "bread", "honey", "fish", "candles")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
SYSTEM = "You answer questions about towns using only the documents. Answer in one short sentence."


@dataclass(frozen=True)
class QAItem:
    docs: list[str]
    target: int  # the document that holds the answer
    town: str
    color: str
    question: str
    task: str = "qa"
    gold_text: str = ""  # the gold answer, where it is not the QA item's sentence
    expect: tuple[str, ...] = ()  # what a correct answer names (each, as a word or phrase); default: the colour
    preamble: str = ""  # text of the user turn before the documents (a judge's source document)
    system_text: str = ""  # the system prompt, where it is not SYSTEM
    docs_role: str = "user"  # the message the documents are content of: "system" as in LangChain's RAG template

    @property
    def gold(self) -> str:
        return self.gold_text or f"The town hall of {self.town} is painted {self.color}."

    def correct(self, answer: str) -> bool:
        """Whether a greedy answer names what the gold answer names (exact match, by words); a judge's, whether
        the candidate it picks (the first number it names) is the right one."""
        if self.task == "judge":
            return judge_pick(answer) == self.target + 1
        return all(names_color(answer, x) for x in (self.expect or (self.color,)))


FILLER = (
    "The {road} road leads out of {name} towards the {feature}.",
    "In {name}, the bakery opens early on {day}.",
    "Children in {name} learn to swim in the {feature}.",
    "The old mill of {name} stopped turning long ago.",
    "A bus leaves {name} for the city twice a day.",
    "Most houses in {name} have gardens full of {good}.",
    "The library of {name} keeps maps of the {feature}.",
    "Every {day} the square of {name} fills with stalls.",
    "Fishermen from {name} sell their catch by the {feature}.",
    "The school of {name} has a choir that sings in spring.",
)


def make_items(count: int, docs: int, *, seed: int, filler: int = 0) -> list[QAItem]:
    """`count` QA items of `docs` documents each (different towns, different colours); see the module docstring.
    `filler`: sentences of other facts about the town in each document, the colour sentence among them at a
    random place (longer documents: more KV blocks per document)."""
    rng = random.Random(f"spanq-quality:{seed}")
    towns = list(TOWNS)
    items = []
    for _ in range(count):
        names = rng.sample(towns, docs)
        colors = rng.sample(COLORS, docs)
        texts = []
        for name, color in zip(names, colors):
            facts = [
                (f"The market of {name} sells {rng.choice(GOODS)} every {rng.choice(DAYS)}, and visitors come "
                 f"in summer to walk along the {rng.choice(FEATURES)}.")
            ]
            for _k in range(filler):
                facts.append(rng.choice(FILLER).format(
                    name=name, road=rng.choice(("north", "south", "east", "west")), feature=rng.choice(FEATURES),
                    day=rng.choice(DAYS), good=rng.choice(GOODS),
                ))
            facts.insert(rng.randrange(len(facts) + 1), f"Its town hall is painted {color}.")
            texts.append(f"{name} is a small town by the {rng.choice(FEATURES)}. " + " ".join(facts))
        target = rng.randrange(docs)
        question = f"What colour is the town hall of {names[target]} painted?"
        items.append(QAItem(texts, target, names[target], colors[target], question))
    return items


ANCHORS = ("template", "system", "prefix")
DEFAULT_RECOMPUTE = "0,first,last,0.1,0.25"
TOP = 20  # log-probabilities per row (vLLM's default limit)


def qa_query(item: QAItem, max_tokens: int, anchor: str | None = None, recompute: Any = None) -> Any:
    from spanq_integrations import cross, fragment, generate, plus, system, user

    docs = plus(*[fragment(d, id=f"doc{i}") for i, d in enumerate(item.docs)], anchor=anchor, role=item.docs_role)
    parts = [system(item.system_text or SYSTEM), *([user(item.preamble)] if item.preamble else []), docs,
             user(item.question)]
    return generate(cross(*parts), max_tokens=max_tokens, temperature=0.0, recompute=recompute)


TASKS = ("qa", "cross", "judge", "demo", "system-prompt")


def make_task_items(task: str, count: int, docs: int, *, seed: int, filler: int = 0) -> list[QAItem]:
    """`count` items of one task shape:

    - qa: one document holds the answer (`make_items`);
    - cross: the answer needs two documents: the colours of two towns' halls, in one sentence;
    - judge: four candidate answers to a QA question (one right) are the spans, the source document precedes them
      in the user turn; the gold answer is the right candidate's number: does the span judge pick what the stock
      judge picks;
    - demo: the demo's two questions over its eight documents (`examples/rag/documents.json`), in `count` seeded
      orders;
    - system-prompt: the qa items with the documents in the system message, after its instruction (LangChain's RAG
      template; a span group with `role="system"`).
    """
    if task == "qa":
        return make_items(count, docs, seed=seed, filler=filler)
    if task == "system-prompt":
        qa = make_items(count, docs, seed=seed, filler=filler)
        return [replace(item, task="system-prompt", docs_role="system") for item in qa]
    rng = random.Random(f"spanq-quality-{task}:{seed}")
    if task == "cross":
        out = []
        for item in make_items(count, docs, seed=seed, filler=filler):
            other = rng.choice([i for i in range(len(item.docs)) if i != item.target])
            town2 = item.docs[other].split(" is a small town")[0]
            color2 = re.search(r"town hall is painted (\w+)", item.docs[other]).group(1)
            out.append(QAItem(
                item.docs, item.target, item.town, item.color,
                f"What colours are the town halls of {item.town} and {town2} painted?", task="cross",
                gold_text=f"The town hall of {item.town} is painted {item.color}, and the town hall of {town2} is "
                f"painted {color2}.",
                expect=(item.color, color2),
            ))
        return out
    if task == "judge":
        out = []
        for item in make_items(count, 1, seed=seed, filler=filler):
            wrong = rng.sample([c for c in COLORS if c != item.color], 3)
            colors = [item.color, *wrong]
            rng.shuffle(colors)
            k = colors.index(item.color) + 1
            cands = [f"Answer {i + 1}: The town hall of {item.town} is painted {c}." for i, c in enumerate(colors)]
            out.append(QAItem(
                cands, k - 1, item.town, item.color,
                "Which answer is correct according to the document: 1, 2, 3 or 4? Reply with its number.",
                task="judge", gold_text=str(k), expect=(str(k),),
                preamble=f"Document: {item.docs[0]}\n\nQuestion: {item.question}\n\nCandidate answers:",
                system_text="You judge answers against a document. Reply with the number of the correct answer.",
            ))
        return out
    if task == "demo":
        root = Path(__file__).resolve().parents[1] / "examples" / "rag"
        documents = [d["text"] for d in json.loads((root / "documents.json").read_text())]
        questions = (
            ("What color is the town hall of Corrow Ridge?", "The town hall of Corrow Ridge is painted dark red.",
             ("dark red",), "Corrow Ridge", "dark red"),
            ("Which town can only be reached by ferry, and from where?",
             "Hollin Isle can only be reached by ferry, from Lindale Harbor.", ("Hollin", "Lindale"), "Hollin Isle", ""),
        )
        out = []
        for k in range(count):
            question, gold, expect, town, color = questions[k % 2]
            order = rng.sample(documents, len(documents))
            target = next(i for i, d in enumerate(order) if town.split()[0] in d.split(".")[0])
            out.append(QAItem(order, target, town, color, question, task="demo", gold_text=gold, expect=expect,
                              system_text="Answer the question using only the documents. Be brief."))
        return out
    raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")


def names_color(answer: str, color: str) -> bool:
    return re.search(rf"\b{re.escape(color.lower())}\b", answer.lower()) is not None


def judge_pick(answer: str) -> int | None:
    """The candidate a judge's answer picks: the first candidate number (1-4) it names, None if it names none."""
    found = re.search(r"\b([1-4])\b", answer)
    return int(found.group(1)) if found else None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = base_parser("quality", __doc__, model="default", reps=None)
    parser.add_argument("--items", type=int, default=100, help="items per task (default: 100)")
    parser.add_argument("--tasks", type=_task_list, default=["qa"],
                        help=f"task shapes (default: qa; any of {', '.join(TASKS)}; see make_task_items)")
    parser.add_argument("--docs", type=positive_int, default=5, help="documents per item (default: 5)")
    parser.add_argument("--filler", type=int, default=12,
                        help="sentences of other facts per document (default: 12, about 7 KV blocks a document)")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="answer length for exact match (default: 16)")
    parser.add_argument("--anchors", type=_anchor_list, default=["template"],
                        help="anchor policies to measure (default: template; any of template,system,prefix)")
    parser.add_argument("--lead-ins", type=_lead_in_list, default=["neutral"],
                        help="lead-ins of the template and system anchors to measure (default: neutral, spanq's: its "
                        "neutral passages; auto: the start of the first document the engine reads; none)")
    parser.add_argument("--recompute", type=_recompute_list, default=_recompute_list(DEFAULT_RECOMPUTE),
                        help=f"recompute settings to measure (default: {DEFAULT_RECOMPUTE}; 0, first, last, question, first+question, attention or a share)")
    parser.add_argument("--hf-check", type=int, default=5, metavar="N",
                        help="items whose attention-only KL is also computed exactly with HF transformers (default 5)")
    parser.add_argument("--speed-docs", type=int, default=8, help="documents of the speed side (default: 8; 0: none)")
    parser.add_argument("--speed-tokens", type=positive_int, default=512, help="tokens per document there (default: 512)")
    parser.add_argument("--speed-reps", type=positive_int, default=2, help="repetitions of the speed side (default: 2)")
    parser.add_argument("--rows-from", type=Path, nargs="+", metavar="JSON",
                        help="measure nothing: summarize and plot the QA and speed rows of earlier runs' JSON files "
                        "(for example a long QA run and a speed run); give the same --recompute and --docs")
    return parser.parse_args(list(argv))


LEAD_INS = ("neutral", "auto", "none")  # SpanGenerator.lead_in_for's settings
_anchor_list = names_from(ANCHORS, "anchor policies")
_task_list = names_from(TASKS, "tasks")
_lead_in_list = names_from(LEAD_INS, "lead-ins")


def anchor_label(anchor: str, lead_in: str) -> str:
    """The anchor column of a setting: the policy, then its lead-in unless it is spanq's default ("neutral";
    prefix anchors have none)."""
    return anchor if lead_in == "neutral" or anchor == "prefix" else f"{anchor}-{lead_in}"


def lead_in_setting(label: str) -> str:
    """The generator's lead-in setting (`SpanGenerator.lead_in_for`) of an anchor column."""
    return label.partition("-")[2] or "neutral"


def _recompute_list(text: str) -> list[Any]:
    from spanq_backend.serving.recompute import recompute_arg

    out = [recompute_arg(t.strip()) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("no recompute setting given")
    return list(dict.fromkeys(out))


def setting_label(setting: Any) -> str:
    return str(setting) if isinstance(setting, str) else ("0" if setting == 0 else f"{setting:g}")


_ASKED: dict[Any, Any] = {}  # (engine, what, its arguments) -> the answer, for the run


async def on_engine(backend: Any, name: str, *args: Any) -> Any:
    """`engine_scoring.<name>` on the backend's engine: in this process, or in the stock engine's own.

    The same question to the same engine is answered once per run: scoring is deterministic, and a prompt asked
    again (two items that read the same documents in the same order, as a span group's one order per set makes
    them) would find its own rows in the prefix cache, where the engine computes no distribution for them."""
    from benchmarks import engine_scoring

    try:
        key = (id(backend), name, tuple(tuple(a) if isinstance(a, list) else a for a in args))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _ASKED:
        return _ASKED[key]
    if hasattr(backend, "on_engine"):
        got = await backend.on_engine(name, *args)
    else:
        got = await getattr(engine_scoring, name)(backend.engine, *args)
    if key is not None:
        _ASKED[key] = got
    return got


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Argmax agreement, mean per-token KL(ref || other) (top-k estimate) and the gold log-prob difference."""
    from benchmarks.engine_scoring import argmax, kl_top_k

    rows = list(zip(ref["rows"], other["rows"]))
    return {
        "agreement": sum(argmax(p) == argmax(q) for p, q in rows) / len(rows),
        "kl": sum(kl_top_k(p, q, TOP) for p, q in rows) / len(rows),
        "gold_lp_delta": sum(other["own"]) - sum(ref["own"]),
    }


async def measure_item(item: QAItem, k: int, stock: Any, spans: Any, args: argparse.Namespace, hf_model: Any) -> list[dict[str, Any]]:
    from spanq_backend.serving.generator import flattened_prompt_ids

    gen = spans.engine.generator
    tokenizer = spans.engine.tokenizer
    gold = tokenizer.encode(item.gold, add_special_tokens=False)
    base = qa_query(item, args.max_tokens)
    plain = flattened_prompt_ids(tokenizer, base.input)
    lowered_base = gen.lower(base)
    layout = lowered_base.token_ids
    ref = await on_engine(stock, "score", plain, gold, None, TOP)
    ref_answer = await on_engine(stock, "greedy", plain, args.max_tokens, None)
    # The documents in the order the span engine reads them, as a plain prompt (read by stock where it differs).
    in_span_order = lowered_base.in_span_order(item.docs)
    if in_span_order == list(item.docs):
        same, same_answer = ref, ref_answer
    else:
        ordered = flattened_prompt_ids(tokenizer, qa_query(replace(item, docs=in_span_order), args.max_tokens).input)
        same = await on_engine(stock, "score", ordered, gold, None, TOP)
        same_answer = await on_engine(stock, "greedy", ordered, args.max_tokens, None)
    order_only = compare(ref, same)
    lay = await on_engine(stock, "score", layout, gold, None, TOP)
    lay_answer = await on_engine(stock, "greedy", layout, args.max_tokens, None)
    layout_only = compare(ref, lay)
    rows = []
    seen: dict[Any, tuple[dict[str, Any], str]] = {}
    variants = list(dict.fromkeys(anchor_label(a, lead) for a in args.anchors for lead in args.lead_ins))
    kept = gen.default_lead_in
    for label in variants:
        anchor = label.partition("-")[0]
        gen.default_lead_in = lead_in_setting(label)
        for setting in args.recompute:
            call = qa_query(item, args.max_tokens, anchor, setting)
            lowered = gen.lower(call)
            await gen.prepare_detail(lowered)
            plan, _ = await gen.plan(call, lowered)
            await gen.recompute(plan)
            key = (plan.lowered.table, tuple(map(str, plan.lowered.table.anchors or ())))
            if key not in seen:
                got = await on_engine(spans, "score", lowered.token_ids, gold, plan.lowered.table, TOP)
                answer = await on_engine(spans, "greedy", lowered.token_ids, args.max_tokens, plan.lowered.table)
                seen[key] = (got, answer)
            got, answer = seen[key]
            span_tokens = sum(e - s for s, e in lowered.table.spans)
            row: dict[str, Any] = {
                "item": k, "task": item.task, "anchor": label, "recompute": setting_label(setting), "town": item.town,
                "color": item.color, "target_doc": item.target,
                "recomputed_share": plan.tokens / span_tokens if span_tokens else 0.0,
                "stock_answer": ref_answer, "layout_answer": lay_answer, "spans_answer": answer,
                "same_order_answer": same_answer, "reordered": in_span_order != list(item.docs),
                "stock_correct": item.correct(ref_answer), "same_order_correct": item.correct(same_answer),
                "layout_correct": item.correct(lay_answer),
                "spans_correct": item.correct(answer),
                "prompt_tokens_stock": len(plain), "prompt_tokens_spans": len(lowered.token_ids),
                "padded_tokens": lowered.padded_tokens,
                "gold_lp_stock": sum(ref["own"]), "gold_lp_layout": sum(lay["own"]), "gold_lp_spans": sum(got["own"]),
                **{f"layout_{m}": v for m, v in layout_only.items()},
                **{f"attention_{m}": v for m, v in compare(lay, got).items()},
                **{f"both_{m}": v for m, v in compare(ref, got).items()},
                **{f"order_{m}": v for m, v in order_only.items()},
                **{f"same_{m}": v for m, v in compare(same, got).items()},
            }
            if hf_model is not None and k < args.hf_check:
                from benchmarks import hf_span

                full = hf_span.full_attention_next_token_logprobs(hf_model, lowered.token_ids, gold)
                span = hf_span.span_attention_next_token_logprobs(hf_model, lowered.token_ids, plan.lowered.table, gold)
                row["hf_attention_kl"] = float(hf_span.kl_divergence(full, span).mean())
                row["hf_attention_agreement"] = float((full.argmax(-1) == span.argmax(-1)).double().mean())
            rows.append(row)
    gen.default_lead_in = kept
    return rows


async def measure_speed(stock: Any, spans: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm TTFT per recompute setting beside stock vLLM's, on fresh documents (see the module docstring)."""
    from benchmarks.common import make_documents, reset_cache, settle, ttft_of
    from benchmarks.rag import QUESTION, SECOND_QUESTION, rag_query
    from spanq_integrations.runtime.executor import aexecute

    tokenizer = spans.engine.tokenizer
    n = args.speed_docs
    rng = random.Random(f"spanq-quality-speed:{args.seed}")
    rows = []
    for rep in range(args.speed_reps):
        docs = make_documents(tokenizer, n, args.speed_tokens, seed=args.seed, start=10**5 + rep * n)
        first = list(range(n))
        (cold,) = (await aexecute(rag_query(docs, first, QUESTION), stock)).calls
        (warm,) = (await aexecute(rag_query(docs, first[::-1], SECOND_QUESTION), stock)).calls
        rows.append({"rep": rep, "mode": "stock_reordered", "recompute": None, "ttft_s": ttft_of(warm),
                     "stock_cold_ttft_s": ttft_of(cold)})
        # The span path itself, at each setting: documents prepared alone first and read as spans (a call that asks
        # "isolate" is never read in context, as the same set asked again by an app otherwise is: `spanq bench rag`).
        # A group is read in one order per set whatever order it is given in, so the blocks one setting recomputed
        # would be cached for the next: each setting starts from an empty cache and prepares the documents again.
        isolate = {"cold_spans": "isolate"}
        for setting in args.recompute:
            settle(spans)
            reset_cache(spans)
            await aexecute(rag_query(docs, first, QUESTION).model_copy(update=isolate), spans)
            order = first[:]
            rng.shuffle(order)
            call = rag_query(docs, order, SECOND_QUESTION).model_copy(update={"recompute": setting, **isolate})
            result = await aexecute(call, spans)
            (m,) = result.calls
            lowered = spans.engine.lower(call)
            span_tokens = sum(e - s for s, e in lowered.table.spans)
            rows.append({"rep": rep, "mode": "spans_warm", "recompute": setting_label(setting), "ttft_s": ttft_of(m),
                         "recomputed_share": m.extra.get("recomputed_tokens", 0) / max(1, span_tokens),
                         "prepared_spans": m.prepared_spans})
    return rows


def main(argv: Sequence[str] = (), *, backends: tuple[Any, Any] | None = None) -> int:
    """Run the benchmark; `backends` = (stock, spans) to reuse engines instead of starting two."""
    import asyncio

    from benchmarks import hf_span
    from spanq_backend.serving.models import resolve_model

    args = parse_args(argv)
    _ASKED.clear()  # answers are remembered for one run's engines only
    report = BenchReport("quality", args)
    if args.rows_from:
        _load_rows(report, args)
    else:
        items = [it for task in args.tasks
                 for it in make_task_items(task, args.items, args.docs, seed=args.seed, filler=args.filler)]
        hf_model = hf_span.load_hf_model(resolve_model(args.model)) if args.hf_check > 0 else None
        with engine_pair(args.model, backends=backends, max_model_len=8192, max_num_seqs=8) as (stock, spans):
            bar = progress(len(items), "quality", disable=args.no_progress)

            async def run() -> None:
                for k, item in enumerate(items):
                    report.rows.extend(await measure_item(item, k, stock, spans, args, hf_model))
                    bar.update(1)
                bar.close()
                report.config["corpus_lead_in"] = spans.engine.generator.corpus_lead_in
                if args.speed_docs > 0 and args.speed_reps > 0:
                    report.config["speed_rows"] = await measure_speed(stock, spans, args)

            asyncio.run(run())

    report.summary = summarize_rows(report.rows, report.config.get("speed_rows", []), args)
    print(render_table(report.summary, args))
    report.write(plot(report.summary, args))
    report.print_files()
    return 0


def _load_rows(report: BenchReport, args: argparse.Namespace) -> None:
    """`--rows-from`: the QA and speed rows of earlier runs (the speed side's sizes from the run that has one)."""
    speed_rows: list[dict[str, Any]] = []
    for path in args.rows_from:
        data = json.loads(path.read_text())
        report.rows.extend(data["rows"])
        if data["config"].get("speed_rows"):
            speed_rows.extend(data["config"]["speed_rows"])
            args.speed_docs, args.speed_tokens = data["config"]["speed_docs"], data["config"]["speed_tokens"]
    report.config.update({"speed_rows": speed_rows, "rows_from": [str(p) for p in args.rows_from]})
    args.items = len({r["item"] for r in report.rows})


def bootstrap(values: Sequence[float], *, reps: int = 2000, seed: int = 0) -> dict[str, float]:
    """The mean of `values` and a bootstrap 95% interval of it (resampling items)."""
    xs = [float(v) for v in values]
    if not xs:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(reps))
    return {"mean": sum(xs) / len(xs), "lo": means[int(0.025 * reps)], "hi": means[int(0.975 * reps) - 1], "n": len(xs)}


METRICS = ("agreement", "kl", "gold_lp_delta")


def summarize_rows(rows: list[dict[str, Any]], speed: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per anchor policy and recompute setting: the three comparisons with intervals, exact match, the share
    recomputed, padding; and the speed side's warm TTFT per setting against stock's."""
    out: dict[str, Any] = {"items": len({r["item"] for r in rows}), "chance": 1.0 / args.docs, "settings": {}}
    labels = [setting_label(s) for s in args.recompute]
    if speed:
        from benchmarks.common import paired_speedup

        stock_rows = {r["rep"]: r["ttft_s"] for r in speed if r["mode"] == "stock_reordered"}
        stock_ttft = summarize(list(stock_rows.values()))["mean"]
        per_setting = {}
        for label in labels:
            warm = [r for r in speed if r["mode"] == "spans_warm" and r["recompute"] == label]
            ttft = summarize([r["ttft_s"] for r in warm])["mean"]
            per_setting[label] = {  # the speedup: the median of per-repetition ratios, each rep's runs back to back
                "warm_ttft_s": ttft,
                "speedup_vs_stock_reordered": paired_speedup(stock_rows, {r["rep"]: r["ttft_s"] for r in warm}) if warm else None,
                "recomputed_share": summarize([r["recomputed_share"] for r in warm])["mean"],
            }
        out["speed"] = {"docs": args.speed_docs, "tokens": args.speed_tokens, "stock_reordered_ttft_s": stock_ttft,
                        "settings": per_setting}
    anchors = list(dict.fromkeys(anchor_label(a, lead) for a in args.anchors for lead in getattr(args, "lead_ins", ["neutral"])))
    tasks = list(dict.fromkeys(r.get("task", "qa") for r in rows))
    for task, anchor, setting in ((t, a, s) for t in tasks for a in anchors for s in labels):
        at = [r for r in rows if r.get("task", "qa") == task and r["anchor"] == anchor and r["recompute"] == setting]
        if not at:
            continue
        if task == "judge":  # the pick read from the answers (a run before judge_pick counted any "1" named)
            for r in at:
                for name in ("stock", "layout", "spans"):
                    r[f"{name}_correct"] = judge_pick(r[f"{name}_answer"]) == r["target_doc"] + 1
        entry: dict[str, Any] = {
            "exact_match": {name: bootstrap([r[f"{name}_correct"] for r in at]) for name in ("stock", "layout", "spans")},
            # paired over items: spans' exact match minus stock's on the plain prompt
            "exact_match_diff": bootstrap([float(r["spans_correct"]) - float(r["stock_correct"]) for r in at]),
            "recomputed_share": summarize([r["recomputed_share"] for r in at])["mean"],
            "padding_overhead": sum(r["padded_tokens"] for r in at) / max(1, sum(r["prompt_tokens_spans"] for r in at)),
            "gold_lp": {name: summarize([r[f"gold_lp_{name}"] for r in at])["mean"] for name in ("stock", "layout", "spans")},
        }
        if task == "judge":  # does the span judge pick what the stock judge picks over the same candidates
            entry["same_pick"] = {name: bootstrap([float(judge_pick(r[f"{name}_answer"]) == judge_pick(r["stock_answer"]))
                                                   for r in at]) for name in ("layout", "spans")}
        for comparison in ("layout", "attention", "both"):
            entry[comparison] = {m: bootstrap([r[f"{comparison}_{m}"] for r in at]) for m in METRICS}
        if all("same_kl" in r for r in at):  # rows measured since the same-order reference
            for comparison in ("order", "same"):
                entry[comparison] = {m: bootstrap([r[f"{comparison}_{m}"] for r in at]) for m in METRICS}
            entry["reordered"] = sum(r["reordered"] for r in at) / len(at)
            entry["exact_match"]["same_order"] = bootstrap([r["same_order_correct"] for r in at])
            entry["exact_match_diff_same_order"] = bootstrap(
                [float(r["spans_correct"]) - float(r["same_order_correct"]) for r in at])
        checked = [r for r in at if "hf_attention_kl" in r]
        if checked:
            entry["hf_check"] = {
                "items": len(checked),
                "hf_kl": summarize([r["hf_attention_kl"] for r in checked])["mean"],
                "engine_kl_top20": summarize([r["attention_kl"] for r in checked])["mean"],
                "hf_agreement": summarize([r["hf_attention_agreement"] for r in checked])["mean"],
                "engine_agreement": summarize([r["attention_agreement"] for r in checked])["mean"],
            }
        if speed:
            entry["speed"] = out["speed"]["settings"][setting]
        out["settings"][f"{anchor}/{setting}" if task == "qa" else f"{task}:{anchor}/{setting}"] = entry
    return out


def _ci(b: dict[str, float], digits: int = 2) -> str:
    return f"{b['mean']:.{digits}f} [{b['lo']:.{digits}f}, {b['hi']:.{digits}f}]"


def render_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    settings = summary["settings"]
    headers = ["anchor/recompute", "share", "agree attn", "agree both", "KL attn", "KL both", "gold lp Δ both",
               "exact stock", "exact spans", "exact Δ stock", "warm TTFT", "x stock"]
    lines = []
    firsts = {}  # per task, its first setting (the layout-only comparison is the same for all of a task's)
    for name, e in settings.items():
        firsts.setdefault(name.partition(":")[0] if ":" in name else "", e)
        sp = e.get("speed", {})
        lines.append([
            name, e["recomputed_share"], _ci(e["attention"]["agreement"]), _ci(e["both"]["agreement"]),
            _ci(e["attention"]["kl"], 3), _ci(e["both"]["kl"], 3), _ci(e["both"]["gold_lp_delta"], 2),
            _ci(e["exact_match"]["stock"]), _ci(e["exact_match"]["spans"]),
            _ci(e["exact_match_diff"]) if "exact_match_diff" in e else "-",
            sp.get("warm_ttft_s", float("nan")),
            sp.get("speedup_vs_stock_reordered") or float("nan"),
        ])
    title = (f"quality on {model_label(args.model)}: {summary['items']} items x {args.docs} documents "
             f"(filler {args.filler}), along the gold answer; engine prompt log-probs, top {TOP}; "
             "means with bootstrap 95% intervals")
    text = title + "\n" + format_table(headers, lines) if lines else "(no QA items)"
    for task, first in firsts.items():
        lay = first["layout"]
        em = first["exact_match"]
        chance = 0.25 if task == "judge" else summary["chance"] if task in ("", "qa") else None
        text += (f"\n{task + ': ' if task else ''}layout only (stock on the span layout vs stock plain): agreement "
                 f"{_ci(lay['agreement'])}, KL {_ci(lay['kl'], 3)}, gold lp Δ {_ci(lay['gold_lp_delta'])}; exact "
                 f"match stock plain {_ci(em['stock'])}, stock layout {_ci(em['layout'])}"
                 f"{f' (chance {chance:.2f})' if chance else ''}; padding {first['padding_overhead']:.0%} of the span layout")
    for name, e in settings.items():
        if "same" in e:
            text += (f"\n{name} against stock plain in the span order (reordered on {e['reordered']:.0%} of items; order "
                     f"only: agreement {_ci(e['order']['agreement'])}, KL {_ci(e['order']['kl'], 3)}): agreement "
                     f"{_ci(e['same']['agreement'])}, KL {_ci(e['same']['kl'], 3)}, gold lp Δ "
                     f"{_ci(e['same']['gold_lp_delta'])}; exact match stock in that order "
                     f"{_ci(e['exact_match']['same_order'])}, Δ spans (paired) {_ci(e['exact_match_diff_same_order'])}")
    for name, e in settings.items():
        if "same_pick" in e:
            text += (f"\n{name}: the same pick as the stock judge, spans {_ci(e['same_pick']['spans'])}, stock on the "
                     f"span layout {_ci(e['same_pick']['layout'])}")
    for name, e in settings.items():
        if "hf_check" in e:
            h = e["hf_check"]
            text += (f"\nHF check {name} ({h['items']} items, attention only): exact KL {h['hf_kl']:.3f} vs engine "
                     f"top-{TOP} {h['engine_kl_top20']:.3f}; agreement HF {h['hf_agreement']:.2f} vs engine "
                     f"{h['engine_agreement']:.2f}")
    if "speed" in summary:
        s = summary["speed"]
        text += (f"\nspeed: {s['docs']} documents x {s['tokens']} tokens, warm (another order, another question): stock "
                 f"reordered TTFT {s['stock_reordered_ttft_s']:.3f} s; spans per recompute setting:\n")
        text += format_table(["recompute", "share", "warm TTFT (s)", "x stock"], [
            [label, e["recomputed_share"], e["warm_ttft_s"], e["speedup_vs_stock_reordered"] or float("nan")]
            for label, e in s["settings"].items()
        ])
    return text


def plot(summary: dict[str, Any], args: argparse.Namespace) -> Any:
    fig, (ax, ax2) = new_figure(2, width=5.0)
    settings = summary["settings"]
    speed = "speed" in summary
    if not settings and speed:  # the speed side alone
        rows = summary["speed"]["settings"]
        ax.bar(["stock", *rows], [summary["speed"]["stock_reordered_ttft_s"], *(e["warm_ttft_s"] for e in rows.values())])
        ax.set_ylabel("warm TTFT (s)")
        ax.set_yscale("log")
        ax.set_title(f"recompute settings, {summary['speed']['docs']} x {summary['speed']['tokens']} tokens")
        ax2.set_axis_off()
        fig.tight_layout()
        return fig
    for name, e in settings.items():
        x = e["speed"]["warm_ttft_s"] if speed and "speed" in e else e["recomputed_share"]
        for axis, metric in ((ax, "agreement"), (ax2, "kl")):
            b = e["both"][metric]
            axis.errorbar([x], [b["mean"]], yerr=[[b["mean"] - b["lo"]], [b["hi"] - b["mean"]]], fmt="o", capsize=3)
            axis.annotate(name.split("/", 1)[1], (x, b["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if speed:
        stock = summary["speed"]["stock_reordered_ttft_s"]
        ax.scatter([stock], [1.0], marker="*", s=80, color="k", label="stock (full attention)")
        ax2.scatter([stock], [0.0], marker="*", s=80, color="k", label="stock (full attention)")
    xlabel = (f"warm TTFT (s), {summary['speed']['docs']} x {summary['speed']['tokens']} tokens" if speed
              else "share of span tokens recomputed")
    for axis, ylabel in ((ax, "argmax agreement with stock, along the gold answer"), (ax2, "KL(stock || spans) per token, nats")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        if speed:
            axis.set_xscale("log")
            axis.legend(fontsize=8)
    lows = [e["both"]["agreement"]["lo"] for e in settings.values()]
    ax.set_ylim(max(0.0, min(lows, default=0.0) - 0.05), 1.01)
    ax.set_title(f"recompute: quality vs speed, {model_label(args.model)}")
    ax2.set_title(f"{summary['items']} items, 95% intervals")
    fig.tight_layout()
    return fig
