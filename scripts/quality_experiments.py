"""HF-transformers experiments behind two choices of docs/design.md ("Recompute") and docs/benchmarks.md
("quality"), on the QA items of `spanq bench quality`. No vLLM: the HF reference (`benchmarks/hf_span.py`).

    python scripts/quality_experiments.py criteria [--items 10] [--filler 12] [--model default]
        argmax agreement with full attention along the gold answer, and KL, for recompute block choices:
        none, each span's first / last block, spanq's share criterion, question overlap alone, block position,
        the blocks whose cached K/V deviate most from their in-context K/V at layer 1 or 3 (CacheBlend's), and
        the blocks the question attends to most under span attention at one layer or over all of them (its
        attention mass; at layer 0 it depends on the tokens and positions alone). `--only A,B`: the choices whose
        names start so, only; `--task cross`: items whose answer needs two documents.
    python scripts/quality_experiments.py padding [--items 20] [--filler 0] [--model default] [--layouts A,B]
        what the span layout's padding costs under full attention (the layout alone, against the plain prompt):
        newline padding after each span (spanq's: the last span's tail unpadded), after every span (before
        that), before it, split around it, other pad tokens, none. `--layouts`: names starting so, only.
    python scripts/quality_experiments.py temperature [--items 20] [--filler 12] [--model default] [--scales ...]
        an attention temperature on span tokens (APE's): the spans' cached keys multiplied by each scale of
        `--scales` (logits of span tokens scaled so for whatever reads them), with no recompute and with `first`;
        KL and argmax agreement against full attention on the plain prompt (what a user sees).
    python scripts/quality_experiments.py bias [--items 20] [--filler 12] [--model default] [--biases ...]
        APE's other knob: each bias of `--biases` added to the attention logits the text after the spans gives
        span tokens (their weights times e^bias), with no recompute and with `question` (the default); KL and
        agreement against full attention on the plain prompt, with bootstrap intervals.
    python scripts/quality_experiments.py leadin [--items 20] [--filler 12] [--model default] [--only A,B]
        what a canonical anchor's lead-in buys, by its length: none, the first one, two, four or eight (the
        default since 2026-12-05) of spanq's neutral passages, the first four twice, twelve (four more written
        here), and the first document of another item (what "auto" reads on these items: a document like the
        span's own); with no recompute and with `question`, against full attention on the same layout (the tokens
        are the same in every row: the lead-in lives in the anchor only), each row's KL less the default's paired
        item by item. `--only A,B`: the rows whose names start so, and the default.
    python scripts/quality_experiments.py roles [--items 20] [--filler 12] [--model default]
        documents an application puts in its system prompt (LangChain's RAG template): against full attention on
        that plain prompt (what stock vLLM reads) with the documents in the order the spans read them, the span layout before spanq kept the role (the documents a
        user turn of their own, between the system prompt and the question), and after it, with each span's
        anchor the template's opening of a user turn (spanq's: the anchor the same document has in a user
        message, one cached copy for both) or of a system message; full attention on each layout, and span
        attention with no recompute and with `question`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks import hf_span
from benchmarks.quality import SYSTEM, bootstrap, make_items, make_task_items, qa_query
from spanq_backend.serving.generator import flattened_prompt_ids, load_chat_tokenizer
from spanq_backend.serving.lowering import (
    BLOCK_SEPARATOR,
    NEUTRAL_LEAD_IN,
    NEUTRAL_PASSAGES,
    LoweredPrompt,
    lower,
)
from spanq_backend.serving.models import resolve_model
from spanq_backend.serving.recompute import choose_blocks, plan_recompute


def _ci(b: dict[str, float]) -> str:
    return f"{b['mean']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]"


def _measures(rows: list[tuple[float, ...]], base: list[tuple[float, ...]] | None = None) -> str:
    """Agreement and KL over items (rows of `(KL, agreement, ...)`) with bootstrap intervals, and, given `base`
    (the same items under the row compared with), the KL less base's, paired item by item."""
    line = f"agreement {_ci(bootstrap([r[1] for r in rows]))}  KL {_ci(bootstrap([r[0] for r in rows]))}"
    if base is not None and rows is not base:
        line += f"  KL - default's {_ci(bootstrap([r[0] - b[0] for r, b in zip(rows, base)]))}"
    return line


