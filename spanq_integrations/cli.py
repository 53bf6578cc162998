"""The `spanq` command: show a query's optimized plan, run a query, or start the server / the benchmarks.

    spanq plan FILE [--span-aware/--no-span-aware] [--tree-k K] [--json]
    spanq run  FILE [--backend URL|embedded] [--model NAME] [--tree-k K] [--json]
    spanq serve ...      (the span-aware server; needs the backend extra)
    spanq bench ...      (the benchmarks; needs the backend extra)

FILE is a query in spnl JSON, or `-` for stdin. A bad input prints one line, `spanq: error: ...`, and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spanq_integrations.backends.protocol import BackendCapabilities, CallMetrics
from spanq_integrations.optimizer.context import TreeReduction
from spanq_integrations.query.errors import SpanQueryError, check_fan_in
from spanq_integrations.query.ir import Chat, Generate, Map, Node, render, transform

__all__ = ["main"]

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_SOME_FAILED = 1  # `run --bulk`: every query ran or was reported, some of them with an error

# Subcommands that live in the server package; each module has `<name>_main(argv) -> int`.
DELEGATED = {"serve": "spanq_backend.serving.server", "bench": "benchmarks", "prepare": "spanq_backend.serving.prepare",
             "tier": "spanq_backend.serving.tier_command"}
BACKEND_EXTRA_HINT = "pip install 'spanq[backend]'"
CLUSTER_MODULE = "spanq_backend.cluster.app"
CLUSTER_BULK_MODULE = "spanq_backend.cluster.bulk"
CLUSTER_EXTRA_HINT = "pip install 'spanq[cluster]'"


class CommandError(Exception):
    """A user-facing failure of the command line (bad file, missing extra); printed as one line."""


# --------------------------------------------------------------------------------------------- input


def read_text(file: str) -> str:
    """The text of `file` (`-` reads stdin); a `CommandError` naming the file if it cannot be read."""
    if file == "-":
        return sys.stdin.read()
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CommandError(f"cannot read {file}: {reason}") from e


def read_query(file: str) -> Node:
    """The query in `file` (spnl JSON; `-` reads stdin)."""
    from spanq_integrations.query.spnl_json import loads

    return loads(read_text(file))


def with_model(query: Node, model: str) -> Node:
    """`query` with every call (generate, chat, map) running on `model`."""

    def set_model(node: Node) -> Node:
        if isinstance(node, (Generate, Chat, Map)) and node.model != model:
            return node.model_copy(update={"model": model})
        return node

    return transform(query, set_model)


# --------------------------------------------------------------------------------------------- output


def metrics_table(calls: Sequence[CallMetrics], totals: dict[str, float]) -> str:
    """A plain-text table of per-call metrics, with a totals row."""
    header = ("path", "model", "TTFT ms", "prompt", "cached", "generated", "padded", "wall ms")
    rows = [
        (
            c.path,
            c.model or "-",
            "-" if c.ttft_s is None else f"{c.ttft_s * 1000:.1f}",
            str(c.prompt_tokens),
            str(c.cached_tokens),
            str(c.generated_tokens),
            str(c.padded_tokens),
            f"{c.wall_s * 1000:.1f}",
        )
        for c in calls
    ]
    rows.append(
        (
            f"total ({int(totals['calls'])} calls)",
            "",
            "",
            str(int(totals["prompt_tokens"])),
            str(int(totals["cached_tokens"])),
            str(int(totals["generated_tokens"])),
            str(int(totals["padded_tokens"])),
            f"{totals['wall_s'] * 1000:.1f}",
        )
    )
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        # text columns left-aligned, numbers right-aligned
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows[:-1]), rule, line(rows[-1])])


# --------------------------------------------------------------------------------------------- commands


def _tree_reduction(args: argparse.Namespace) -> TreeReduction | None:
    """`--tree-k K` and `--reducer NAME` as one `TreeReduction`, checked: a reducer needs `--tree-k`, and one
    whose combine step is exact in code."""
    if args.reducer is not None and args.tree_k is None:
        raise CommandError("--reducer needs --tree-k: it says how a tree of judges combines their answers")
    if args.tree_k is None:
        return None
    if args.reducer is None:
        return TreeReduction(k=args.tree_k)
    from spanq_integrations.query.errors import QueryValidationError
    from spanq_integrations.runtime.reducers import reducer_from_combine

    try:
        reducer = reducer_from_combine(args.reducer, {}, "--reducer")
    except QueryValidationError as e:  # (its path is where a query's combine would say it, not the flag's)
        raise CommandError(f"--reducer: {e.message}") from None
    if reducer.leaf_instruction("") != reducer.instruction(""):  # (select: every leaf's answer was refused)
        raise CommandError(f"--reducer {args.reducer}: its leaves must be asked otherwise than the query's judge asks "
                           f"(select rates every candidate): a query file has no such instruction. Use --tree-k "
                           f"alone (a tree of model calls), or judge(..., reducer={args.reducer!r}) in Python")
    return TreeReduction(k=args.tree_k, combine="code", reducer=args.reducer)


def cmd_plan(args: argparse.Namespace) -> int:
    from spanq_integrations.optimizer import optimize

    query = read_query(args.file)
    capabilities = BackendCapabilities(
        name="span" if args.span_aware else "openai", span_aware=args.span_aware
    )
    plan = optimize(query, capabilities, tree_reduction=_tree_reduction(args))
    if args.json:
        from spanq_integrations.query.spnl_json import to_json

        print(json.dumps(to_json(plan), indent=2, ensure_ascii=False))
    else:
        print(render(plan))
    return 0


def _choices_of_answer(query: Node) -> int:
    """How many choices the call that answers `query` asks for (1 where no one call answers it)."""
    from spanq_integrations.runtime.executor import answer_node

    node = answer_node(query)
    return node.n if isinstance(node, Generate) else 1


def read_bulk(file: str) -> list[tuple[int, Node | str]]:
    """The queries of a JSONL file (one spnl JSON query per line; blank lines skipped): (line number, the
    query, or the error that names what is wrong with that line)."""
    from spanq_integrations.query.spnl_json import loads

    items: list[tuple[int, Node | str]] = []
    for number, line in enumerate(read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append((number, loads(line)))
        except SpanQueryError as e:
            items.append((number, f"line {number}: {e}"))
    return items


def cmd_bulk(args: argparse.Namespace) -> int:
    """`spanq run --bulk FILE`: every query of a JSONL file over a pool of span engines on Ray Data; one JSON
    line per query on stdout, in input order (`index`: its place among the file's queries, `line`)."""
    if args.backend not in (None, "embedded"):
        raise CommandError("--bulk runs on a pool of embedded span engines (--actors); it takes no --backend")
    ignored = [flag for flag, given in (("--tree-k", args.tree_k is not None), ("--reducer", args.reducer is not None),
                                        ("--json", args.json), ("--verbose", args.verbose)) if given]  # fmt: skip
    if ignored:
        raise CommandError(f"--bulk does not take {', '.join(ignored)}: it prints one JSON line per query, each "
                           "query run as the file gives it")
    actors = 2 if args.actors is None else args.actors
    if actors < 1:
        raise CommandError(f"--actors must be at least 1, got {actors}")
    items = read_bulk(args.file)
    runnable = [(k, q if not args.model else with_model(q, args.model)) for k, (_, q) in enumerate(items) if not isinstance(q, str)]
    try:
        bulk = importlib.import_module(CLUSTER_BULK_MODULE)
    except ModuleNotFoundError as e:
        raise CommandError(f"spanq run --bulk needs Ray Data and the backend: {CLUSTER_EXTRA_HINT} (missing {e.name!r})") from e
    results = bulk.run_bulk([q for _, q in runnable], actors=actors,
                            model=args.model or _bulk_model([q for _, q in runnable]), address=args.ray_address)  # fmt: skip
    failed = 0
    following = 0

    def emit(k: int, fields: dict[str, Any]) -> None:
        print(json.dumps({"index": k, "line": items[k][0], **fields}, ensure_ascii=False), flush=True)

    def emit_malformed_until(k_stop: int) -> int:
        nonlocal following
        count = 0
        while following < k_stop:
            if isinstance(items[following][1], str):
                emit(following, {"error": items[following][1]})
                count += 1
            following += 1
        return count

    try:
        for item in results:
            k = runnable[item.index][0]
            failed += emit_malformed_until(k)
            fields = item.to_dict()
            fields.pop("index")
            failed += not item.ok
            emit(k, fields)
            following = k + 1
    except ConnectionError as e:
        raise CommandError(str(e)) from None
    failed += emit_malformed_until(len(items))
    if failed:
        print(f"spanq: {failed} of {len(items)} queries failed (see their error lines)", file=sys.stderr)
    return EXIT_SOME_FAILED if failed else 0


def _bulk_model(queries: list[Any]) -> str:
    """The model a bulk's engines run where `--model` is not given: the one its calls name, as `spanq run` of one
    query runs it (they ran on the default model whatever they named); "default" where they name none, or one the
    embedded engine cannot start (said once: each call would run on the default model). Calls that name several
    models are refused: every engine of a bulk runs one."""
    from spanq_integrations.backends.resolve import embedded_model_named
    from spanq_integrations.runtime.executor import named_models

    # each name as the engine would start it ("spnl/tiny" and "tiny": one), else as written
    names = {embedded_model_named("embedded", n) or n for q in queries for n in named_models(q)}
    if len(names) > 1:
        raise CommandError(f"the queries name {len(names)} models ({', '.join(sorted(names))}); every engine of a "
                           "bulk runs one: pass --model")  # fmt: skip
    if not names:
        return "default"
    (name,) = names
    served = embedded_model_named("embedded", name)
    if served is None:
        print(f"spanq: the queries name model {name!r}, which the embedded engine cannot start (spanq's names, tiny, "
              "tiny-<family> or a model folder): they run on the default model (--model chooses)", file=sys.stderr)  # fmt: skip
    return served or "default"


def cmd_run(args: argparse.Namespace) -> int:
    from spanq_integrations.runtime.executor import execute

    if args.bulk:
        return cmd_bulk(args)
    given = [flag for flag in ("--actors", "--ray-address") if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise CommandError(f"{', '.join(given)} run a --bulk file over a pool of engines; without --bulk they do nothing")
    query = read_query(args.file)
    if args.model:
        query = with_model(query, args.model)
    if args.verbose:
        os.environ["SPANQ_LOG_LEVEL"] = "INFO"  # read by the embedded engine when it starts
    streamed: list[str] = []
    line_open = [False]  # the streamed answer's last line not ended yet

    def end_line(_record: Any) -> bool:  # before a line of spanq's progress (stderr): end the answer's line
        if line_open[0]:
            sys.stdout.write("\n")
            sys.stdout.flush()
            line_open[0] = False
        return True

    choices = _choices_of_answer(query)

    def echo(piece: str) -> None:
        if not streamed and choices > 1:  # the streamed answer is the first of the call's choices: say so first
            sys.stdout.write("--- choice 0 ---\n")
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
        if piece:
            line_open[0] = not piece.endswith("\n")
        for handler in logging.getLogger("spanq").handlers:  # set up by the engine's start, before any piece
            handler.addFilter(end_line)  # (once: a filter already there is not added again)

    backend: Any = args.backend
    if args.model and backend in (None, "embedded"):
        # The embedded engine runs the model named: `--model tiny-qwen3`, a folder, a Hugging Face id.
        from spanq_integrations.backends import resolve_backend

        try:
            backend, _ = resolve_backend(backend, args.model)
        except ModuleNotFoundError as e:
            raise CommandError(
                f"the embedded backend needs the backend extra ({BACKEND_EXTRA_HINT}; missing module {e.name!r}), "
                "or pass --backend URL of a running server"
            ) from e
        except ValueError as e:  # a model that cannot be found (named in the message)
            raise CommandError(str(e)) from None
    try:
        result = execute(
            query,
            backend,
            tree_reduction=_tree_reduction(args),
            on_token=None if args.json else echo,
        )
    except ModuleNotFoundError as e:
        if args.backend not in (None, "embedded"):
            raise
        raise CommandError(
            f"the embedded backend needs the backend extra ({BACKEND_EXTRA_HINT}; missing module {e.name!r}), "
            "or pass --backend URL of a running server"
        ) from e
    finally:  # the answer's line is this call's: later progress lines (and later runs in this process) go as they are
        for handler in logging.getLogger("spanq").handlers:
            handler.removeFilter(end_line)
    if args.json:
        from spanq_integrations.query.spnl_json import to_json

        report: dict[str, Any] = {
            "answer": result.answer,
            "answers": result.answers,
            "result": to_json(result.tree),
            "calls": [c.model_dump() for c in result.calls],
            "totals": result.totals(),
            "unread": [u.model_dump() for u in result.unread],
        }
        print(json.dumps(report, indent=2, ensure_ascii=False))
        return _no_answer(result)
    answered, bulk = result.answer_call, result.bulk_answers
    if line_open[0]:
        print()
    if answered is not None and len(answered.choices) > 1:  # n choices: each, in order (choice 0 streamed)
        for k, choice in enumerate(answered.choices):
            if k or not streamed:
                print(f"--- choice {k} ---\n{choice}")
    elif bulk is not None and len(bulk) > 1:  # a map, a repeat, a plus of calls: every answer (none streamed)
        for k, (answer, _) in enumerate(bulk):
            print(f"--- answer {k} ---\n{answer}")
    elif not streamed:
        print(result.answer)
    for unread in result.unread:
        print(f"spanq run: the combine left out an answer it could not read: {unread.error}", file=sys.stderr)
    said: set[str] = set()
    for call in result.calls:  # (only --json showed it: a plain server's calls read as spans, silently)
        if call.fallback and call.fallback not in said:
            said.add(call.fallback)
            others = sum(1 for c in result.calls if c.fallback == call.fallback) - 1
            print(f"spanq run: {call.path}" + (f" (and {others} more calls)" if others else "") + f": {call.fallback}",
                  file=sys.stderr)
    print()
    print(metrics_table(result.calls, result.totals()))
    return _no_answer(result)


def _no_answer(result: Any) -> int:
    """1, said on stderr, where the answer is a combine that could read none of the answers below it (an empty
    answer and status 0 once, where `judge` says "no verdict"); else 0."""
    if not result.unread or result.answer or result.answer_call is not None:
        return 0
    print(f"spanq run: error: no answer: the combine could read none of the answers below it (the first: "
          f"{result.unread[0].error})", file=sys.stderr)
    return 1


def _source_checkout() -> Path | None:
    """The repository this package runs from, if it is a source checkout with its `benchmarks/` folder."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "__init__.py").is_file() else None


def _names_replicas(token: str) -> bool:
    """Whether a `spanq serve` argument is `--replicas` (or `--replica`, the prefix argparse takes for it)."""
    return token.partition("=")[0] in ("--replicas", "--replica")


def delegate(name: str, argv: list[str]) -> int:
    """Run `spanq serve` (the server package) / `spanq bench` (a source checkout's `benchmarks/`), imported
    only now."""
    module_name = DELEGATED[name]
    if name == "serve" and any(_names_replicas(a) for a in argv):
        module_name = CLUSTER_MODULE  # several span engines behind one address, on Ray Serve
        try:
            importlib.import_module("ray.serve")
        except ModuleNotFoundError as e:
            raise CommandError(f"spanq serve --replicas needs Ray Serve: {CLUSTER_EXTRA_HINT}") from e
    if name == "bench":
        root = _source_checkout()
        if root is None:
            raise CommandError(
                "spanq bench runs from a source checkout of spanq: the benchmarks/ folder is not installed "
                "with the package"
            )
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise CommandError(
            f"spanq {name} needs the backend extra: {BACKEND_EXTRA_HINT} (missing module {e.name!r})"
        ) from e
    return int(getattr(module, f"{name}_main")(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spanq", description="Span queries: say which parts of a prompt are order-free."
    )
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("spanq")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        installed = "(not installed)"
    parser.add_argument("--version", action="version", version=f"spanq {installed}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", help="print the optimized plan of a query")
    plan.add_argument("file", metavar="FILE", help="a query in spnl JSON, or - for stdin")
    plan.add_argument(
        "--span-aware",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan for a span-aware backend (default) or for a plain OpenAI-compatible one",
    )
    plan.add_argument(
        "--tree-k", type=int, metavar="K", help="tree reduction: judges read at most K children"
    )
    plan.add_argument("--reducer", metavar="NAME", help="tree reduction: combine the leaf judges' answers in code with this reducer (extract: the "
        "union of their items; count: the sum; vote: the majority) instead of model calls above the leaves")
    plan.add_argument("--json", action="store_true", help="print the plan as spnl JSON")
    plan.set_defaults(handler=cmd_plan)

    run = commands.add_parser("run", help="run a query and print its answer and per-call metrics")
    run.add_argument("file", metavar="FILE", help="a query in spnl JSON, or - for stdin")
    run.add_argument(
        "--backend",
        metavar="URL|embedded",
        help="an OpenAI-compatible server URL, spanq+http://host:port for `spanq serve`, "
        "or embedded (default); a URL backend sends $SPANQ_API_KEY as its bearer token, where it is set",
    )
    run.add_argument("--model", metavar="NAME", help="run every call on this model (overrides the file's); on the "
                     "embedded backend, the model its engine runs: default, tiny, tiny-<family>, a model folder or a "
                     "Hugging Face id")
    run.add_argument("--tree-k", type=int, metavar="K", help="tree reduction: judges read at most K children")
    run.add_argument("--reducer", metavar="NAME", help="tree reduction: combine the leaf judges' answers in code with this reducer (extract: the "
        "union of their items; count: the sum; vote: the majority) instead of model calls above the leaves")
    run.add_argument("--json", action="store_true", help="print the result, calls and totals as JSON")
    run.add_argument("--verbose", action="store_true", help="embedded: show vLLM's INFO log lines too")
    run.add_argument("--bulk", action="store_true", help="FILE is JSONL, one query per line: run them all over a "
                     "pool of span engines on Ray Data (the cluster extra), queries sharing documents on the same "
                     "engine; prints one JSON line per query, in input order")
    run.add_argument("--actors", type=int, default=None, metavar="N", help="--bulk: span engines in the pool (2)")
    run.add_argument("--ray-address", metavar="ADDR", help="--bulk: an existing Ray cluster (ray://host:10001); "
                     "default: a local Ray for this run")
    run.set_defaults(handler=cmd_run)

    for name, help_text in (
        ("serve", "start the span-aware server"),
        ("bench", "run the benchmarks"),
        ("prepare", "compile a corpus's span KV into a span tier that engines started later load"),
        ("tier", "list, check or clear what a span tier holds"),
    ):
        commands.add_parser(name, help=f"{help_text} (needs the backend extra; see `spanq {name} --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in DELEGATED:
            return delegate(args_list[0], args_list[1:])
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as e:  # --help, or a usage error argparse already printed
            return e.code if isinstance(e.code, int) else EXIT_ERROR
        check_fan_in(args.tree_k, "--tree-k", "candidates", none="leave it out for no tree reduction")
        return args.handler(args)
    except KeyboardInterrupt:
        print("spanq: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of its output has gone (`spanq plan --json | head -1`): done, quietly
        with contextlib.suppress(OSError, ValueError):  # (the rest, and the flush at exit, go nowhere)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (SpanQueryError, CommandError) as e:
        if os.environ.get("SPANQ_DEBUG"):
            raise
        print(f"spanq: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # a bug, not bad input: one line still, the traceback on request
        if os.environ.get("SPANQ_DEBUG"):
            raise
        print(f"spanq: error: {type(e).__name__}: {e} (set SPANQ_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