def _budget(low: LoweredPrompt, share: float) -> tuple[list[int], int]:
    sizes = [(e - s) // low.table.block_size for s, e in low.table.spans]
    return sizes, max(1, math.floor(share * sum(sizes) + 1e-9))


def by_position(low: LoweredPrompt, share: float) -> list[tuple[int, int]]:
    """Block 0 of each span, then block 1 of each, …"""
    sizes, budget = _budget(low, share)
    order = sorted((b, i) for i, n in enumerate(sizes) for b in range(n))
    return sorted((i, b) for b, i in order[:budget])


def by_overlap(low: LoweredPrompt, share: float, pad: int) -> list[tuple[int, int]]:
    """Only the question overlap (spanq's criterion without the first blocks' priority)."""
    _, budget = _budget(low, share)
    everything = choose_blocks(low, 1.0, pad)
    after = set(low.token_ids[low.table.spans[-1][1] :]) - {pad}
    bs = low.table.block_size

    def shared(pair: tuple[int, int]) -> int:
        s = low.table.spans[pair[0]][0] + pair[1] * bs
        return len(set(low.token_ids[s : s + bs]) & after)

    return sorted(sorted(everything, key=lambda p: (-shared(p), p))[:budget])


def deviation_orders(model: Any, low: LoweredPrompt, layers: tuple[int, ...]) -> dict[int, list[tuple[int, int]]]:
    """Per layer of `layers`, every span block, most deviating first: how far the K/V span attention cached for its
    tokens is from the K/V full attention computes for them in this prompt (CacheBlend's criterion, read from the
    model; squared L2 distance of keys and values, summed over the block's tokens). One span pass and one full
    pass give every layer."""
    end = low.table.spans[-1][1]
    span_kv = hf_span.span_layer_kv(model, low.token_ids, low.table)
    full_kv = hf_span.full_layer_kv(model, low.token_ids[:end])
    bs = low.table.block_size
    orders = {}
    for layer in layers:
        (span_k, span_v), (full_k, full_v) = span_kv[layer], full_kv[layer]
        per_token = ((span_k - full_k) ** 2).sum(dim=(0, 1, 3)) + ((span_v - full_v) ** 2).sum(dim=(0, 1, 3))
        score = {(i, b): float(per_token[s + b * bs : s + (b + 1) * bs].sum())
                 for i, (s, e) in enumerate(low.table.spans) for b in range((e - s) // bs)}
        orders[layer] = sorted(score, key=lambda pair, score=score: -score[pair])
    return orders


def attention_orders(model: Any, low: LoweredPrompt, pad: int, layers: tuple[int, ...]) -> dict[str, list[tuple[int, int]]]:
    """Per layer of `layers` (and over every layer, "all"), every span block, the most attended first: the
    attention probability the question's tokens (the text after the spans, less the last span's tail the prompt
    keeps as context) give the block's tokens under span attention — what the answer reads, before anything is
    recomputed — summed over heads and the question's tokens (each layer's rows sum to one per head and token, so
    "all" weighs every layer alike)."""
    table = low.table
    bs = table.block_size
    tail = low.prepare_tails.get(len(table.spans) - 1, ())
    kept = len(tail)
    while kept and tail[kept - 1] == pad:
        kept -= 1
    weights = hf_span.span_attention_weights(model, low.token_ids, table)
    per_layer = [w[:, kept:, :].sum(dim=(0, 1)) for w in weights]  # attention each key position receives
    blocks = [(i, b, s + b * bs) for i, (s, e) in enumerate(table.spans) for b in range((e - s) // bs)]

    def order(mass: Any) -> list[tuple[int, int]]:
        score = {(i, b): float(mass[start : start + bs].sum()) for i, b, start in blocks}
        return sorted(score, key=lambda pair: (-score[pair], pair))

    orders = {f"L{layer}": order(per_layer[layer]) for layer in layers}
    orders["all"] = order(sum(per_layer))
    return orders


def by_deviation(order: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    return sorted(order[:budget])


def criteria(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    orders: dict[int, list[tuple[int, int]]] = {}  # per layer, for the item being measured
    deviation = {
        f"deviation L{layer} {share}": (lambda low, layer=layer, share=share:
                                         by_deviation(orders[layer], _budget(low, share)[1]))
        for layer in (1, 3) for share in (0.1, 0.15)
    }
    deviation.update({
        f"deviation L{layer}, first's count": (lambda low, layer=layer:
                                               by_deviation(orders[layer], len(low.table.spans)))
        for layer in (1, 3)
    })
    attended: dict[str, list[tuple[int, int]]] = {}  # per layer group, for the item being measured
    attention_layers = (0, 1, 3, 15, 29)
    attention = {
        f"attention {group}, first's count": (lambda low, group=group: sorted(attended[group][: len(low.table.spans)]))
        for group in [*(f"L{layer}" for layer in attention_layers), "all"]
    }
    attention.update({
        f"attention {group} {share}": (lambda low, group=group, share=share:
                                       sorted(attended[group][: _budget(low, share)[1]]))
        for group in ("L0", "all") for share in (0.1, 0.15)
    })
    choices = {
        "none": lambda low: [],
        "first": lambda low: choose_blocks(low, "first", pad),
        "question (spanq's default)": lambda low: choose_blocks(low, "question", pad),
        "last": lambda low: choose_blocks(low, "last", pad),
        "share 0.1 (spanq)": lambda low: choose_blocks(low, 0.1, pad),
        "share 0.15 (spanq)": lambda low: choose_blocks(low, 0.15, pad),
        "overlap 0.1": lambda low: by_overlap(low, 0.1, pad),
        "overlap 0.15": lambda low: by_overlap(low, 0.15, pad),
        "position 0.1": lambda low: by_position(low, 0.1),
        "position 0.15": lambda low: by_position(low, 0.15),
        **deviation,
        **attention,
    }
    if args.only:
        wanted = args.only.split(",")
        choices = {k: v for k, v in choices.items() if any(k.startswith(w) for w in wanted)}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in choices}
    for item in make_task_items(args.task, args.items, 5, seed=0, filler=args.filler):
        low = lower(qa_query(item, 16).input, tokenizer, 32, pad)
        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        full = hf_span.full_attention_next_token_logprobs(model, low.token_ids, gold)
        blocks = sum((e - s) // 32 for s, e in low.table.spans)
        if any(name.startswith("deviation") for name in choices):
            orders.update(deviation_orders(model, low, (1, 3)))
        if any(name.startswith("attention") for name in choices):
            attended.update(attention_orders(model, low, pad, attention_layers))
        for name, choose in choices.items():
            plan = plan_recompute(low, choose(low))
            span = hf_span.span_attention_next_token_logprobs(model, low.token_ids, plan.lowered.table, gold)
            results[name].append((
                float(hf_span.kl_divergence(full, span).mean()),
                float((full.argmax(-1) == span.argmax(-1)).double().mean()),
                len(plan.blocks) / blocks,
            ))
    base = results.get("question (spanq's default)")
    for name, rows in results.items():
        print(f"{name:32s} share {sum(r[2] for r in rows) / len(rows):.3f}  {_measures(rows, base)}")


def _relaid(low: LoweredPrompt, pad: int, how: str) -> list[int]:
    """The layout's tokens with each text span's padding moved (`before`, `split`) or dropped (`none`)."""
    ids, table = low.token_ids, low.table
    out = list(ids[: table.spans[0][0]])
    for s, e in table.spans:
        text = list(ids[s:e])
        while text and text[-1] == pad:
            text.pop()
        n = (e - s) - len(text)
        out += {"after": text + [pad] * n, "before": [pad] * n + text, "none": text,
                "split": [pad] * (n // 2) + text + [pad] * (n - n // 2)}[how]
    return out + list(ids[table.spans[-1][1] :])


def _every_span_padded(low: LoweredPrompt, pad: int) -> list[int]:
    """The layout as it was before a span that context follows kept its tail as context: that span padded too
    (its prepare request's tokens, the tail then padding, in place of its tail)."""
    ids, out, at = low.token_ids, [], 0
    for i, (_, e) in enumerate(low.table.spans):
        tail = list(low.prepare_tails.get(i, ()))
        real = next(k for k in range(len(tail), -1, -1) if tail[:k] == ids[e : e + k] and set(tail[k:]) <= {pad})
        out += ids[at:e] + tail
        at = e + real
    return out + ids[at:]


def padding(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    tokens = {"newline": pad, "space": tokenizer.encode(" ", add_special_tokens=False)[-1],
              "end of text": tokenizer.eos_token_id, "full stop": tokenizer.encode(".", add_special_tokens=False)[-1]}
    results: dict[str, list[tuple[float, float, float]]] = {}
    for item in make_items(args.items, 5, seed=0, filler=args.filler):
        query = qa_query(item, 16)
        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        plain = flattened_prompt_ids(tokenizer, query.input)
        ref = hf_span.full_attention_next_token_logprobs(model, plain, gold)
        layouts = {f"{name} after each span": lower(query.input, tokenizer, 32, t).token_ids for name, t in tokens.items()}
        low = lower(query.input, tokenizer, 32, pad)
        for how in ("before", "split", "none"):
            layouts[f"newline, {how}"] = _relaid(low, pad, how)
        layouts["newline after every span"] = _every_span_padded(low, pad)
        for name, ids in layouts.items():
            if args.layouts and not any(name.startswith(w) for w in args.layouts.split(",")):
                continue
            lp = hf_span.full_attention_next_token_logprobs(model, ids, gold)
            results.setdefault(name, []).append((
                float(hf_span.kl_divergence(ref, lp).mean()),
                float((ref.argmax(-1) == lp.argmax(-1)).double().mean()),
                (len(ids) - len(plain)) / len(ids),
            ))
    for name, rows in results.items():
        n = len(rows)
        print(f"{name:28s} extra tokens {sum(r[2] for r in rows) / n:.3f}  agreement {sum(r[1] for r in rows) / n:.3f}  "
              f"KL {sum(r[0] for r in rows) / n:.4f}")


def _sweep(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace, recompute: str, knob: str,
           values: list[float], label: Any) -> dict[str, list[tuple[float, float]]]:
    """Per (recompute setting, value of `knob` of `span_attention_next_token_logprobs`), each QA item's KL and argmax
    agreement against full attention on the plain prompt, with nothing recomputed and with `recompute`;
    `label(setting, value)` names each row."""
    results: dict[str, list[tuple[float, float]]] = {}
    for item in make_items(args.items, 5, seed=0, filler=args.filler):
        query = qa_query(item, 16)
        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        ref = hf_span.full_attention_next_token_logprobs(model, flattened_prompt_ids(tokenizer, query.input), gold)
        low = lower(query.input, tokenizer, 32, pad)
        for setting in ("0", recompute):
            plan = plan_recompute(low, choose_blocks(low, recompute, pad) if setting == recompute else [])
            for value in values:
                lp = hf_span.span_attention_next_token_logprobs(
                    model, plan.lowered.token_ids, plan.lowered.table, gold, **{knob: value})
                results.setdefault(label(setting, value), []).append((
                    float(hf_span.kl_divergence(ref, lp).mean()), float((ref.argmax(-1) == lp.argmax(-1)).double().mean())))
    return results


def temperature(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    scales = [float(x) for x in args.scales.split(",")]
    results = _sweep(model, tokenizer, pad, args, "first", "key_scale", scales,
                     lambda setting, scale: f"recompute {setting:5s} key scale {scale:.2f}")
    for name, rows in results.items():
        n = len(rows)
        print(f"{name}  agreement {sum(r[1] for r in rows) / n:.3f}  KL {sum(r[0] for r in rows) / n:.4f}  ({n} items)")


def bias(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    biases = [float(x) for x in args.biases.split(",")]
    results = _sweep(model, tokenizer, pad, args, "question", "span_bias", biases,
                     lambda setting, b: f"recompute {setting:8s} bias {b:+.2f}")
    for name, rows in results.items():
        print(f"{name}  {_measures(rows)}  ({len(rows)} items)")


MORE_PASSAGES = (  # four more passages in the neutral lead-in's manner, for the row of twelve of `leadin`
    (
        "Chess is played on a board of sixty-four squares by two players, each with sixteen pieces. The game ends when "
        "one king is attacked and cannot escape, and a draw is declared when neither side can win or the same position "
        "comes up three times."
    ),
    (
        "The river port handles grain, timber and gravel brought down by barge from the upland farms and quarries. Its "
        "two cranes were replaced in 1988, and a ferry still crosses to the far bank every twenty minutes in summer."
    ),
    (
        "Wool is sheared from the sheep in late spring, washed to remove the grease, then carded so that the fibres lie "
        "in one direction. Spun into yarn and dyed, it is knitted or woven into cloth that keeps its warmth when wet."
    ),
    (
        "The annual music festival takes place in the park on the last weekend of July. Three stages host around forty "
        "bands, food stalls line the main path, and the evening concerts end with fireworks over the lake."
    ),
)


def leadin(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    items = make_task_items(args.task, args.items + 1, 5, seed=0, filler=args.filler)
    base_name = "neutral 8 (spanq's default)"
    lead_ins = {
        "none": "",
        "neutral 1": NEUTRAL_PASSAGES[0],
        "neutral 2": BLOCK_SEPARATOR.join(NEUTRAL_PASSAGES[:2]),
        "neutral 4": BLOCK_SEPARATOR.join(NEUTRAL_PASSAGES[:4]),
        "neutral 4 twice": BLOCK_SEPARATOR.join((*NEUTRAL_PASSAGES[:4], *NEUTRAL_PASSAGES[:4])),
        base_name: NEUTRAL_LEAD_IN,
        "neutral 12": BLOCK_SEPARATOR.join((*NEUTRAL_PASSAGES, *MORE_PASSAGES)),
        "another item's document": None,  # per item: the next item's first document
    }
    if args.only:
        wanted = args.only.split(",")
        lead_ins = {k: v for k, v in lead_ins.items() if k == base_name or any(k.startswith(w) for w in wanted)}
    results: dict[str, list[tuple[float, float]]] = {}
    lead_in: Any
    for item, other in itertools.pairwise(items):
        query = qa_query(item, 16).input
        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        base = lower(query, tokenizer, 32, pad)
        full = hf_span.full_attention_next_token_logprobs(model, base.token_ids, gold)
        for name, lead_in in lead_ins.items():
            low = lower(query, tokenizer, 32, pad, lead_in=other.docs[0] if lead_in is None else lead_in)
            assert low.token_ids == base.token_ids, "a lead-in changed the prompt's tokens"
            for setting in ("0", "question"):
                plan = plan_recompute(low, choose_blocks(low, setting, pad) if setting != "0" else [])
                lp = hf_span.span_attention_next_token_logprobs(model, low.token_ids, plan.lowered.table, gold)
                results.setdefault(f"{setting:8s} {name}", []).append(
                    (float(hf_span.kl_divergence(full, lp).mean()), float((full.argmax(-1) == lp.argmax(-1)).double().mean())))
    for name, rows in results.items():
        print(f"{name:40s} {_measures(rows, results[f'{name[:8]} {base_name}'])}  ({len(rows)} items)", flush=True)


def _system_anchor(tokenizer: Any, pad: int) -> tuple[int, ...]:
    """The anchor a span of a system message would have under the template's opening of a system message (the
    lead-in after it), padded to a 32-token block: the alternative `roles` measures against spanq's."""
    from spanq_backend.serving.lowering import render_chat

    mark = "\u27e6spanq:anchor\u27e7"
    chat = [{"role": "system", "content": NEUTRAL_LEAD_IN + BLOCK_SEPARATOR + mark}, {"role": "user", "content": "?"}]
    head = render_chat(tokenizer, chat, add_generation_prompt=False).partition(mark)[0]
    ids = tokenizer.encode(head, add_special_tokens=False)
    return tuple(ids + [pad] * (-len(ids) % 32))


def roles(model: Any, tokenizer: Any, pad: int, args: argparse.Namespace) -> None:
    from dataclasses import replace

    from spanq_integrations import cross, plus, system, user

    results: dict[str, list[tuple[float, float]]] = {}
    system_anchor = _system_anchor(tokenizer, pad)
    spanqs = "system, user-turn anchor (spanq's)"

    def row(name: str, full: Any, lp: Any) -> None:
        results.setdefault(name, []).append(
            (float(hf_span.kl_divergence(full, lp).mean()), float((full.argmax(-1) == lp.argmax(-1)).double().mean())))

    for item in make_task_items(args.task, args.items, 5, seed=0, filler=args.filler):
        def query(role: str | None, item: Any = item, docs: list[str] | None = None) -> Any:
            group = plus(*(docs or item.docs), role=role)
            return cross(system(SYSTEM), group, user(item.question))

        gold = tokenizer.encode(item.gold, add_special_tokens=False)
        before = lower(query(None), tokenizer, 32, pad)
        kept = lower(query("system"), tokenizer, 32, pad)
        # The reference: the plain prompt with the documents in the order the spans read them (one per set).
        plain = flattened_prompt_ids(tokenizer, query("system", docs=kept.in_span_order(item.docs)))
        full = hf_span.full_attention_next_token_logprobs(model, plain, gold)
        assert kept.table.anchors is not None  # canonical anchors, per span
        system_anchored = replace(kept, table=replace(kept.table, anchors=(system_anchor,) * len(kept.table.spans)))
        for name, low in (("user turn (before)", before), (spanqs, kept), ("system, system anchor", system_anchored)):
            if name != "system, system anchor":
                row(f"layout only   {name}", full, hf_span.full_attention_next_token_logprobs(model, low.token_ids, gold))
            for setting in ("0", "question"):
                plan = plan_recompute(low, choose_blocks(low, setting, pad) if setting != "0" else [])
                lp = hf_span.span_attention_next_token_logprobs(model, low.token_ids, plan.lowered.table, gold)
                row(f"{setting:13s} {name}", full, lp)
    for name, rows in results.items():
        base = results[name[:14] + spanqs] if "layout" not in name else None
        print(f"{name:48s} {_measures(rows, base)}  ({len(rows)} items)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=("criteria", "padding", "temperature", "bias", "leadin", "roles"))
    parser.add_argument("--items", type=int, default=None)
    parser.add_argument("--filler", type=int, default=None)
    parser.add_argument("--model", default="default")
    parser.add_argument("--layouts", default="", help="padding: only the layouts whose names start so (comma list)")
    parser.add_argument("--task", choices=("qa", "cross"), default="qa",
                        help="criteria, leadin: the items' shape (`spanq bench quality --tasks`: one document answers, or two)")
    parser.add_argument("--only", default="", help="criteria, leadin: only the rows whose names start so (comma list)")
    parser.add_argument("--biases", default="-0.5,-0.2,0,0.2,0.5",
                        help="bias: what is added to the logits of span tokens for the text after them (comma list)")
    parser.add_argument("--scales", default="0.9,1.0,1.1,1.2,1.3",
                        help="temperature: the factors on the spans' keys (comma list)")
    args = parser.parse_args()
    args.items = args.items or (10 if args.experiment == "criteria" else 20)
    args.filler = args.filler if args.filler is not None else (0 if args.experiment == "padding" else 12)
    path = resolve_model(args.model)
    tokenizer = load_chat_tokenizer(path)
    model = hf_span.load_hf_model(path)
    pad = tokenizer.encode("\n", add_special_tokens=False)[-1]
    experiments = {"criteria": criteria, "padding": padding, "temperature": temperature, "bias": bias,
                   "leadin": leadin, "roles": roles}
    experiments[args.experiment](model, tokenizer, pad, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
